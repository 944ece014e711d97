"""bfloat16 conv2d on AVX512-BF16's vdpbf16ps (CPUs without AMX tiles): an implicit GEMM
over channels-last pixels.

The conv kernels of ``cpu_conv2d.py`` compute bf16 in fp32, at half the rate of torch's
bf16 convs (oneDNN, on vdpbf16ps): a converted ResNet-50 ran at 0.91x / 0.79x eager (batch
1 / 8, AMD EPYC Zen 5) with its 1x1 convs already on the GEMM of ``cpu_avx512_bf16``. This
kernel is that GEMM (``panel_gemm``) with another A: one row per output pixel, its columns
the (R, S, C) patch under the filter, read in place from the NHWC input, a run of C
channels (C / 2 bf16 pairs) per filter tap. ``ops/conv_ops.py`` hands it an NHWC copy of
the input with the conv's padding as a zero border (``input_padding``: every tap of every
output pixel then lies inside it) and the weight as (K, R*S*C) (OIHW permuted to OHWI), and
gets the NHWC output, (batch * OH * OW, K), with bias and activation applied.
"""

from __future__ import annotations

from ..kernels.conv2d import Conv2dSpec
from ..target import CpuInfo
from . import cpu_amx_conv, cpu_avx512_bf16

SCHEDULE_VERSION = (1, cpu_avx512_bf16.SCHEDULE_VERSION)  # it runs on its panel_gemm


def applies(spec: Conv2dSpec, cpu: CpuInfo) -> bool:
    """Whether ``spec`` can run here: bf16, groups 1, an even C (a tap's channels are read
    in pairs), on a CPU with AVX512-BF16 and no usable AMX tiles."""
    return (
        spec.dtype == "bfloat16"
        and spec.device == "cpu"
        and spec.groups == 1
        and spec.c % 2 == 0
        and cpu_avx512_bf16.available(cpu)
    )


def input_padding(spec: Conv2dSpec) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) zero border of the NHWC input the kernel reads: the conv's
    own padding."""
    (ph, pw) = spec.padding
    return ph, ph, pw, pw


def schedule_conv2d_dp(spec: Conv2dSpec):
    """The IRModule ``main(x_nhwc, weight_ohwi, [bias,] out_nhwc)`` of ``spec``."""
    import tvm
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    C, R, S = spec.c, spec.r, spec.s
    top, bottom, left, right = input_padding(spec)
    H, W = spec.h + top + bottom, spec.w + left + right
    OH, OW, N = spec.out_h, spec.out_w, spec.k
    (sh, sw), (dh, dw) = spec.stride, spec.dilation
    pairs = C // 2  # one filter tap's channels
    with IRBuilder() as ib:
        with T.prim_func():
            batch, x, weight, M, finish = cpu_amx_conv.nhwc_conv_args(T, tirx, spec, H, W)
            x_words = T.decl_buffer((batch * H * W * pairs,), "int32", data=x.data)

            def pixel_base(p):  # the word of channel 0 of the patch's first tap
                n, q = p // (OH * OW), p % (OH * OW)
                return ((n * H + q // OW * sh) * W + q % OW * sw) * pairs

            def tap_offset(tap):
                return (tap // S * dh * W + tap % S * dw) * pairs

            taps = cpu_avx512_bf16.Taps(R * S, tap_offset, pairs)
            cpu_avx512_bf16.panel_gemm(T, tirx, M, N, R * S * C, weight, True, x_words,
                                       pixel_base, taps, finish)  # fmt: skip
    return tvm.IRModule({"main": ib.get()})
