"""``bench-overhead``: per-call time of the ops against PyTorch, C++ and Python impl paths.

Each case times blocks of back-to-back calls of the PyTorch reference and of the op three ways:
``torch.ops.tvm_gemm.*`` on the C++ impls ("torch.ops"), the package's own function
(``torch_tvm_gemm.matmul`` / ``linear``, which enters the same op from C++: "package") and
``torch.ops`` on the Python impls ("python"), interleaved block by block in one process (so that
machine load hits all alike). It reports the median per-call time over the blocks and the
ratios to PyTorch; the targets are printed next to the package function's ratios.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..measure import mean_call, time_interleaved


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # "matmul" or "linear"
    shapes: tuple[tuple[int, ...], ...]  # the tensor arguments' shapes
    target: float | None  # package function / torch ratio to stay under; None: no regression


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


def _calls_for(fn: Callable[[], object], budget_ms: float, clock: Callable[[], float]) -> int:
    """How many back-to-back calls of ``fn`` fill a block of ``budget_ms``."""
    per_call_us = min(mean_call(fn, 3, clock) for _ in range(3)) * 1e6
    return max(1, min(20_000, int(budget_ms * 1e3 / max(per_call_us, 1e-3))))


def _median_us(fns: dict, args, clock, before=None) -> tuple[dict[str, float], dict[str, int]]:
    """Median microseconds per call of each of ``fns`` (name -> no-argument function) over
    ``args.repeats`` interleaved blocks of back-to-back calls, each block ~``args.budget_ms``
    long, and the calls per block; ``before(name)`` runs ahead of each block (and of the
    count of its calls), untimed."""
    names = {fn: name for name, fn in fns.items()}
    before = before or (lambda name: None)
    calls = {}
    for name, fn in fns.items():
        before(name)
        calls[name] = _calls_for(fn, args.budget_ms, clock)

    def block(fn) -> float:
        before(names[fn])
        return mean_call(fn, calls[names[fn]], clock)

    seconds = time_interleaved(
        list(fns.values()), args.repeats, sample=block, keep=statistics.median, warm_up=False
    )
    return {name: s * 1e6 for name, s in zip(fns, seconds, strict=True)}, calls


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    import torch_tvm_gemm
    from torch_tvm_gemm import _ext, ops

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    paths = ["cpp", "package"] if _ext.load() is not None else []
    if not args.no_python:
        paths.append("python")
    if "cpp" not in paths:
        print(f"C++ extension not available ({_ext.load_error}): C++ columns left empty")
    start_path = ops.impl_path()

    def switch_impl(name: str) -> None:
        if name in ("cpp", "package", "python"):
            ops.use_impl("python" if name == "python" else "cpp")

    def reference(case: Case, tensors):
        if case.op == "matmul":
            return lambda: torch.matmul(*tensors)
        return lambda: F.linear(*tensors)

    def ours(case: Case, tensors, path: str):
        if path == "package":
            fn = getattr(torch_tvm_gemm, case.op)
            return lambda: fn(*tensors)
        op = getattr(torch.ops.tvm_gemm, case.op)  # the packet, as users call it
        return lambda: op(*tensors)

    torch.manual_seed(0)
    rows = []
    header = f"{'case':28s} {'torch us':>9s} {'torch.ops':>9s} {'ratio':>6s} {'package':>8s}"
    header += f" {'ratio':>6s} {'target':>7s}"
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
                switch_impl(path)
                fns[path] = ours(case, tensors, path)
                fns[path]()  # build or load the kernel outside the timing
            with torch.no_grad():
                med, calls = _median_us(fns, args, clock, before=switch_impl)
            row = {
                "case": case.name,
                "op": case.op,
                "shapes": [list(s) for s in case.shapes],
                "torch_us": med["torch"],
                "cpp_us": med.get("cpp"),
                "package_us": med.get("package"),
                "python_us": med.get("python"),
                "cpp_ratio": med["cpp"] / med["torch"] if "cpp" in med else None,
                "package_ratio": med["package"] / med["torch"] if "package" in med else None,
                "python_ratio": med["python"] / med["torch"] if "python" in med else None,
                "target_ratio": case.target,
                "calls_per_block": calls,
            }
            rows.append(row)
            target = f"<={case.target}" if case.target else "-"
            cpp = (
                f"{row['cpp_us']:9.2f} {row['cpp_ratio']:6.2f} "
                f"{row['package_us']:8.2f} {row['package_ratio']:6.2f}"
                if row["cpp_us"] is not None
                else f"{'-':>9s} {'-':>6s} {'-':>8s} {'-':>6s}"
            )
            line = f"{case.name:28s} {row['torch_us']:9.2f} {cpp} {target:>7s}"
            if row["python_us"] is not None:
                line += f" {row['python_us']:10.2f} {row['python_ratio']:6.2f}"
            print(line, flush=True)
        floor = _dispatch_floor(torch, args, clock)
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


def _dispatch_floor(torch, args, clock) -> dict:
    """torch's own mm entered through torch.ops, timed like the cases above."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    fns = {"torch": lambda: torch.matmul(a, b), "ops": lambda: torch.ops.aten.mm.default(a, b)}
    med, _ = _median_us(fns, args, clock)
    t, o = med["torch"], med["ops"]
    return {"torch_us": t, "ops_aten_mm_us": o, "ratio": o / t}
