"""Building the Hopper TMA + wgmma GEMM (``schedules/cuda_wgmma.py``): compile, nvcc to
sm_90a SASS, export; and the check kernels a GPU machine runs against torch.
"""

from __future__ import annotations

from ..runtime.loader import ensure_runtime, keep_alive
from ..schedules.cuda_wgmma import ARCH, target, wgmma_gemm_module
from .cuda_pack import export_with_binary, find_nvcc, nvcc_fatbin, parse_ptxas


def compile_wgmma(m: int, n: int, k: int, **kwargs):
    """``tvm.compile`` result (an Executable whose CUDA module carries the source)."""
    import tvm

    return tvm.compile(wgmma_gemm_module(m, n, k, **kwargs), target=target(), tir_pipeline="tirx")


def wgmma_cuda_source(m: int, n: int, k: int, **kwargs) -> str:
    """The CUDA C++ TVM generates for the kernel."""
    ex = compile_wgmma(m, n, k, **kwargs)
    (device,) = [mod for mod in ex.mod.imports if mod.kind == "cuda"]
    return device.inspect_source()


def wgmma_fatbin(source: str) -> bytes:
    """nvcc -fatbin -gencode arch=compute_90a,code=sm_90a (SASS only)."""
    return nvcc_fatbin(source, [ARCH])


def export_wgmma(m: int, n: int, k: int, path, **kwargs) -> dict:
    """Export a library holding the sm_90a SASS (loads with the TVM runtime alone, like the
    packs of ``cuda_pack``); returns the build facts."""
    return export_with_binary(compile_wgmma(m, n, k, **kwargs), path, [ARCH])


# What benchmarks/gpu_check.sh carries to a GPU machine: (file name, export options), each a
# 4096^3 kernel, checked there by tests/test_cuda_ops.py and timed by benchmarks/gpu_bench.py.
CHECK_SIZE = 4096
CHECK_VARIANTS = {"plain.so": {}, "bias_relu.so": {"bias": True, "relu": True}}
ENV_CHECK_DIR = "TVM_GEMM_WGMMA_DIR"


def export_check_kernels(folder) -> None:
    """Export ``CHECK_VARIANTS`` into ``folder`` (here, with TVM and nvcc)."""
    from pathlib import Path

    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, options in CHECK_VARIANTS.items():
        export_wgmma(CHECK_SIZE, CHECK_SIZE, CHECK_SIZE, Path(folder) / name, **options)


def load_check_kernel(path):
    """The exported kernel at ``path`` as a callable ``(A, B, [bias,] C)`` (runtime only)."""
    import tvm_ffi

    ensure_runtime("cuda")
    module = tvm_ffi.load_module(str(path))
    keep_alive(module)
    return module["wgmma_gemm"]


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
