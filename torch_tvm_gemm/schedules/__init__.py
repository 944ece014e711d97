"""How each kernel family runs on each target: one module per (family, target).

| family | cpu | cuda |
|---|---|---|
| gemm | ``cpu.schedule_gemm`` (bf16 on AMX: ``cpu_amx``, on AVX512-BF16: ``cpu_avx512_bf16``) | ``cuda.schedule_gemm`` (mma.sync / WMMA / TF32 / SIMT) |
| conv2d | ``cpu_conv2d.schedule_conv2d`` (depthwise: ``cpu_depthwise``, over channels-last pixels ``cpu_depthwise_nhwc``; other convs over channels-last pixels: the same blocked schedule; bf16 on AMX: ``cpu_amx_conv``, on AVX512-BF16: ``cpu_avx512_bf16_conv``) | ``cuda_conv2d.schedule_conv2d`` (implicit GEMM) |

``cuda_intrin`` holds the tensor-core intrinsics, ``cuda_wgmma`` the Hopper TMA + wgmma
kernel. Each schedule module has its own ``SCHEDULE_VERSION``; ``version(family, device)``
is what the kernel cache key holds, so a change to one schedule rebuilds only its kernels
(the CPU conv2d key holds ``cpu_conv2d``'s, the depthwise and the bf16 convs', the
CPU GEMM key ``cpu``'s, ``cpu_gemv``'s and the bf16 GEMMs').
The modules import ``tvm`` only inside their functions: importing them here is cheap.
"""

from __future__ import annotations

from . import (
    cpu,
    cpu_amx,
    cpu_amx_conv,
    cpu_avx512_bf16,
    cpu_avx512_bf16_conv,
    cpu_conv2d,
    cpu_depthwise,
    cpu_depthwise_nhwc,
    cpu_gemv,
    cuda,
    cuda_conv2d,
)

_MODULES = {
    ("gemm", "cpu"): cpu,
    ("conv2d", "cpu"): cpu_conv2d,
    ("gemm", "cuda"): cuda,
    ("conv2d", "cuda"): cuda_conv2d,
}


def module(family: str, device: str):
    """The schedule module of a kernel family on a device."""
    try:
        return _MODULES[(family, device)]
    except KeyError:
        raise NotImplementedError(
            f"torch_tvm_gemm: no {device} schedule for {family} kernels"
        ) from None


def version(family: str, device: str) -> int | tuple[int, ...]:
    """The schedule version in the cache key of a (family, device) kernel."""
    if (family, device) == ("conv2d", "cpu"):  # its depthwise and bf16 kernels: own modules
        versions = (cpu_conv2d.SCHEDULE_VERSION, cpu_depthwise.SCHEDULE_VERSION)
        versions += (cpu_amx_conv.SCHEDULE_VERSION, cpu_avx512_bf16_conv.SCHEDULE_VERSION)
        return versions + (cpu_depthwise_nhwc.SCHEDULE_VERSION,)
    if (family, device) == ("gemm", "cpu"):  # its bf16 kernels (AMX, vdpbf16ps), fp32 gemv
        return (
            cpu.SCHEDULE_VERSION,
            cpu_amx.SCHEDULE_VERSION,
            cpu_gemv.SCHEDULE_VERSION,
            cpu_avx512_bf16.SCHEDULE_VERSION,
        )
    return module(family, device).SCHEDULE_VERSION
