"""``bench-overhead``: per-call time of the ops against PyTorch, C++ and Python impl paths.

Each case times blocks of back-to-back calls of the PyTorch reference, the op on the C++ path
and the op on the Python path, interleaved block by block in one process (so that machine
load hits all three alike), and reports the median per-call time over the blocks and the
ratios to PyTorch. The targets of the C++ path are printed next to its ratios.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # "matmul" or "linear"
    shapes: tuple[tuple[int, ...], ...]  # the tensor arguments' shapes
    target: float | None  # C++ path / torch ratio to stay under; None: no regression


CASES = [
    Case("matmul 16x16x16", "matmul", ((16, 16), (16, 16)), 1.5),
    Case("matmul 64x64x64", "matmul", ((64, 64), (64, 64)), 1.2),
    Case("linear+bias M=1 N=K=256", "linear", ((1, 256), (256, 256), (256,)), 1.3),
    Case("matmul 512x512x512", "matmul", ((512, 512), (512, 512)), None),
    Case("linear+bias M=128 N=K=1024", "linear", ((128, 1024), (1024, 1024), (1024,)), None),
]


def register(sub) -> None:
    p = sub.add_parser(
        "bench-overhead",
        help="per-call time of the ops vs PyTorch, C++ and Python impl paths",
        description=__doc__,
    )
    p.add_argument("--repeats", type=int, default=31, help="timed blocks per case (median)")
    p.add_argument(
        "--budget-ms", type=float, default=20.0, help="target length of one block (sets calls)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch.set_num_threads for the run (0: leave torch's default); on a loaded "
        "machine 1 avoids timing the wait for a descheduled worker thread",
    )
    p.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="wall: perf_counter; thread: CPU time of the calling thread (with --threads 1, "
        "all the work: immune to time slices lost to other processes on a shared machine)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--no-python", action="store_true", help="skip the Python impl path")
    p.set_defaults(func=run)


_clock = time.perf_counter


def _block_us(fn: Callable[[], object], calls: int) -> float:
    start = _clock()
    for _ in range(calls):
        fn()
    return (_clock() - start) / calls * 1e6


def _calls_for(fn: Callable[[], object], budget_ms: float) -> int:
    per_call = min(_block_us(fn, 3) for _ in range(3))
    return max(1, min(20_000, int(budget_ms * 1e3 / max(per_call, 1e-3))))


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    from torch_tvm_gemm import _ext, ops

    global _clock
    _clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    paths = ["cpp"] if _ext.load() is not None else []
    if not args.no_python:
        paths.append("python")
    if "cpp" not in paths:
        print(f"C++ extension not available ({_ext.load_error}): C++ columns left empty")
    start_path = ops.impl_path()

    def reference(case: Case, tensors):
        if case.op == "matmul":
            return lambda: torch.matmul(*tensors)
        return lambda: F.linear(*tensors)

    def ours(case: Case, tensors):
        op = getattr(torch.ops.tvm_gemm, case.op)  # the packet, as users call it
        return lambda: op(*tensors)

    torch.manual_seed(0)
    rows = []
    header = f"{'case':28s} {'torch us':>9s} {'cpp us':>8s} {'ratio':>6s} {'target':>7s}"
    header += f" {'python us':>10s} {'ratio':>6s}" if "python" in paths else ""
    print(
        f"threads={torch.get_num_threads()}  repeats={args.repeats}  clock={args.clock}  "
        "(median per call)"
    )
    print(header)
    try:
        for case in CASES:
            tensors = [torch.randn(*s) for s in case.shapes]
            fns = {"torch": reference(case, tensors)}
            for path in paths:
                ops.use_impl(path)
                fns[path] = ours(case, tensors)
                fns[path]()  # build or load the kernel outside the timing
            calls = {name: _calls_for(fn, args.budget_ms) for name, fn in fns.items()}
            samples: dict[str, list[float]] = {name: [] for name in fns}
            with torch.no_grad():
                for _ in range(args.repeats):
                    for name, fn in fns.items():
                        if name in ("cpp", "python"):
                            ops.use_impl(name)
                        samples[name].append(_block_us(fn, calls[name]))
            med = {name: statistics.median(v) for name, v in samples.items()}
            row = {
                "case": case.name,
                "op": case.op,
                "shapes": [list(s) for s in case.shapes],
                "torch_us": med["torch"],
                "cpp_us": med.get("cpp"),
                "python_us": med.get("python"),
                "cpp_ratio": med["cpp"] / med["torch"] if "cpp" in med else None,
                "python_ratio": med["python"] / med["torch"] if "python" in med else None,
                "target_ratio": case.target,
                "calls_per_block": calls,
            }
            rows.append(row)
            target = f"<={case.target}" if case.target else "-"
            cpp = (
                f"{row['cpp_us']:8.2f} {row['cpp_ratio']:6.2f}"
                if row["cpp_us"] is not None
                else f"{'-':>8s} {'-':>6s}"
            )
            line = f"{case.name:28s} {row['torch_us']:9.2f} {cpp} {target:>7s}"
            if row["python_us"] is not None:
                line += f" {row['python_us']:10.2f} {row['python_ratio']:6.2f}"
            print(line, flush=True)
        floor = _dispatch_floor(torch, args)
        print(
            f"for reference: torch.ops.aten.mm.default 16x16 = {floor['ops_aten_mm_us']:.2f} us, "
            f"{floor['ratio']:.2f}x torch.matmul ({floor['torch_us']:.2f} us): the cost of "
            "entering an op through torch.ops from Python"
        )
    finally:
        ops.use_impl(start_path)
    if args.json:
        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "repeats": args.repeats,
            "clock": args.clock,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "dispatch_floor": floor,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _dispatch_floor(torch, args) -> dict:
    """torch's own mm entered through torch.ops, timed like the cases above."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    fns = {"torch": lambda: torch.matmul(a, b), "ops": lambda: torch.ops.aten.mm.default(a, b)}
    calls = {name: _calls_for(fn, args.budget_ms) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            samples[name].append(_block_us(fn, calls[name]))
    t, o = statistics.median(samples["torch"]), statistics.median(samples["ops"])
    return {"torch_us": t, "ops_aten_mm_us": o, "ratio": o / t}
