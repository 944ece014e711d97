"""TVM kernels vs PyTorch (cuBLAS) on this GPU: one table, ratios measured in the same run.

    python benchmarks/gpu_bench.py [--reps 20] [--json out.json]

Workloads: ``torch_tvm_gemm.tools.cuda_cases.BENCH_CASES`` (bf16/fp16 GEMM at 512^3, 4096^3,
8192^3; linear + bias + relu at M = N = K = 4096) and ``CONV_BENCH_CASES`` (conv2d + bias +
relu on ResNet-50 layers, batch 32, channels_last, vs F.relu(F.conv2d) on cuDNN), the kernels
of ``compile --preset bench``. Aims (H200, mma.sync): GEMM 4096^3 / 8192^3 >= 0.8x
torch.matmul, 512^3 >= 0.7x, linear + bias + relu >= 1.0x F.linear + relu; conv: none yet
(reported only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import torch_tvm_gemm  # noqa: F401 (registers the ops)
from torch_tvm_gemm.tools.cuda_cases import BENCH_CASES, CONV_BENCH_CASES, Case, ConvCase

TARGETS = {512: 0.7, 4096: 0.8, 8192: 0.8}


def time_ms(fn, reps: int) -> float:
    """Median time of ``fn`` in ms, CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def torch_version_of(case: Case, args):
    if case.op == "matmul":
        return lambda: torch.matmul(*args)
    x, w, b, _ = args
    return lambda: F.relu(F.linear(x, w, b))


def target_of(case: Case) -> float:
    return 1.0 if case.op == "linear" else TARGETS[case.k]


def row(op, dtype, shape, ours, theirs, flops, target, err, first_call_s) -> dict:
    """One table row: times in ms, throughput in TFLOP/s, ratio = torch time / TVM time."""
    return {
        "op": op,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": shape,
        "tvm_ms": ours,
        "torch_ms": theirs,
        "tvm_tflops": flops / ours / 1e9,
        "torch_tflops": flops / theirs / 1e9,
        "ratio": theirs / ours,
        "target": target,
        "max_abs_err": err,
        "first_call_s": first_call_s,
    }


def first_call(case, args) -> tuple[torch.Tensor, float, float]:
    """(output, seconds, max |error| vs torch) of the first call, which loads the kernel."""
    start = time.perf_counter()
    out = case.run(*args)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    return out, load_s, (out.float() - case.reference(*args).float()).abs().max().item()


def bench(case: Case, reps: int) -> dict:
    args = case.inputs("cuda")
    _, load_s, err = first_call(case, args)
    ours = time_ms(lambda: case.run(*args), reps)
    theirs = time_ms(torch_version_of(case, args), reps)
    return row(
        case.op + ("+bias+relu" if case.op == "linear" else ""),
        case.dtype,
        f"{case.m}x{case.n}x{case.k}",
        ours,
        theirs,
        flops=2 * case.m * case.n * case.k,
        target=target_of(case),
        err=err,
        first_call_s=load_s,
    )


def bench_conv(case: ConvCase, reps: int) -> dict:
    args = case.inputs("cuda")
    out, load_s, err = first_call(case, args)
    x, w, b, stride, padding, dilation, _, _ = args
    ours = time_ms(lambda: case.run(*args), reps)
    theirs = time_ms(lambda: F.relu(F.conv2d(x, w, b, stride, padding, dilation)), reps)
    return row(
        "conv+bias+relu",
        case.dtype,
        f"{case.c}>{case.k} {case.r}x{case.r} {case.h}",
        ours,
        theirs,
        flops=2 * out.numel() * case.reduction,
        target=None,  # no target set yet
        err=err,
        first_call_s=load_s,
    )


def bench_wgmma() -> dict | None:
    """The first wgmma kernel (not in the ops yet) vs F.linear, when gpu_check.sh carried it
    and this is an sm_90 GPU; None otherwise."""
    import os
    from pathlib import Path

    from torch_tvm_gemm.compiler.wgmma import CHECK_SIZE, ENV_CHECK_DIR, load_check_kernel

    path = Path(os.environ.get(ENV_CHECK_DIR, "/nonexistent")) / "plain.so"
    if torch.cuda.get_device_capability() != (9, 0) or not path.exists():
        return None
    kernel, n = load_check_kernel(path), CHECK_SIZE
    a, b = (torch.randn(n, n, device="cuda").half() for _ in range(2))
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)
    kernel(a, b, out)
    err = (out.float() - F.linear(a.float(), b.float())).abs().max().item()
    ours = time_ms(lambda: kernel(a, b, out), 20)
    theirs = time_ms(lambda: F.linear(a, b), 20)
    shape = f"{n}x{n}x{n}"
    return row("wgmma (first)", torch.float16, shape, ours, theirs, 2 * n**3, None, err, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    header = (
        f"{'op':<16}{'dtype':<10}{'M x N x K':<17}{'TVM ms':>9}{'torch ms':>10}"
        f"{'TVM TF/s':>10}{'torch TF/s':>11}{'ratio':>7}{'target':>8}{'max err':>10}"
    )
    print(header)
    print("-" * len(header))
    rows, failed = [], 0
    for case in [*BENCH_CASES, *CONV_BENCH_CASES, "wgmma"]:
        try:
            if case == "wgmma":
                result = bench_wgmma()
                if result is None:
                    continue
            elif case.op == "conv2d":
                result = bench_conv(case, args.reps)
            else:
                result = bench(case, args.reps)
        except Exception as err:  # one failing kernel must not hide the others
            print(f"{getattr(case, 'op', case):<16} FAILED: {err}")
            failed += 1
            continue
        rows.append(result)
        target = (
            "     -    "
            if result["target"] is None
            else (
                f"{result['target']:>6.1f} {'ok' if result['ratio'] >= result['target'] else 'LOW':<3}"
            )
        )
        print(
            f"{result['op']:<16}{result['dtype']:<10}{result['shape']:<17}{result['tvm_ms']:>9.3f}"
            f"{result['torch_ms']:>10.3f}{result['tvm_tflops']:>10.1f}{result['torch_tflops']:>11.1f}"
            f"{result['ratio']:>7.2f}{target}{result['max_abs_err']:>8.1e}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
