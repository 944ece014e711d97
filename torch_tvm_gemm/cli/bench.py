"""``bench``: TVM kernels against PyTorch, measured in the same run, as GFLOPS and ratios.

Each row times the TVM op and its PyTorch counterpart alternately (median of repeats), so
that machine noise hits both alike. Kernels are built (or loaded) before timing; build time
and a new process's warm-start time are reported apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from ..measure import gflops_vs_torch

# (op, dtype, M, N, K); a comment gives the ratio against torch the row aims for.
FULL_ROWS = [
    ("matmul", "float32", 1024, 1024, 1024),  # >= 0.9x
    ("matmul", "float32", 2048, 2048, 2048),  # >= 0.9x
    ("linear_relu", "float32", 256, 1024, 1024),  # >= 1.0x
    ("linear_relu", "float32", 2048, 1024, 1024),
    ("linear_relu", "float32", 256, 4096, 4096),
    ("linear_relu", "float32", 2048, 4096, 4096),
    ("linear_relu", "float32", 1, 4096, 4096),  # >= 0.8x
    ("linear_relu", "float32", 8, 4096, 4096),  # >= 0.8x
    ("matmul", "bfloat16", 1024, 1024, 1024),  # report (aim >= 0.8x)
]
QUICK_ROWS = [
    ("matmul", "float32", 128, 128, 128),
    ("linear_relu", "float32", 4, 96, 64),
    ("matmul", "bfloat16", 64, 64, 64),
]


def register(sub) -> None:
    p = sub.add_parser("bench", help="GFLOPS of the TVM ops vs PyTorch, same run")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (default: by size)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.set_defaults(func=run)


def _row(op: str, dtype_name: str, m: int, n: int, k: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    import torch_tvm_gemm as tg

    dtype = getattr(torch, dtype_name)
    if op == "matmul":
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        tvm_fn, torch_fn = (lambda: tg.matmul(a, b)), (lambda: torch.matmul(a, b))
        ref = "torch.matmul"
    else:
        x, w, bias = (
            torch.randn(m, k).to(dtype),
            torch.randn(n, k).to(dtype),
            torch.randn(n).to(dtype),
        )
        tvm_fn = lambda: tg.linear(x, w, bias, "relu")  # noqa: E731
        torch_fn = lambda: F.relu(F.linear(x, w, bias))  # noqa: E731
        ref = "F.relu(F.linear)"
    start = time.perf_counter()
    tvm_fn()  # build or load the kernel
    first_call = time.perf_counter() - start
    flops = 2.0 * m * n * k
    reps = repeats or max(10, min(200, int(2e10 / flops)))
    row = {"op": op, "dtype": dtype_name, "M": m, "N": n, "K": k, "reference": ref}
    return row | gflops_vs_torch(tvm_fn, torch_fn, flops, reps) | {"first_call_s": first_call}


WARM_START = (
    "import time; t = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import torch_tvm_gemm as tg; a = torch.randn(64, 64); tg.matmul(a, a); "
    "import sys; print(time.perf_counter() - t1, time.perf_counter() - t, 'tvm' in sys.modules)"
)


def _build_and_warm_start() -> dict:
    """Seconds to build one kernel in a fresh cache, then a new process's warm start."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TVM_GEMM_CACHE_DIR": cache}
        cmd = [sys.executable, "-c", WARM_START]
        cold = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        warm = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        meta = [
            json.load(open(os.path.join(cache, "kernels", f)))
            for f in os.listdir(os.path.join(cache, "kernels"))
            if f.endswith(".json")
        ]
    cold_s, _, _ = cold.stdout.split()
    warm_s, warm_with_torch_s, tvm_imported = warm.stdout.split()
    return {
        "build_seconds": meta[0]["build_seconds"],
        "cold_first_call_s": float(cold_s),
        "warm_import_and_first_call_s": float(warm_s),
        "warm_including_import_torch_s": float(warm_with_torch_s),
        "warm_imported_tvm_compiler": tvm_imported == "True",
    }


def run(args) -> int:
    import torch

    from torch_tvm_gemm.target import host_cpu

    cpu = host_cpu()
    print(
        f"CPU: {cpu.model or cpu.arch} ({cpu.vector_bytes * 8}-bit SIMD), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    rows = []
    header = f"{'op':<12} {'dtype':<9} {'M':>5} {'N':>5} {'K':>5} {'TVM GF/s':>9} {'torch GF/s':>10} {'ratio':>6}"
    print(header)
    for op, dtype, m, n, k in QUICK_ROWS if args.quick else FULL_ROWS:
        r = _row(op, dtype, m, n, k, args.repeats)
        rows.append(r)
        print(
            f"{op:<12} {dtype:<9} {m:>5} {n:>5} {k:>5} {r['tvm_gflops']:>9.1f} "
            f"{r['torch_gflops']:>10.1f} {r['ratio']:>5.2f}x",
            flush=True,
        )
    startup = _build_and_warm_start()
    print(
        f"first build of one kernel: {startup['build_seconds']:.2f} s; new process on a warm "
        f"cache: import torch_tvm_gemm + first call {startup['warm_import_and_first_call_s']:.2f} s "
        f"(compiler imported: {startup['warm_imported_tvm_compiler']})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu.model, "rows": rows, "startup": startup}, f, indent=1)
        print(f"wrote {args.json}")
    return 0
