"""MetaSchedule tuning of GEMM kernels, with a persistent database in the cache dir.

Layout: ``<cache dir>/tuning/<kernel name>-<key hash>/`` per kernel (the key is the kernel's,
less the tuned flag), holding MetaSchedule's JSON database (``database_workload.json``,
``database_tuning_record.json``: every measured trial, appended line by line, so a tuning
run killed by Ctrl-C or a crash resumes from what it measured) and ``best.json``, our verdict:
the best trace, its speed, the hand schedule's speed in the same run, and ``kept``.

A tuned kernel is kept only if it matches torch on fresh random data and beats the hand
schedule measured in the same process; ``build.lower`` asks ``tuned_module(spec)`` first and
falls back to the hand schedule otherwise, and ``runtime.cache.full_key`` folds ``runtime.records.tuned_key(spec)``
into the kernel's key so that a tuned build never collides with the hand one.

The search space: what limits a CPU GEMM is the micro-kernel, which MetaSchedule's generic
multi-level tiling does not find in a short budget (0.63x torch after 32 trials in our notes).
So the default space is the production schedule's structure (packed B, register tile,
SIMD, unroll) with its free parameters sampled: the register tile's height, the loop order
(panel-major, or row blocks of a sampled height), which loop runs in parallel, if any. Its traces
use only splits with a symbolic outer factor, so a trace tuned at one M replays on the
symbolic-M kernel that serves every batch size. ``space="generic"`` gives MetaSchedule's own.

Tuning is per kernel (not per M): it measures at the M given (the batch of the shapes or the
model's example input) and the result serves every M.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..kernels.gemm import GemmSpec
from ..measure import check_correct, time_kernels
from ..runtime.cache_trust import PRIVATE_FILE_MODE, make_private_dir
from ..runtime.records import BEST, TuneResult, tuning_dir
from .tune_db import open_database, record_seconds, records_of
from .tune_space import apply_trace, hand_space, tuned_compute


def _target():
    import tvm

    from .build import target_json

    return tvm.target.Target({**target_json("cpu"), "num-cores": os.cpu_count() or 1})


def _evaluator():
    from tvm.s_tir import meta_schedule as ms

    return ms.runner.EvaluatorConfig(number=3, repeat=3, min_repeat_ms=40)


def _runner(rpc: tuple[str, int, str] | None):
    """Measure in this process, or on a remote device through a TVM RPC tracker.

    In-process (not MetaSchedule's LocalRunner / LocalBuilder): those start worker
    processes that import TVM afresh (~10 s each on 2 busy cores; the builder's pool is
    restarted for every batch, and its 30 s timeout then fails whole batches). Our kernels
    are built from a fixed, safe space, so the isolation they buy is not needed.
    """
    from tvm.s_tir import meta_schedule as ms

    if rpc is None:
        return _in_process_runner()
    host, port, key = rpc
    config = ms.runner.RPCConfig(
        tracker_host=host, tracker_port=port, tracker_key=key, session_timeout_sec=120
    )
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=_evaluator())


def _in_process_builder():
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build, default_export

    @derived_object
    class InProcessBuilder(PyBuilder):
        def build(self, build_inputs):
            results = []
            for item in build_inputs:
                try:
                    path = default_export(default_build(item.mod, item.target, None))
                    results.append(BuilderResult(path, None))
                except Exception as err:  # reported as a failed trial, search goes on
                    results.append(BuilderResult(None, f"build failed: {err}"))
            return results

    return InProcessBuilder()


def _in_process_runner():
    import tvm
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.runner import PyRunner
    from tvm.s_tir.meta_schedule.runner.local_runner import (
        LocalRunnerFuture,
        default_alloc_argument,
        default_run_evaluator,
    )

    evaluator = _evaluator()

    def measure(item) -> list[float]:
        # (the artifact is removed by MetaSchedule's own measure callback)
        module = tvm.runtime.load_module(item.artifact_path)
        device = tvm.runtime.device(item.device_type, 0)
        info = tuple(a.as_json() for a in item.args_info)
        args = default_alloc_argument(device, info, 1)
        return [float(s) for s in default_run_evaluator(module, device, evaluator, args)]

    @derived_object
    class InProcessRunner(PyRunner):
        def run(self, runner_inputs):
            futures = []
            for item in runner_inputs:
                try:
                    futures.append(LocalRunnerFuture(res=measure(item)))
                except Exception as err:
                    futures.append(LocalRunnerFuture(error_message=f"run failed: {err}"))
            return futures

    return InProcessRunner()


def _strategy():
    """Evolutionary search sized for short budgets on few cores: MetaSchedule's default
    (a population of 512, each candidate lowered for the cost model's features) spends
    over a minute per round on 2 cores before it measures anything."""
    from tvm.s_tir import meta_schedule as ms

    return ms.search_strategy.EvolutionarySearch(
        population_size=48, init_min_unmeasured=16, genetic_num_iters=2
    )


def _space_generator(spec: GemmSpec, space: str):
    from tvm.s_tir import meta_schedule as ms

    if space == "generic":
        return "post-order-apply"
    # Our schedule is complete: no generic rules or postprocessors on top of it.
    return ms.space_generator.ScheduleFn(
        hand_space(spec), sch_rules=[], postprocs=[], mutator_probs={}
    )


def tune_spec(
    spec: GemmSpec,
    m: int,
    k: int | None = None,
    trials: int = 32,
    time_budget_s: float = 600.0,
    rpc: tuple[str, int, str] | None = None,
    space: str = "hand",
    per_round: int = 8,
    progress: bool = True,
) -> TuneResult:
    """Tune ``spec`` at batch ``m`` (and ``k`` if K is symbolic) until the database holds
    ``trials`` measurements of it or ``time_budget_s`` runs out; then verify the best,
    compare it with the hand schedule and write the verdict. Runs under a file lock: a
    second process tuning the same kernel waits, then finds the work done."""
    work_dir = tuning_dir(spec)
    make_private_dir(work_dir)
    deadline = time.monotonic() + time_budget_s
    with FileLock(str(work_dir / "lock"), timeout=max(1.0, time_budget_s)):
        with _no_tensor_intrinsics(space == "hand"):
            done, new = _search(spec, m, k, trials, deadline, rpc, space, per_round, progress)
            return _verdict(spec, m, k, done, new, space)


@contextlib.contextmanager
def _no_tensor_intrinsics(enabled: bool):
    """Skip importing ``tvm.s_tir.tensor_intrin`` while tuning our own space.

    MetaSchedule's TuneContext and its builder import it unconditionally, and it parses
    some 250 TVMScript intrinsics (CUDA, ARM, x86, ...): 35-45 s on 2 busy cores, more than
    a short tuning run itself. The hand space never tensorizes, so an empty module stands
    in for it while we tune; it is removed afterwards, so a later real import still works.
    """
    name = "tvm.s_tir.tensor_intrin"
    if not enabled or name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        sys.modules.pop(name, None)


def _search(spec, m, k, trials, deadline, rpc, space, per_round, progress) -> tuple[int, int]:
    """Rounds of MetaSchedule until the budget is met; returns (measured, measured now).

    Rounds (not one long ``tune_tir``) so that progress, the time budget and Ctrl-C act
    between them; each round resumes from the database, which keeps every measurement.
    """
    from tvm.ir import IRModule
    from tvm.s_tir import meta_schedule as ms

    from ..runtime.loader import sync_threads

    # Candidates run in this thread: give its TVM pool torch's thread count first (else, in a
    # process that never ran an op, TVM sizes it to half the cores and the search ranks
    # kernels by their one-thread speed: seen, 249 GFLOPS "best" against 480 on two).
    sync_threads()
    work_dir = tuning_dir(spec)
    mod = IRModule({"main": tuned_compute(spec, m, k)})
    target = _target()
    flops = 2.0 * m * spec.n * spec.problem_k(k)
    done = len(records_of(open_database(work_dir), mod))
    start_done = done
    bar = _progress_bar(trials, done, spec, progress)
    builder, runner = _in_process_builder(), _runner(rpc)  # reused over the rounds
    with _ctrl_c_flag() as ctrl_c:
        try:
            while done < trials and time.monotonic() < deadline:
                _quiet_console()
                try:
                    ms.tune_tir(
                        mod,
                        target,
                        str(work_dir),
                        max_trials_global=min(per_round, trials - done),
                        num_trials_per_iter=min(per_round, trials - done),
                        builder=builder,
                        runner=runner,
                        space=_space_generator(spec, space),
                        strategy=_strategy(),
                        database=open_database(work_dir),
                        num_tuning_cores=1,
                    )
                except Exception as err:
                    if ctrl_c["hit"]:  # what was measured is in the database already
                        raise KeyboardInterrupt from err
                    raise
                if ctrl_c["hit"]:
                    raise KeyboardInterrupt
                records = records_of(open_database(work_dir), mod)
                if len(records) == done:  # nothing new measured (space exhausted, all failed)
                    break
                bar.update(len(records) - done)
                done = len(records)
                best = flops / record_seconds(records[0]) / 1e9
                left = max(0, deadline - time.monotonic())
                bar.set_postfix_str(f"best {best:.1f} GFLOPS, {left:.0f} s of budget left")
        finally:
            bar.close()
    return done, done - start_done


@contextlib.contextmanager
def _ctrl_c_flag():
    """Make Ctrl-C stop tuning between rounds rather than inside one.

    A KeyboardInterrupt raised while MetaSchedule's C++ loop is calling back into our
    builder or runner is, at best, turned into a RuntimeError or a failed trial, and at
    worst crashes the process (seen: a segfault). So the first Ctrl-C only sets a flag that
    the round loop checks (the current round ends in seconds; what it measured is kept);
    a second one interrupts at once, as usual. (In this process, a Ctrl-C that lands
    while the compiler's SMT solver proves a bound is taken by the solver, which gives up
    that proof: press again. A tuning worker is stopped by another signal; see
    ``runtime.build_worker.STOP_SIGNAL``.)
    """
    state = {"hit": False}
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if on_main else None
    if not on_main or previous == signal.SIG_IGN:  # not ours to handle
        yield state
        return

    def handler(signum, frame):
        state["hit"] = True
        print("\nCtrl-C: stopping after this round (again to abort now)", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)


def _quiet_console() -> None:
    """Keep MetaSchedule's per-round tables in its log files, off the console.

    Its console handler takes the level its logger has when ``tune_tir`` configures logging,
    and that configuration resets the logger to DEBUG: so this is needed before every round.
    """
    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    logger.setLevel(logging.WARNING)
    # tune_tir rebuilds the logging config naming every handler of this logger; a handler
    # someone else attached without a name (pytest >= 9.2 does) makes it crash on None.
    for h in list(logger.handlers):
        if h.get_name() is None:
            logger.removeHandler(h)


def _progress_bar(total: int, done: int, spec: GemmSpec, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, initial=done, desc=f"tune {spec.name()}", unit="trial", disable=not enabled
    )


RECHECK_TOP = 3  # the search's best few are re-timed here: its own measurements are noisy
# A tuned kernel must beat the hand schedule by this factor to be kept: a tie decided by
# noise would swap the kernel for nothing (seen at 2048^3: "kept" at 463 vs 453 GFLOPS in
# the verdict, then 460 vs 481 when the ladder timed both again).
KEEP_MARGIN = 1.01
VERDICT_ROUNDS = 5


def _verdict(spec: GemmSpec, m: int, k: int | None, done: int, new: int, space: str) -> TuneResult:
    """Pick the fastest correct of the search's best records, re-timed here against the hand
    schedule (interleaved, same inputs); keep it only if it wins. Writes ``best.json``."""
    from tvm.ir import IRModule

    from .build import compile_spec

    mod = IRModule({"main": tuned_compute(spec, m, k)})
    records = records_of(open_database(tuning_dir(spec)), mod)[:RECHECK_TOP]
    if not records:
        return TuneResult(spec, m, done, new, None, None, False, "no valid measurement")
    candidates, failure = [], ""
    for record in records:
        trace = _plain(record.trace.as_json())
        try:
            fn = compile_module(apply_trace(spec, trace))
        except Exception as err:  # e.g. a generic-space trace whose tiles assume this M
            failure = f"trace does not replay on the symbolic-M kernel: {err}".splitlines()[0]
            continue
        ok, err = check_correct(spec, fn, m, k)
        if ok:
            candidates.append((trace, fn))
        else:
            failure = f"wrong result ({err})"
    if not candidates:
        return TuneResult(spec, m, done, new, None, None, False, failure)
    hand_fn = compile_spec(spec, use_tuned=False)[0]["main"]
    fns = [fn for _, fn in candidates] + [hand_fn]
    *tuned_s, hand_s = time_kernels(spec, m, k, fns, rounds=VERDICT_ROUNDS)
    pick = min(range(len(candidates)), key=lambda i: tuned_s[i])
    flops = 2.0 * m * spec.n * spec.problem_k(k)
    tuned_gf, hand_gf = flops / tuned_s[pick] / 1e9, flops / hand_s / 1e9
    kept = tuned_s[pick] * KEEP_MARGIN < hand_s
    reason = (
        "correct and faster than the hand schedule"
        if kept
        else f"not {KEEP_MARGIN - 1:.0%} faster than the hand schedule"
    )
    best = {
        "trace": candidates[pick][0],
        "m": m,
        "k": spec.problem_k(k),
        "space": space,
        "tuned_gflops": round(tuned_gf, 2),
        "hand_gflops": round(hand_gf, 2),
        "kept": kept,
        "reason": reason,
        "trials": done,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _atomic_write(tuning_dir(spec) / BEST, json.dumps(best))
    return TuneResult(spec, m, done, new, tuned_gf, hand_gf, kept, reason)


def _plain(obj: Any) -> Any:
    """A trace's JSON form (TVM objects: IntImm, Array, ...) as plain Python for ``json``."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "value") and type(obj).__name__ in ("IntImm", "FloatImm"):
        return obj.value
    if hasattr(obj, "items"):
        return {str(k): _plain(v) for k, v in obj.items()}
    return [_plain(v) for v in obj]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, PRIVATE_FILE_MODE)  # (read_best trusts only records others cannot write)
    os.replace(tmp, path)


def compile_module(mod):
    import tvm

    from .build import target_json

    return tvm.compile(mod, target=tvm.target.Target(target_json("cpu")))["main"]
