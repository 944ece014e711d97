"""``ladder``: the optimization ladder of one GEMM, step by step, against torch.matmul.

Prints GFLOPS per step and size, each step's speedup over the previous one and the ratio to
torch.matmul measured in the same run; writes ``ladder.json`` and ``ladder.png``.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("ladder", help="GFLOPS of each optimization step vs torch.matmul")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default="256,512,1024,2048", help="M=N=K values, comma-separated")
    p.add_argument("--out", default="bench_out/ladder", help="folder for ladder.json/.png")
    p.add_argument(
        "--tune-trials",
        type=int,
        default=96,
        help="MetaSchedule trials per size for the tuned step (records in the database "
        "count: a size tuned before is not re-tuned); 0 skips the step",
    )
    p.add_argument(
        "--tune-time", type=float, default=300.0, help="seconds of tuning, all sizes together"
    )
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.device == "cuda":
        return run_cuda(args)
    from torch_tvm_gemm.tools import ladder

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    report = _header()
    print(f"ladder on {report['cpu']}, {report['threads']} threads, {report['date']}")
    torch_gf: dict[int, float] = {}
    results: list[ladder.Result] = []
    budget = args.tune_time / len(sizes)
    for size in sizes:
        torch_gf[size], res = ladder.run_size(
            size, ladder.HAND_STEPS, args.tune_trials, budget, progress=True
        )
        results += res
    report["torch_gflops"] = {str(s): round(g, 2) for s, g in torch_gf.items()}
    report["torch_gflops_by_threads"] = {str(s): t for s, t in ladder.TORCH_BY_THREADS.items()}
    report["steps"] = table_rows(results, torch_gf, sizes)
    report["summary"] = summary(report["steps"], sizes)
    print()
    print(format_table(report["steps"], sizes))
    print()
    for size, s in report["summary"].items():
        tuned = f"{s['tuned_vs_best_hand']:.2f}x" if s["tuned_vs_best_hand"] else "-"
        print(
            f"{size}^3: best step {s['best_step']} at {s['best_vs_torch']:.2f}x torch.matmul; "
            f"tuned = {tuned} the best hand step ({s['best_hand_step']})"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'ladder.json'}")
    if not args.no_plot:
        plot(report, sizes, out / "ladder.png")
        print(f"wrote {out / 'ladder.png'}")
    wrong = [r for r in results if r.note == "WRONG RESULT"]
    return 1 if wrong else 0


def run_cuda(args) -> int:
    """The CUDA steps compile for sm_80 here; timing them needs a GPU with TVM's runtime,
    which this command does not drive yet: it reports what compiled."""
    from torch_tvm_gemm.tools import ladder_cuda as lc

    size = max(int(s) for s in args.sizes.split(",") if s.strip())
    print(f"CUDA ladder, {size}^3, compiled for {lc.CUDA_TARGET['arch']} (not timed: no GPU run)")
    for name, schedule, dtype in lc.CUDA_STEPS:
        try:
            src = lc.cuda_source(schedule, lc.cuda_spec(size, size, dtype))
            print(f"  {name:<10} {dtype:<8} compiled, {len(src.splitlines())} lines of CUDA C++")
        except Exception as err:  # report every step, whichever fails
            print(f"  {name:<10} {dtype:<8} FAILED: {str(err).splitlines()[-1]}")
            return 1
    return 2  # nothing was measured: not a success for a benchmark


def _header() -> dict:
    import torch

    from torch_tvm_gemm.config import dist_version as _version
    from torch_tvm_gemm.target import host_cpu

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": host_cpu().model or platform.machine(),
        "cores": _cores(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "tvm": _version("apache-tvm"),
        "dtype": "float32",
    }


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def table_rows(results, torch_gf: dict[int, float], sizes: list[int]) -> list[dict]:
    """One row per step: per size GFLOPS, speedup over the previous step, ratio to torch."""
    steps = list(dict.fromkeys(r.step for r in results))
    by = {(r.step, r.size): r for r in results}
    rows, prev = [], None
    for step in steps:
        row = {"step": step, "sizes": {}}
        for size in sizes:
            r = by.get((step, size))
            gf = r.gflops if r else None
            before = by.get((prev, size)) if prev else None
            row["sizes"][str(size)] = {
                "gflops": round(gf, 2) if gf else None,
                "vs_prev": round(gf / before.gflops, 2)
                if gf and before and before.gflops
                else None,
                "vs_torch": round(gf / torch_gf[size], 3) if gf else None,
                "max_err": r.max_err if r else None,
                "note": r.note if r else "not run",
            }
        rows.append(row)
        prev = step
    return rows


def summary(rows: list[dict], sizes: list[int]) -> dict:
    """Per size: the best step and its ratio to torch; the tuned step vs the best hand one."""
    out = {}
    for size in sizes:
        cells = {r["step"]: r["sizes"][str(size)] for r in rows if r["sizes"][str(size)]["gflops"]}
        if not cells:
            continue
        hand = {k: v for k, v in cells.items() if k != "tuned"}
        best = max(cells, key=lambda k: cells[k]["gflops"])
        best_hand = max(hand, key=lambda k: hand[k]["gflops"]) if hand else None
        tuned = cells.get("tuned")
        out[str(size)] = {
            "best_step": best,
            "best_vs_torch": cells[best]["vs_torch"],
            "best_hand_step": best_hand,
            "tuned_vs_best_hand": round(tuned["gflops"] / hand[best_hand]["gflops"], 3)
            if tuned and best_hand
            else None,
        }
    return out


def format_table(rows: list[dict], sizes: list[int]) -> str:
    """A Markdown table: GFLOPS (x previous step, x torch.matmul) per size."""
    head = "| step | " + " | ".join(f"{s}^3" for s in sizes) + " |"
    lines = [head, "|---" * (len(sizes) + 1) + "|"]
    for row in rows:
        cells = []
        for size in sizes:
            c = row["sizes"][str(size)]
            if c["gflops"] is None:
                cells.append("skipped" if "skipped" in c["note"] else c["note"] or "-")
                continue
            prev = f"{c['vs_prev']:.2f}x prev, " if c["vs_prev"] else ""
            cells.append(f"{c['gflops']:.1f} ({prev}{c['vs_torch']:.2f}x torch)")
        lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, sizes: list[int], path: Path) -> None:
    """One bar group per size (a bar per step, log scale), torch.matmul's level as a line."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    rows = report["steps"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, row in enumerate(rows):
        xs = [g + (i - (len(rows) - 1) / 2) * width for g in range(len(sizes))]
        ys = [row["sizes"][str(s)]["gflops"] or 0 for s in sizes]
        ax.bar(xs, ys, width, label=row["step"])
        for x, y in zip(xs, ys, strict=True):
            if not y:  # skipped (too slow) or wrong: say so rather than show no bar
                ax.text(x, 1, "skipped", rotation=90, ha="center", va="bottom", fontsize=7)
    torch_y = [report["torch_gflops"][str(s)] for s in sizes]
    ax.plot(range(len(sizes)), torch_y, "k--o", label="torch.matmul")
    ax.set_yscale("log")
    ax.set_xticks(range(len(sizes)), [f"{s}^3" for s in sizes])
    ax.set_ylabel("GFLOPS (fp32, log scale)")
    ax.set_title(f"GEMM optimization ladder: {report['cpu']}, {report['threads']} threads")
    ax.legend(ncol=8, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.text(0.99, 0.01, report["date"], ha="right", fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
