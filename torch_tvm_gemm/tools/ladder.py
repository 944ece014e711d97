"""The CPU optimization ladder: named schedules of one GEMM, each adding one classic step.

Every step schedules the same math (``kernels.gemm.gemm_compute``) for float32 ``A (M, K) @
B (K, N)``, so the differences in speed come from the schedule alone:

    naive       the three loops as written: B is read down a column in the inner loop
    tiled       32x32 output tiles, loops reordered (i, k, j) so the inner loop is contiguous
    packed      B copied into panels [N/NR, K, NR] (the CPU analogue of GPU shared memory):
                each tile streams one contiguous panel
    vectorized  an MR x NR accumulator tile held in registers over the whole K loop, the NR
                columns as SIMD vectors (one broadcast of A feeds NR/VEC FMAs)
    parallel    the panels split over the cores
    unrolled    the register tile's loops unrolled: the production schedule
                (``schedules/cpu.py``), reused as it is, so there is one way to do it

The auto-tuned step (MetaSchedule) lives in ``tune.py``; ``cli/ladder.py`` runs both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..kernels.gemm import GemmSpec, gemm_compute
from ..schedules import cpu as cpu_schedules
from ..target import host_cpu

TILE = 32  # the "tiled" step's output tile: 32x32 fp32 = 4 KB of C, B rows stay in L1


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    schedule: Callable[[GemmSpec], Any]  # spec -> scheduled IRModule
    max_size: int | None = None  # above this the step takes minutes: skipped


def ladder_spec(n: int, k: int) -> GemmSpec:
    """The ladder's kernel: float32 ``(M, K) @ (K, N)``, M symbolic as everywhere."""
    return GemmSpec(dtype="float32", n=n, k=k, b_layout="kn")


def inline_operands(sch) -> None:
    sch.compute_inline(sch.get_sblock("A_pad"))
    sch.compute_inline(sch.get_sblock("B_pad"))


def naive(spec: GemmSpec):
    from tvm import s_tir

    sch = s_tir.Schedule(gemm_compute(spec))
    inline_operands(sch)
    return sch.mod


def tiled(spec: GemmSpec):
    from tvm import s_tir

    sch = s_tir.Schedule(gemm_compute(spec, TILE, TILE))  # padded: tiles need no predicate
    inline_operands(sch)
    acc = sch.get_sblock("acc")
    i, j, k = sch.get_loops(acc)
    io, ii = sch.split(i, [None, TILE])
    jo, ji = sch.split(j, [None, TILE])
    # (i, k, j) inside a tile: A[i, k] is reused along j, B[k, j] and C[i, j] are contiguous.
    sch.reorder(io, jo, ii, k, ji)
    sch.reverse_compute_at(sch.get_sblock("out"), jo)
    sch.decompose_reduction(acc, ii)
    return sch.mod


def _register_tiled(vectorize: bool, parallel: bool) -> Callable[[GemmSpec], Any]:
    """The packed schedule, with or without the register tile + SIMD, and threads.

    Without ``vectorize`` the tile is NR wide and MR tall but accumulates in memory
    (``acc`` stays global): the packing step alone.
    """

    def schedule(spec: GemmSpec):
        from tvm import s_tir

        mr, nr, vec = cpu_schedules.register_tile(spec, host_cpu())
        sch = s_tir.Schedule(gemm_compute(spec, mr, nr))
        acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
        sch.compute_inline(sch.get_sblock("A_pad"))
        b_pad = sch.get_sblock("B_pad")
        sch.transform_layout(b_pad, ("write", 0), lambda k, n: (n // nr, k, n % nr))
        i, j, k = sch.get_loops(acc)
        io, ii = sch.split(i, [None, mr])
        jo, ji = sch.split(j, [None, nr])
        sch.reorder(jo, io, k, ii, ji)
        sch.reverse_compute_at(out, io)
        if vectorize:
            jio, jii = sch.split(ji, [None, vec])
            sch.set_scope(acc, 0, "local")  # the MR x NR sums stay in registers over k
            sch.vectorize(jii)
        if parallel:
            sch.parallel(sch.get_loops(b_pad)[0])
            sch.parallel(jo)
        sch.decompose_reduction(acc, k)
        return sch.mod

    return schedule


def unrolled(spec: GemmSpec):
    return cpu_schedules.schedule_gemm(spec)


HAND_STEPS: list[Step] = [
    Step("naive", "three loops, no schedule", naive, max_size=1024),
    Step("tiled", "32x32 tiles, loops reordered (i,k,j)", tiled),
    Step("packed", "B packed into contiguous panels", _register_tiled(False, False)),
    Step("vectorized", "register tile + SIMD", _register_tiled(True, False)),
    Step("parallel", "panels over the cores", _register_tiled(True, True)),
    Step("unrolled", "register tile unrolled (production)", unrolled),
]
TUNED_STEP = "tuned"


def compile_step(step: Step, spec: GemmSpec):
    """The compiled ``main`` of ``step`` for ``spec`` (in memory, not cached)."""
    import tvm

    from ..compiler.build import target_json

    executable = tvm.compile(step.schedule(spec), target=tvm.target.Target(target_json("cpu")))
    return executable


# --- running the ladder ---------------------------------------------------------------------


@dataclass
class Result:
    step: str
    size: int
    gflops: float | None  # None: skipped or wrong
    max_err: float | None = None
    note: str = ""


TORCH_BY_THREADS: dict[int, dict[int, float]] = {}  # size -> threads -> GFLOPS, last run
SLOW_S = 0.5  # a kernel whose first call takes longer is timed by that call alone
ROUNDS = 3  # interleaved timing rounds (see run_size)


def check(out, expected, k: int) -> tuple[bool, float]:
    """fp32 against a float64 reference: the same tolerance as the test suite."""
    import torch

    from ..measure import tolerance

    err = (out.double() - expected).abs().max().item()
    ok = torch.allclose(out.double(), expected, **tolerance(torch.float32, k))
    return ok, err


def at_threads(fn: Callable[[], float], threads: int | None) -> float:
    """``fn()`` with torch at ``threads`` threads (None: as it is).

    Why the ladder times torch.matmul at one thread too: on an oversubscribed machine (these
    2 cores are shared) torch's OpenMP barrier waits for a descheduled worker thread a whole
    time slice per call, and a small matmul then runs at ~1% of its speed (seen: 2 GFLOPS at
    256^3 with 2 threads, 50+ with one). The reference should be the best torch can do here.
    """
    import torch

    before = torch.get_num_threads()
    if threads is None or threads == before:
        return fn()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def tuned_kernel(size: int, trials: int, budget_s: float, progress: bool):
    """The auto-tuned step's kernel (the search's best, kept or not) and a note."""
    from ..compiler.tune import compile_module, tune_spec
    from ..compiler.tune_space import apply_trace
    from ..runtime.records import read_best

    spec = ladder_spec(size, size)
    res = tune_spec(spec, size, trials=trials, time_budget_s=budget_s, progress=progress)
    best = read_best(spec)
    if best is None:
        return None, res.reason
    verdict = "kept" if res.kept else f"not kept: {res.reason}"
    return compile_module(apply_trace(spec, best["trace"])), f"{res.trials} trials; {verdict}"


def run_size(
    size: int,
    steps: list[Step],
    tune_trials: int = 0,
    tune_budget_s: float = 0.0,
    progress: bool = True,
    log=print,
) -> tuple[float, list[Result]]:
    """torch.matmul's GFLOPS and each step's result at ``size``^3, on the same inputs.

    Each kernel is checked against a float64 reference on its first call; then all of them
    and torch.matmul are timed in ``ROUNDS`` interleaved rounds, each keeping its best, so
    that a burst of load from other processes on these shared cores does not favour
    whichever kernel happened to run in a quiet moment.
    """
    import time

    import torch

    from ..measure import median_call, time_interleaved
    from ..runtime.loader import sync_threads

    threads = torch.get_num_threads()
    sync_threads()  # TVM's pool: as many threads as torch uses
    g = torch.Generator().manual_seed(size)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    out = torch.empty(size, size)
    expected = a.double() @ b.double()
    kernels: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for step in steps:
        if step.max_size is not None and size > step.max_size:
            notes[step.name] = f"skipped above {step.max_size}"
        else:
            kernels[step.name] = compile_step(step, ladder_spec(size, size))["main"]
    if tune_trials > 0:
        fn, notes[TUNED_STEP] = tuned_kernel(size, tune_trials, tune_budget_s, progress)
        if fn is not None:
            kernels[TUNED_STEP] = fn
    best: dict[str, float] = {}
    errors: dict[str, float] = {}
    slow: set[str] = set()
    for name, fn in kernels.items():  # verify (the first call, also a timing)
        out.fill_(float("nan"))
        t0 = time.perf_counter()
        fn(a, b, out)
        best[name] = time.perf_counter() - t0
        ok, errors[name] = check(out, expected, size)
        if not ok:
            notes[name] = "WRONG RESULT"
        if best[name] > SLOW_S:
            slow.add(name)
    # torch.matmul at its own thread count and at one (see at_threads), then the kernels.
    torch_threads = list(dict.fromkeys((threads, 1)))
    torch_fns = [lambda: torch.matmul(a, b, out=out) for _ in torch_threads]
    timed = [n for n in kernels if n not in slow and notes.get(n) != "WRONG RESULT"]
    fns = torch_fns + [lambda fn=kernels[n]: fn(a, b, out) for n in timed]
    threads_of = dict(zip(torch_fns, torch_threads, strict=True))

    def sample(fn) -> float:
        return at_threads(lambda: median_call(fn, min_time_s=0.1), threads_of.get(fn))

    seconds = time_interleaved(fns, ROUNDS, sample=sample, warm_up=False)
    torch_s = dict(zip(torch_threads, seconds, strict=False))
    for name, t in zip(timed, seconds[len(torch_fns) :], strict=True):
        best[name] = min(best[name], t)  # (the checking call counts as a sample too)
    flops = 2.0 * size**3
    results = []
    for name in [s.name for s in steps] + ([TUNED_STEP] if TUNED_STEP in notes else []):
        ok = name in kernels and notes.get(name) != "WRONG RESULT"
        gf = flops / best[name] / 1e9 if ok else None
        results.append(Result(name, size, gf, errors.get(name), notes.get(name, "")))
        log(f"  {size}: {name:<11} {gf or 0:8.1f} GFLOPS  {notes.get(name, '')}")
    by_threads = {n: round(flops / t / 1e9, 2) for n, t in torch_s.items()}
    torch_gf = max(by_threads.values())  # the reference: torch at its best thread count
    log(f"  {size}: torch.matmul {torch_gf:.1f} GFLOPS (by threads: {by_threads})")
    TORCH_BY_THREADS[size] = by_threads
    return torch_gf, results
