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

# The x86 instruction sets the schedules emit, as /proc/cpuinfo flags -> LLVM features.
_X86_LLVM_FEATURES = {
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512cd": "avx512cd",
    "avx512_vnni": "avx512vnni",
    "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16",
    "amx_tile": "amx-tile",
    "amx_bf16": "amx-bf16",
}


def llvm_target_json() -> dict:
    """The TVM target for this host CPU. Its instruction sets are named from the CPU's own
    flags, not left to the CPU model LLVM infers: a VM may present a model whose LLVM name
    lacks them (KVM showing a Xeon with AMX and AVX512-BF16 as model 167, which LLVM calls
    "rocketlake"), and LLVM aborts on an instruction its target does not have."""
    from tvm.target import codegen

    cpu = host_cpu()
    target = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()}
    if cpu.arch == "x86_64":
        target["mattr"] = sorted(
            f"+{feature}" for flag, feature in _X86_LLVM_FEATURES.items() if flag in cpu.features
        )
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
