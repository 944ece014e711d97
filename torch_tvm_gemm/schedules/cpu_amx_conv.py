"""bfloat16 conv2d on Intel AMX tiles: an implicit GEMM over channels-last pixels.

The conv kernels of ``cpu_conv2d.py`` compute bf16 in fp32 (TVM 0.27 legalises bf16 vector
math to fp32), at a fraction of oneDNN's AMX convs. This kernel is the tile GEMM of
``cpu_amx.py`` with another A: one row per output pixel, its columns the (R, S, C) patch
under the filter (a 32-value step is 32 channels of one filter tap, contiguous in NHWC,
hence C % 32 == 0), zero where the tap falls into the padding. A's tiles are loaded from the
NHWC input as they are (see ``input_padding``) or, for narrow outputs, gathered into a
task's buffer. B is the weight as a (K, R*S*C) matrix (OIHW permuted to OHWI). The result
is the NHWC output, (batch * OH * OW, K), with bias and activation applied.

``ops/conv_ops.py`` hands it an NHWC copy of the input (zero-bordered for direct loads) and
the permuted weight, and copies the output back to NCHW (passes over the activations, small
beside the conv's math).
"""

from __future__ import annotations

from ..kernels.conv2d import Conv2dSpec, activate
from ..target import CpuInfo
from . import cpu_amx

SCHEDULE_VERSION = (4, cpu_amx.SCHEDULE_VERSION)  # it runs on cpu_amx.tile_gemm

# A's tiles are loaded straight from a zero-bordered NHWC input, 16 output pixels of one
# output row a tile, at the stride of a filter tap: no gather. Rows wider than 16 pixels
# take blocks of 32 pixels of a row, narrower ones blocks of two rows (a tile a row); the
# slots past a row's end are computed and dropped. Below MIN_DIRECT_FILL of the slots used
# (7x7 outputs: 7 of 16), the patches are gathered into the tiles instead. Measured (3x3,
# batch 1, 1 thread, vs oneDNN): 56x56 64->64 1.03x direct, 0.55-0.66x gathered; 28x28
# 128->128 0.82x, 0.54x.
MIN_DIRECT_FILL = 0.75


def _row_slots(spec: Conv2dSpec) -> int:
    """Tile rows given to each output row: 16, or whole blocks of 32."""
    half = cpu_amx.TILE_ROWS
    return half if spec.out_w <= half else -(-spec.out_w // cpu_amx.BLOCK) * cpu_amx.BLOCK


def input_padding(spec: Conv2dSpec) -> tuple[int, int, int, int] | None:
    """(top, bottom, left, right) zero padding of the NHWC input the kernel of ``spec`` reads
    with direct tile loads (covering the dropped slots' reads, and a last odd row's pair),
    or None where it gathers its patches from the unpadded input."""
    slots = _row_slots(spec)
    if spec.out_w / slots < MIN_DIRECT_FILL:
        return None
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    out_rows = spec.out_h + (spec.out_h % 2 if slots < cpu_amx.BLOCK else 0)
    rows = (out_rows - 1) * sh + (spec.r - 1) * dh + 1
    cols = (slots - 1) * sw + (spec.s - 1) * dw + 1
    return ph, max(rows - spec.h - ph, 0), pw, max(cols - spec.w - pw, 0)


def applies(spec: Conv2dSpec, cpu: CpuInfo) -> bool:
    """Whether ``spec`` runs here: bf16, groups 1, whole 32-channel steps, AMX usable."""
    return (
        spec.dtype == "bfloat16"
        and spec.device == "cpu"
        and spec.groups == 1
        and spec.c % cpu_amx.K_STEP == 0
        and cpu.amx_bf16
    )


def schedule_conv2d_amx(spec: Conv2dSpec):
    """The IRModule ``main(x_nhwc, weight_ohwi, [bias,] out_nhwc)`` of ``spec``."""
    import tvm

    return tvm.IRModule({"main": _amx_conv_func(spec)})


def _amx_conv_func(spec: Conv2dSpec):
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    def i64(v):
        return tirx.const(v, "int64")

    C, H, W, R, S = spec.c, spec.h, spec.w, spec.r, spec.s
    OH, OW, N = spec.out_h, spec.out_w, spec.k
    K = R * S * C
    padding = input_padding(spec)
    if padding is not None:
        top, bottom, left, right = padding
        H, W = H + top + bottom, W + left + right
    with IRBuilder() as ib:
        with T.prim_func():
            batch, x, weight, M, finish = nhwc_conv_args(T, tirx, spec, H, W)
            x_words = T.decl_buffer((batch * H * W * C,), "uint16", data=x.data)

            if padding is None:

                def fill_block(a_block, block):
                    _gather_patches(T, tirx, spec, x_words, a_block, M, block)

                cpu_amx.tile_gemm(T, tirx, M, N, i64(K), weight, True, finish, fill_block)
            else:
                slots = _row_slots(spec)
                rows_per_block = cpu_amx.BLOCK // slots if slots < cpu_amx.BLOCK else 1
                per_row = max(slots // cpu_amx.BLOCK, 1)  # blocks along one output row
                row_pairs = -(-OH // rows_per_block)
                (sh, sw), (dh, dw) = spec.stride, spec.dilation
                per_tap = C // cpu_amx.K_STEP

                def place(block, half):  # (image, output row, first column) of a tile
                    n = block // (row_pairs * per_row)
                    if rows_per_block == 1:
                        oh, ow0 = block // per_row % OH, block % per_row * 32 + half * 16
                    else:  # two output rows a block, one a tile
                        oh, ow0 = block % row_pairs * 2 + half, i64(0)
                    return n, oh, ow0

                def direct(block):
                    def a_tile(step, half):
                        n, oh, ow0 = place(block, half)
                        tap, part = step // per_tap, step % per_tap
                        ih, iw = oh * sh + tap // S * dh, ow0 * sw + tap % S * dw
                        at = ((n * H + ih) * W + iw) * C + part * cpu_amx.K_STEP
                        return tirx.address_of(x_words[at]), i64(sw * C * 2)

                    return True, a_tile

                def row_of(block, r):
                    n, oh, ow0 = place(block, r // 16)
                    ow = ow0 + r % 16
                    return (n * OH + oh) * OW + ow, tirx.all(ow < OW, oh < OH)

                blocks = batch * (row_pairs * per_row)
                cpu_amx.tile_gemm(T, tirx, M, N, i64(K), weight, True, finish, direct=direct,
                                  blocks=blocks, row_of=row_of)  # fmt: skip
    return ib.get()


def nhwc_conv_args(T, tirx, spec: Conv2dSpec, H, W) -> tuple:
    """Inside ``T.prim_func()``: the arguments of an implicit-GEMM conv kernel
    ``main(x_nhwc, weight_ohwi, [bias,] out_nhwc)`` (x (batch, H, W, C) as the kernel reads
    it, the weight (K, R*S*C), out (batch*OH*OW, K)), as (batch, x, weight, M, finish):
    ``finish(row, col, value)`` adds the bias, applies the activation and stores in bf16."""
    handles = cpu_amx.kernel_args(T, ("x", "weight"), spec.bias)
    batch = tirx.Var("batch", "int64")
    x = T.match_buffer(handles[0], (batch, H, W, spec.c), "bfloat16")
    weight = T.match_buffer(handles[1], (spec.k, spec.r * spec.s * spec.c), "bfloat16")
    bias = T.match_buffer(handles[2], (spec.k,), "bfloat16") if spec.bias else None
    M = batch * (spec.out_h * spec.out_w)
    out = T.match_buffer(handles[-1], (M, spec.k), "bfloat16")

    def finish(row, col, value):
        if spec.bias:
            value = value + bias[col].astype("float32")
        value = activate(spec.activation, value, "float32", "cpu")
        T.buffer_store(out, value.astype("bfloat16"), [row, col])

    return batch, x, weight, M, finish


def _gather_patches(T, tirx, spec: Conv2dSpec, x_words, a_block, M, block):
    """One block of A's tiles from the NHWC input: row p = (n, oh, ow) of the 32 in
    ``block``, step t = (tap, 32 channels)."""

    def i64(v):
        return tirx.const(v, "int64")

    C, H, W, S = spec.c, spec.h, spec.w, spec.s
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    OH, OW = spec.out_h, spec.out_w
    per_tap = C // cpu_amx.K_STEP
    tile = cpu_amx.BLOCK * cpu_amx.K_STEP
    with T.serial(i64(0), i64(cpu_amx.BLOCK)) as r:
        p = block * cpu_amx.BLOCK + r
        n, q = p // (OH * OW), p % (OH * OW)
        oh, ow = q // OW, q % OW
        # Per filter tap its C channels are one contiguous run of the NHWC input.
        with T.serial(i64(0), i64(spec.r * S)) as tap:
            ih = oh * sh - ph + tap // S * dh
            iw = ow * sw - pw + tap % S * dw
            inside = tirx.all(p < M, ih >= 0, ih < H, iw >= 0, iw < W)
            src = ((n * H + ih) * W + iw) * C
            with T.serial(i64(0), i64(per_tap)) as part:
                dst = (tap * per_tap + part) * tile + r * cpu_amx.K_STEP
                with T.If(inside):
                    with T.Then():
                        with T.vectorized(i64(0), i64(cpu_amx.K_STEP)) as k:
                            value = x_words[src + part * cpu_amx.K_STEP + k]
                            T.buffer_store(a_block, value, [dst + k])
                    with T.Else():
                        with T.vectorized(i64(0), i64(cpu_amx.K_STEP)) as k:
                            T.buffer_store(a_block, tirx.const(0, "uint16"), [dst + k])
