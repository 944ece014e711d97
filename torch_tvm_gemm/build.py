"""From a kernel spec to a compiled TVM module. The only place that imports the TVM compiler.

Each kernel family (the ``family`` of a spec: "gemm", ...) on each device has one schedule
function, named in ``SCHEDULES`` and imported on first use, that returns the scheduled
IRModule. ``compile_spec`` turns that into a TVM ``Executable``; ``cache.py`` exports it.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from typing import Any

# (family, device) -> "module:function" taking the spec and returning a scheduled IRModule.
SCHEDULES: dict[tuple[str, str], str] = {
    ("gemm", "cpu"): "torch_tvm_gemm.schedules.cpu:schedule_gemm",
    ("conv2d", "cpu"): "torch_tvm_gemm.schedules.cpu_conv2d:schedule_conv2d",
    ("gemm", "cuda"): "torch_tvm_gemm.schedules.cuda:schedule_gemm",  # (spec, arch)
    ("conv2d", "cuda"): "torch_tvm_gemm.schedules.cuda_conv2d:schedule_conv2d",  # (spec, arch)
}

# Schedule versions are part of the cache key, so that a changed schedule is rebuilt.
SCHEDULE_VERSIONS: dict[str, str] = {
    "cpu": "torch_tvm_gemm.schedules.cpu:SCHEDULE_VERSION",
    "cuda": "torch_tvm_gemm.schedules.cuda:SCHEDULE_VERSION",
}

# TVM pass options per (family, device): "module:function" taking (spec, arch) (CUDA's
# depend on the schedule: cp.async only on sm_80+).
PASS_CONFIGS: dict[tuple[str, str], str] = {
    ("gemm", "cuda"): "torch_tvm_gemm.schedules.cuda:pass_config",
    ("conv2d", "cuda"): "torch_tvm_gemm.schedules.cuda_conv2d:pass_config",
}


def _resolve(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def schedule_version(device: str) -> int:
    return _resolve(SCHEDULE_VERSIONS[device])


def cuda_arch(device_index: int | None = None) -> str:
    """``sm_XY`` of this process's current (or the given) GPU; needs a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "torch_tvm_gemm: no CUDA GPU here to build for; cross-compile with "
            "`python -m torch_tvm_gemm compile --target cuda --arch sm_80,...`"
        )
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def target_json(device: str, arch: str | None = None) -> dict:
    """The TVM target for kernels that run on ``device`` of this machine (or ``arch``)."""
    if device == "cpu":
        from .target import llvm_target_json

        return llvm_target_json()
    if device == "cuda":
        return {"kind": "cuda", "arch": arch or cuda_arch()}
    raise ValueError(f"torch_tvm_gemm: no TVM target for device {device!r}")


def lower(spec, target: dict | None = None, use_tuned: bool = True) -> Any:
    """The scheduled IRModule of ``spec``: its kept tuning record (``tune.py``) if there is
    one, else the hand schedule (CUDA schedules depend on the target's arch)."""
    if use_tuned:
        from .tune import tuned_module

        mod = tuned_module(spec)
        if mod is not None:
            return mod
    try:
        scheduler = SCHEDULES[(spec.family, spec.device)]
    except KeyError:
        raise NotImplementedError(
            f"torch_tvm_gemm: no {spec.device} schedule for {spec.family} kernels"
        ) from None
    if spec.device == "cuda":
        return _resolve(scheduler)(spec, (target or target_json("cuda"))["arch"])
    return _resolve(scheduler)(spec)


def compile_spec(
    spec, arch: str | None = None, arches=None, use_tuned: bool = True
) -> tuple[Any, float]:
    """Compile ``spec`` for its device: (tvm Executable, seconds taken).

    CUDA: TVM generates code for ``arch`` (default: this GPU's), nvcc then compiles it for
    every arch in ``arches`` (default: ``[arch]``) when the result is exported; the result
    is a ``cuda_pack.CudaExecutable``.
    """
    import tvm

    start = time.perf_counter()
    target = target_json(spec.device, arch) if spec.device == "cuda" else target_json("cpu")
    mod = lower(spec, target, use_tuned)
    config = None
    if (spec.family, spec.device) in PASS_CONFIGS:
        config = _resolve(PASS_CONFIGS[(spec.family, spec.device)])(spec, target["arch"])
    with tvm.transform.PassContext(config=config) if config else contextlib.nullcontext():
        executable = tvm.compile(mod, target=tvm.target.Target(target))
    if spec.device == "cuda":
        from .cuda_pack import CudaExecutable

        executable = CudaExecutable(executable, arches or [target["arch"]])
    return executable, time.perf_counter() - start
