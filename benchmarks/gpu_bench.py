"""TVM kernels vs PyTorch (cuBLAS) on this GPU: one table, ratios measured in the same run.

    python benchmarks/gpu_bench.py [--reps 20] [--json out.json]

Workloads: ``torch_tvm_gemm.tools.cuda_cases.BENCH_CASES`` (bf16/fp16 matmul at 512^3,
4096^3, 8192^3; linear + bias + relu at M = N = K = 4096; linear at 8192^3) and
``CONV_BENCH_CASES`` (conv2d + bias + relu on ResNet-50 layers, batch 32, channels_last, vs
F.relu(F.conv2d) on cuDNN), the kernels of ``compile --preset bench``. Each GEMM row names its
schedule: on an H100 / H200 (sm_90a) the linears run TMA + wgmma, the matmuls mma.sync
(TVM_GEMM_CUDA_WGMMA=0: mma.sync for all). Aims: matmul 4096^3 / 8192^3 >= 0.8x
torch.matmul, 512^3 >= 0.7x, linear + bias + relu >= 1.0x F.linear + relu, linear >= 0.9x
F.linear; conv: none yet (reported only).
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
    """Mean time of ``fn`` in ms over ``reps`` calls launched back to back, as a model runs
    its layers (the host's work for a call overlaps the GPU's work for the previous one),
    CUDA events around the whole run; the best of 3 runs, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / reps)
    return min(runs)


def torch_version_of(case: Case, args):
    if case.op == "matmul":
        return lambda: torch.matmul(*args)
    x, w, b, act = args
    if act == "relu":
        return lambda: F.relu(F.linear(x, w, b))
    return lambda: F.linear(x, w, b)


def target_of(case: Case) -> float:
    if case.op == "linear":  # fused vs torch's two ops: 1.0; alone: cuBLAS, wgmma's aim
        return 1.0 if case.activation == "relu" else 0.9
    return TARGETS[case.k]


def schedule_of(case: Case) -> str:
    """The CUDA schedule this GPU runs the case with (mma, wgmma, ...)."""
    from torch_tvm_gemm.ops import gemm_spec
    from torch_tvm_gemm.schedules.cuda import schedule_kind
    from torch_tvm_gemm.target import cuda_arch

    layout = "kn" if case.op == "matmul" else "nk"
    name = str(case.dtype).replace("torch.", "")
    spec = gemm_spec(
        name,
        case.m,
        case.n,
        case.k,
        layout,
        bias=case.bias,
        activation=case.activation,
        device="cuda",
    )
    return schedule_kind(spec, cuda_arch())


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
        case.op + ("+bias+relu" if case.activation == "relu" else "") + f" ({schedule_of(case)})",
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    header = (
        f"{'op':<26}{'dtype':<10}{'M x N x K':<17}{'TVM ms':>9}{'torch ms':>10}"
        f"{'TVM TF/s':>10}{'torch TF/s':>11}{'ratio':>7}{'target':>8}{'max err':>10}"
    )
    print(header)
    print("-" * len(header))
    rows, failed = [], 0
    for case in [*BENCH_CASES, *CONV_BENCH_CASES]:
        try:
            if case.op == "conv2d":
                result = bench_conv(case, args.reps)
            else:
                result = bench(case, args.reps)
        except Exception as err:  # one failing kernel must not hide the others
            print(f"{case.op:<26} FAILED: {err}")
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
            f"{result['op']:<26}{result['dtype']:<10}{result['shape']:<17}{result['tvm_ms']:>9.3f}"
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
