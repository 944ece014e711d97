"""``bench-models --alone``: eager and converted each timed in a process of its own.

``bench-models`` times both models in one process with glibc told to keep freed memory
(``measure.keep_freed_memory``), so that neither side pays page faults on its outputs and the
ratio compares the computations. A user's script has neither: it runs one model, with the
allocator's defaults, where a large tensor freed goes back to the system and the next one of
its size is faulted in afresh. With ``--alone`` each (model, dtype, batch) is also timed that
way: a child process per side (``bench-models --side eager|converted``, the same timing), the
sides in turn, ``ALONE_RUNS`` children each, the best kept. The two ways can differ by more
than the machine's noise in either direction (torch's temporaries fault where ours come from
the output pool), which is why both are printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ALONE_RUNS = 2  # child processes per side
SIDES = ("eager", "converted")


def add_arguments(p) -> None:
    p.add_argument(
        "--alone",
        action="store_true",
        help="also time eager and converted each in a process of its own, as a user's "
        "script runs one model (allocator defaults)",
    )
    # the child processes' flag: one side of one row, its time as JSON on stdout
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)


def time_alone(name: str, dtype_name: str, batch: int, args) -> tuple[float, float]:
    """(eager, converted) seconds per call, each side in child processes of its own."""
    best = {side: float("inf") for side in SIDES}
    for _ in range(ALONE_RUNS):
        for side in SIDES:
            best[side] = min(best[side], _child(side, name, dtype_name, batch, args))
    return best["eager"], best["converted"]


def _child(side: str, name: str, dtype_name: str, batch: int, args) -> float:
    argv = [sys.executable, "-m", "torch_tvm_gemm", "bench-models", "--side", side]
    argv += ["--models", name, "--dtype", dtype_name, "--batch", str(batch)]
    argv += ["--seq", str(args.seq), "--image", str(args.image), "--layers", str(args.layers)]
    argv += ["--reps", str(args.reps), "--rounds", str(args.rounds), "--call", args.call]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.channels_last:
        argv += ["--channels-last"]
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"bench-models --alone: the {side} process for {name} {dtype_name} batch {batch} "
            f"failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    return json.loads(lines[-1])["seconds"]


def run_side(args, build, called) -> int:
    """The child: one model (``build(name, layers)``: bench_models' maker) on one side, timed
    as ``bench-models`` times it (warm-up call, best of ``--rounds`` rounds of ``--reps``
    calls, each ``called(call, model, inputs)``); prints ``{"seconds": ...}``."""
    import torch

    import torch_tvm_gemm as tg

    from ..measure import mean_call, time_interleaved

    if len(args.models) != 1 or len(args.dtype) != 1 or len(args.batch) != 1:
        print("bench-models --side: one model, one dtype and one batch size (it times one row)")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    (name,), (dtype_name,), (batch,) = args.models, args.dtype, args.batch
    dtype = getattr(torch, dtype_name)
    model, make = build(name, args.layers, args.channels_last)
    model = model.to(dtype).train(args.call == "train")
    if args.side == "converted":
        tg.convert(model)
    inputs = make(batch, args.seq, args.image, dtype)
    (seconds,) = time_interleaved(
        [lambda: called(args.call, model, inputs)],
        args.rounds,
        sample=lambda fn: mean_call(fn, args.reps),
    )
    print(json.dumps({"seconds": seconds}))
    return 0
