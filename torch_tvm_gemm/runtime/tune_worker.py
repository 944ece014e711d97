"""Tuning a kernel in a compile-worker process: the caller's process never imports the compiler.

``tune(spec, m, ...)`` sends one "tune" request (the spec, the batch it is tuned at, the
trial and time budgets, the options, and where its records go) to a worker of its own,
which runs ``compiler.tune.tune_spec`` and replies with its ``TuneResult``. The worker is
started with torch (the verdict checks and times kernels against torch) and stopped after
the request; its stderr (the progress bar, the compiler's messages) reaches ours as it
comes. What the search measured is in the database as soon as it is measured, so a worker
that dies or is stopped (Ctrl-C: ``build_worker.ask_alone``) loses nothing of it: the
next run resumes.

``TVM_GEMM_BUILD_IN_PROCESS=1`` tunes in the calling process instead (for debugging).
"""

from __future__ import annotations

import importlib
import os

from ..kernels.gemm import GemmSpec
from . import build_worker
from .records import TuneResult, tuning_dir


def tune(
    spec: GemmSpec,
    m: int,
    k: int | None = None,
    trials: int = 32,
    time_budget_s: float = 600.0,
    rpc: tuple[str, int, str] | None = None,
    space: str = "hand",
    progress: bool = True,
) -> TuneResult:
    """Tune ``spec`` at batch ``m`` (and ``k`` if K is symbolic): ``compiler.tune.tune_spec``
    in a compile worker. Raises KeyboardInterrupt if interrupted (what was measured is
    kept) and ``KernelBuildError`` if the worker dies or cannot start."""
    options = {"trials": trials, "time_budget_s": time_budget_s, "rpc": rpc, "space": space}
    options["progress"] = progress
    request = {
        "kind": "tune",
        "spec": spec,
        "m": m,
        "k": k,
        "options": options,
        "database": str(tuning_dir(spec)),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
    }
    if build_worker.in_process():  # the compiler in this process (debugging)
        return importlib.import_module(build_worker.WORKER_MODULE).tune(request)
    kept = f"what it measured is kept in {tuning_dir(spec)}: run again to resume"
    doing = f"tuning kernel {spec.name()} ({kept})"
    return build_worker.ask_alone(request, spec, doing)["result"]
