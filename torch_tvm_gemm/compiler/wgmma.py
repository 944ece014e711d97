"""The Hopper TMA + wgmma GEMM (``schedules/cuda_wgmma.py``) built on its own, for reading
its source, SASS and ptxas report (the ops build it like any kernel: ``build.compile_spec``).
"""

from __future__ import annotations

from ..schedules.cuda_wgmma import ARCH, target, wgmma_gemm_module
from .cuda_pack import find_nvcc, nvcc_fatbin, parse_ptxas


def compile_wgmma(m: int | None, n: int, k: int, **kwargs):
    """``tvm.compile`` result (an Executable whose CUDA module carries the source)."""
    import tvm

    return tvm.compile(wgmma_gemm_module(m, n, k, **kwargs), target=target(), tir_pipeline="tirx")


def wgmma_cuda_source(m: int | None, n: int, k: int, **kwargs) -> str:
    """The CUDA C++ TVM generates for the kernel."""
    ex = compile_wgmma(m, n, k, **kwargs)
    (device,) = [mod for mod in ex.mod.imports if mod.kind == "cuda"]
    return device.inspect_source()


def wgmma_fatbin(source: str) -> bytes:
    """nvcc -fatbin -gencode arch=compute_90a,code=sm_90a (SASS only)."""
    return nvcc_fatbin(source, [ARCH])


def ptxas_report(source: str) -> dict:
    """``nvcc -cubin -arch=sm_90a -Xptxas -v``: registers, spills, shared memory (as
    ``cuda_pack.parse_ptxas``) plus ``wgmma_serialized``: ptxas's C7514 remark that it
    serialized the wgmma pipeline (each HGMMA waited on before the next)."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="tvm_gemm_wgmma_") as tmp:
        src = os.path.join(tmp, "kernel.cu")
        Path(src).write_text(source)
        cmd = [find_nvcc(), "-cubin", "-O3", "-std=c++17", f"-arch={ARCH}", "-Xptxas", "-v"]
        proc = subprocess.run(
            [*cmd, "-o", os.path.join(tmp, "k.cubin"), src], capture_output=True, text=True
        )
    if proc.returncode != 0:
        raise RuntimeError(f"torch_tvm_gemm: nvcc failed:\n{proc.stderr[-4000:]}")
    info = parse_ptxas(proc.stderr)
    info["wgmma_serialized"] = "C7514" in proc.stderr or "serialized" in proc.stderr
    info["log"] = proc.stderr
    return info
