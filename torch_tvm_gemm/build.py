"""From a kernel spec to a compiled TVM module. The only place that imports the TVM compiler.

Each kernel family (the ``family`` of a spec: "gemm", ...) on each device has one schedule
function, named in ``SCHEDULES`` and imported on first use, that returns the scheduled
IRModule. ``compile_spec`` turns that into a TVM ``Executable``; ``cache.py`` exports it.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

# (family, device) -> "module:function" taking the spec and returning a scheduled IRModule.
SCHEDULES: dict[tuple[str, str], str] = {
    ("gemm", "cpu"): "torch_tvm_gemm.schedules.cpu:schedule_gemm",
    ("conv2d", "cpu"): "torch_tvm_gemm.schedules.cpu_conv2d:schedule_conv2d",
}

# Schedule versions are part of the cache key, so that a changed schedule is rebuilt.
SCHEDULE_VERSIONS: dict[str, str] = {
    "cpu": "torch_tvm_gemm.schedules.cpu:SCHEDULE_VERSION",
}


def _resolve(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def schedule_version(device: str) -> int:
    return _resolve(SCHEDULE_VERSIONS[device])


def target_json(device: str) -> dict:
    """The TVM target for kernels that run on ``device`` of this machine."""
    if device == "cpu":
        from .target import llvm_target_json

        return llvm_target_json()
    raise ValueError(f"torch_tvm_gemm: no TVM target for device {device!r}")


def lower(spec) -> Any:
    """The scheduled IRModule of ``spec``."""
    try:
        scheduler = SCHEDULES[(spec.family, spec.device)]
    except KeyError:
        raise NotImplementedError(
            f"torch_tvm_gemm: no {spec.device} schedule for {spec.family} kernels"
        ) from None
    return _resolve(scheduler)(spec)


def compile_spec(spec) -> tuple[Any, float]:
    """Compile ``spec`` for its device on this machine: (tvm Executable, seconds taken)."""
    import tvm

    start = time.perf_counter()
    mod = lower(spec)
    executable = tvm.compile(mod, target=tvm.target.Target(target_json(spec.device)))
    return executable, time.perf_counter() - start
