"""CUDA schedules for conv2d (+ bias + relu): the GEMM schedules of ``schedules/cuda.py``
applied to the implicit-GEMM math of ``kernels/conv2d_cuda.py``.

That math has the GEMM's blocks, so the GEMM schedules apply as they are: fp16 / bf16 on
sm_80+ get the tensor-core schedule (ldmatrix + mma.sync m16n8k16, fp32 accumulation), whose
global -> shared copy of "A_pad" is here the im2col gather from the NHWC input (16-byte
``cp.async`` per 8 channels when C % 8 == 0, zero-filled through the copy's predicate at the
image border); fp32 / fp64 (and fp16 / bf16 below sm_80) get the SIMT schedule. Bias and
ReLU are applied in the store stage, once per output.

groups must be 1 (ops/conv_ops.py raises a clear error otherwise).
"""

from __future__ import annotations

from ..kernels.conv2d import Conv2dSpec
from ..kernels.conv2d_cuda import conv2d_gemm_compute, load_granule
from ..kernels.gemm import GemmSpec
from . import cuda

# Part of the cache key: bump the first number when this file changes the binary. The conv
# runs on the GEMM schedules of cuda.py, so their version is part of it too.
SCHEDULE_VERSION = (3, cuda.SCHEDULE_VERSION)

# Layers with few output channels (64 in ResNet-50's first stages) would waste half of a
# 128-wide block on padded channels: they get blocks of 64 channels (and 2 x 32 per warp).
NARROW_K = 64
MMA_NARROW = cuda.MmaConfig(bm=128, bn=64, bk=32, warps_m=2, warps_n=2, stages=3)


def gemm_view(spec: Conv2dSpec) -> GemmSpec:
    """The GEMM the conv is, for the GEMM schedules' choices: N = K output channels,
    K = R*S*C, B an "nk" matrix (the weight as (K, R*S*C)), the same epilogue."""
    return GemmSpec(
        dtype=spec.dtype,
        n=spec.k,
        k=spec.r * spec.s * spec.c,
        b_layout="nk",
        bias=spec.bias,
        # (the schedules choose by shape and dtype: any element-wise epilogue stands for all)
        activation="none" if spec.activation == "none" else "relu",
        variant="gemm",
        device="cuda",
    )


def uses_tensor_cores(spec: Conv2dSpec, arch: str) -> bool:
    """The mma.sync schedule: fp16 / bf16 on sm_80+ (its own test, not the GEMM's: a GEMM
    tensor-core path for older GPUs would not be this schedule)."""
    return spec.dtype in ("float16", "bfloat16") and cuda.arch_number(arch) >= cuda.MMA_MIN_ARCH


def schedule_kind(spec: Conv2dSpec, arch: str) -> str:
    """ "mma" or "simt" (as ``cuda.schedule_kind``: packs build one library per kind)."""
    return "mma" if uses_tensor_cores(spec, arch) else "simt"


def pass_config(spec: Conv2dSpec, arch: str) -> dict:
    """TVM pass options: cp.async for the mma schedule's copies (sm_80+); no TIR CSE (see
    ``cuda.pass_config``)."""
    return {"tirx.use_async_copy": schedule_kind(spec, arch) == "mma", "tirx.disable_cse_tir": True}


def tir_pipeline(spec: Conv2dSpec, arch: str) -> None:
    """TVM's default pipeline (the conv has no TIRx kernel; see ``cuda.tir_pipeline``)."""
    return None


def mma_config(spec: Conv2dSpec) -> cuda.MmaConfig:
    return MMA_NARROW if spec.k <= NARROW_K else cuda.MMA_CONFIGS["gemm"]


def launch_config(spec: Conv2dSpec, arch: str) -> dict:
    """Threads per block and shared memory of the schedule of ``spec`` (for checks)."""
    if uses_tensor_cores(spec, arch):
        cfg = mma_config(spec)
        return {"threads": cfg.threads, "smem_bytes": cfg.smem_bytes(), "schedule": "mma"}
    cfg = cuda.SIMT_CONFIGS["gemm"]
    smem = (cfg.bm + cfg.bn) * cfg.bk * (8 if spec.dtype == "float64" else 4)
    return {"threads": cfg.threads, "smem_bytes": smem, "schedule": "simt"}


def schedule_conv2d(spec: Conv2dSpec, arch: str):
    """The scheduled IRModule of ``spec`` for a GPU of compute capability ``arch``."""
    gemm = gemm_view(spec)
    if uses_tensor_cores(spec, arch):
        cfg = mma_config(spec)
        vector = load_granule(spec, 8)  # 8 halves: one 16-byte cp.async
        func = conv2d_gemm_compute(
            spec, cfg.bm, cfg.bn, cfg.bk, operand_dtype=spec.dtype, granule=vector
        )
        return cuda.schedule_mma(gemm, cfg, "mma", func=func, vector=vector)
    cfg = cuda.SIMT_CONFIGS["gemm"]
    # 16 bytes per load (4 floats, 2 doubles: a 4-wide double vector spilt to the stack).
    vector = load_granule(spec, 2 if spec.dtype == "float64" else 4)
    func = conv2d_gemm_compute(spec, cfg.bm, cfg.bn, cfg.bk, granule=vector)
    return cuda.schedule_simt(gemm, cfg, func=func, vector=vector)
