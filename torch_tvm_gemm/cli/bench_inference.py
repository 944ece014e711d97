"""``bench-inference``: inference-shaped products against PyTorch, same run, as GFLOPS, ratios
and fractions of the machine's FMA peak.

Rows: a sweep over M (batch x tokens) of the linear layers of BERT-base (hidden 768, MLP 3072)
and LLaMA-7B (4096, MLP 11008), fused relu and plain, against ``F.relu(F.linear)`` /
``F.linear``; attention's two batched products (``Q @ K^T`` and ``P @ V``, B*H of 12 and 96,
S=128, D=64) against ``torch.bmm``. The peak is measured in the same run by a probe kernel
that keeps every vector register busy with independent FMA chains on every thread.
"""

from __future__ import annotations

import json
import math
import tempfile

from ..measure import gflops_vs_torch, mean_call, time_interleaved
from ..tools.workloads import LINEAR_LAYERS

SWEEP_M = [1, 2, 8, 17, 32, 64, 128, 256, 512, 2048]
SHAPES = LINEAR_LAYERS  # (N, K) of each model's linear layers
ATTENTION_BH = [12, 96]
ATTENTION_S, ATTENTION_D = 128, 64


def register(sub) -> None:
    p = sub.add_parser("bench-inference", help="linear M sweep, attention bmm, FMA peak")
    p.add_argument("--models", default="bert", help="comma list of: bert, llama (default bert)")
    p.add_argument("--m", default=",".join(map(str, SWEEP_M)), help="comma list of M values")
    p.add_argument("--act", default="relu,none", help="comma list of: relu, none")
    p.add_argument("--shapes", help="comma list of NxK linear shapes to keep (default: all)")
    p.add_argument("--no-attention", action="store_true", help="skip the bmm rows")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="operand dtype (bfloat16: no peak column, the probe measures fp32 FMAs)",
    )
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (default: by size)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.set_defaults(func=run)


def fma_peak_gflops(threads: int) -> float:
    """The FMA throughput this machine gives ``threads`` threads now (GFLOPS, 2 per FMA):
    24 independent vector FMA chains per thread, as many as AVX-512 keeps in flight."""
    import torch
    import tvm
    from tvm.script import tirx as T

    from ..compiler.build import llvm_target_json
    from ..runtime.loader import load_kernel_file
    from ..target import host_cpu

    vec = host_cpu().vector_bytes // 4
    chains = 24 if host_cpu().vector_registers >= 32 else 12

    @T.prim_func
    def probe(out: T.Buffer((threads, chains * vec), "float32"), iters: T.int64):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for t in T.parallel(threads):
            acc = T.decl_buffer((chains * vec,), "float32", scope="local")
            for j in T.unroll(chains):
                for v in T.vectorized(vec):
                    acc[j * vec + v] = out[t, j * vec + v]
            for _ in range(iters):
                for j in T.unroll(chains):
                    for v in T.vectorized(vec):
                        acc[j * vec + v] = acc[j * vec + v] * T.float32(0.999) + T.float32(1e-3)
            for j in T.unroll(chains):
                for v in T.vectorized(vec):
                    out[t, j * vec + v] = acc[j * vec + v]

    with tempfile.TemporaryDirectory() as tmp:
        ex = tvm.compile(
            tvm.IRModule({"main": probe}), target=tvm.target.Target(llvm_target_json())
        )
        path = f"{tmp}/fma_probe.so"
        ex.export_library(path)
        fn = load_kernel_file(path, "fma_probe")  # runs on torch's pool, as the kernels do
        out = torch.ones(threads, chains * vec)
        # ~10 ms a try at AVX-512 peak; the best of several, as a busy machine only slows it.
        iters = 2_000_000 // threads
        (best,) = time_interleaved(
            [lambda: fn(out, iters)], rounds=10, sample=lambda f: mean_call(f, 1), warm_up=False
        )
    return 2.0 * threads * chains * vec * iters / best / 1e9


def _linear_row(m: int, n: int, k: int, act: str, repeats: int, dtype) -> dict:
    import torch
    import torch.nn.functional as F

    import torch_tvm_gemm as tg

    x, w, b = (torch.randn(*shape, dtype=dtype) for shape in ((m, k), (n, k), (n,)))
    if act == "relu":
        tvm_fn = lambda: tg.linear(x, w, b, "relu")  # noqa: E731
        torch_fn = lambda: F.relu(F.linear(x, w, b))  # noqa: E731
    else:
        tvm_fn = lambda: tg.linear(x, w, b)  # noqa: E731
        torch_fn = lambda: F.linear(x, w, b)  # noqa: E731
    return _timed(f"linear_{act}", m, n, k, 1, tvm_fn, torch_fn, repeats)


def _bmm_rows(bh: int, repeats: int, dtype) -> list[dict]:
    import torch

    import torch_tvm_gemm as tg

    s, d = ATTENTION_S, ATTENTION_D
    q, key, v = (torch.randn(bh, s, d, dtype=dtype) for _ in range(3))
    p = torch.randn(bh, s, s, dtype=dtype)
    kt = key.transpose(1, 2)  # the view attention uses: (BH, D, S), not contiguous
    return [
        _timed("bmm_qk", s, s, d, bh, lambda: tg.matmul(q, kt), lambda: torch.bmm(q, kt), repeats),
        _timed("bmm_pv", s, d, s, bh, lambda: tg.matmul(p, v), lambda: torch.bmm(p, v), repeats),
    ]


def _timed(op, m, n, k, batch, tvm_fn, torch_fn, repeats) -> dict:
    tvm_fn()  # build or load the kernel
    flops = 2.0 * batch * m * n * k
    reps = repeats or max(5, min(200, int(5e9 / flops)))
    row = {"op": op, "batch": batch, "M": m, "N": n, "K": k}
    return row | gflops_vs_torch(tvm_fn, torch_fn, flops, reps)


def run(args) -> int:
    import os

    import torch

    from ..target import host_cpu

    cpu = host_cpu()
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    peak = fma_peak_gflops(threads)
    print(
        f"CPU: {cpu.model or cpu.arch}, torch {torch.__version__}, {threads} threads, "
        f"load average {load:.1f}; measured FMA peak {peak:.0f} GFLOPS; {args.dtype}"
    )
    print(
        f"{'op':<12} {'batch':>5} {'M':>5} {'N':>6} {'K':>6} {'TVM GF/s':>9} "
        f"{'torch GF/s':>10} {'ratio':>6} {'TVM/peak':>8}"
    )
    rows = []

    def show(r: dict) -> None:
        fp32 = dtype == torch.float32
        r["tvm_peak_fraction"] = r["tvm_gflops"] / peak if fp32 else None
        rows.append(r)
        print(
            f"{r['op']:<12} {r['batch']:>5} {r['M']:>5} {r['N']:>6} {r['K']:>6} "
            f"{r['tvm_gflops']:>9.1f} {r['torch_gflops']:>10.1f} {r['ratio']:>5.2f}x "
            + (f"{r['tvm_peak_fraction']:>7.0%}" if fp32 else f"{'-':>8}"),
            flush=True,
        )

    for model in args.models.split(","):
        for n, k in SHAPES[model]:
            if args.shapes and f"{n}x{k}" not in args.shapes.split(","):
                continue
            for act in args.act.split(","):
                for m in map(int, args.m.split(",")):
                    show(_linear_row(m, n, k, act, args.repeats, dtype))
    if not args.no_attention:
        for bh in ATTENTION_BH:
            for r in _bmm_rows(bh, args.repeats, dtype):
                show(r)
    # A busy machine only lowers the probe: measured again after the rows, the higher kept.
    peak_after = fma_peak_gflops(threads)
    if peak_after > peak:
        print(f"FMA peak measured again after the rows: {peak_after:.0f} GFLOPS")
    ratios = [r["ratio"] for r in rows]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"geometric mean ratio {geo:.2f}x over {len(rows)} rows; min {min(ratios):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cpu": cpu.model,
                    "threads": threads,
                    "dtype": args.dtype,
                    "load": load,
                    "peak_gflops": max(peak, peak_after),
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0
