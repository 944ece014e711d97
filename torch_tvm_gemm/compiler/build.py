"""From a kernel spec to a compiled TVM module.

The schedule of a spec is ``schedules.module(spec.family, spec.device)``'s
``schedule_<family>`` (CUDA ones also take the arch); a kept tuning record
(``compiler/tune.py``) replaces the hand schedule. ``compile_spec`` turns the scheduled
module into a TVM ``Executable``, which the caller exports into the cache.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from .. import schedules
from ..target import cuda_arch, host_cpu
from .cuda_pack import CudaExecutable
from .tune_space import tuned_module


def llvm_target_json() -> dict:
    """The TVM target for this host CPU."""
    from tvm.target import codegen

    cpu = host_cpu()
    target = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()}
    if cpu.amx_bf16:  # LLVM may not know this CPU's model (a VM): name the tile features
        target["mattr"] = ["+amx-tile", "+amx-bf16"]
    if cpu.arch == "aarch64":
        target["mtriple"] = "aarch64-linux-gnu"
    return target


def target_json(device: str, arch: str | None = None) -> dict:
    """The TVM target for kernels that run on ``device`` of this machine (or ``arch``)."""
    if device == "cpu":
        return llvm_target_json()
    if device == "cuda":
        return {"kind": "cuda", "arch": arch or cuda_arch()}
    raise ValueError(f"torch_tvm_gemm: no TVM target for device {device!r}")


def lower(spec, target: dict | None = None, use_tuned: bool = True) -> Any:
    """The scheduled IRModule of ``spec``: its kept tuning record (``tune.py``) if there is
    one, else the hand schedule (CUDA schedules depend on the target's arch)."""
    if use_tuned:
        mod = tuned_module(spec)
        if mod is not None:
            return mod
    schedule = getattr(schedules.module(spec.family, spec.device), f"schedule_{spec.family}")
    if spec.device == "cuda":
        return schedule(spec, (target or target_json("cuda"))["arch"])
    return schedule(spec)


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
    config, options = None, {}
    if spec.device == "cuda":  # pass options depend on the schedule (cp.async: sm_80+)
        schedule = schedules.module(spec.family, "cuda")
        config = schedule.pass_config(spec, target["arch"])
        pipeline = schedule.tir_pipeline(spec, target["arch"])
        if pipeline is not None:
            options["tir_pipeline"] = pipeline
    with tvm.transform.PassContext(config=config) if config else contextlib.nullcontext():
        executable = tvm.compile(mod, target=tvm.target.Target(target), **options)
    if spec.device == "cuda":
        executable = CudaExecutable(executable, arches or [target["arch"]])
    return executable, time.perf_counter() - start
