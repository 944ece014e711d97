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

from .kernels.gemm import GemmSpec, gemm_compute
from .schedules import cpu as cpu_schedules
from .target import host_cpu

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


def _inline_operands(sch) -> None:
    sch.compute_inline(sch.get_sblock("A_pad"))
    sch.compute_inline(sch.get_sblock("B_pad"))


def naive(spec: GemmSpec):
    from tvm import s_tir

    sch = s_tir.Schedule(gemm_compute(spec))
    _inline_operands(sch)
    return sch.mod


def tiled(spec: GemmSpec):
    from tvm import s_tir

    sch = s_tir.Schedule(gemm_compute(spec, TILE, TILE))  # padded: tiles need no predicate
    _inline_operands(sch)
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

        mr, nr, vec = cpu_schedules._tile(spec, host_cpu())
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

    from .build import target_json

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


def measure(fn, args: list, slow_s: float = 0.5) -> tuple[float, Any]:
    """(median seconds per call, the first call's output): one call only for a slow kernel
    (the naive one runs seconds; its speed is not in doubt to a few percent)."""
    import time

    from .tune import time_fn

    t0 = time.perf_counter()
    fn(*args)
    first = time.perf_counter() - t0
    if first > slow_s:
        return first, args[-1].clone()
    out = args[-1].clone()
    return min(first, time_fn(fn, args)), out


def check(out, expected, k: int) -> tuple[bool, float]:
    """fp32 against a float64 reference: the same tolerance as the test suite."""
    import torch

    err = (out.double() - expected).abs().max().item()
    ok = torch.allclose(out.double(), expected, rtol=1.3e-5, atol=1e-5 * max(1, k) ** 0.5)
    return ok, err


def best_torch_gflops(a, b, out) -> float:
    """torch.matmul's GFLOPS at its own thread count, or at one thread if that is faster.

    Why both: on an oversubscribed machine (these 2 cores are shared) torch's OpenMP
    barrier waits for a descheduled worker thread a whole time slice per call, and a small
    matmul then runs at ~1% of its speed (seen: 2 GFLOPS at 256^3 with 2 threads, 50+ with
    one). The reference should be the best torch can do here, not its worst.
    """
    import torch

    from .tune import time_fn

    flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    threads = torch.get_num_threads()
    best = 0.0
    for n in dict.fromkeys((threads, 1)):
        torch.set_num_threads(n)
        try:
            seconds = time_fn(lambda x, y, o: torch.matmul(x, y, out=o), [a, b, out])
        finally:
            torch.set_num_threads(threads)
        best = max(best, flops / seconds / 1e9)
    return best


def run_size(size: int, steps: list[Step], log=print) -> tuple[float, list[Result]]:
    """torch.matmul's GFLOPS and each hand step's result at ``size``^3, same inputs."""
    import torch

    from .runtime import sync_threads

    sync_threads()  # TVM's pool: as many threads as torch uses
    flops = 2.0 * size**3
    g = torch.Generator().manual_seed(size)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    out = torch.empty(size, size)
    expected = a.double() @ b.double()

    def torch_gflops() -> float:
        return best_torch_gflops(a, b, out)

    torch_gf = torch_gflops()
    results = []
    for step in steps:
        if step.max_size is not None and size > step.max_size:
            results.append(Result(step.name, size, None, note=f"skipped above {step.max_size}"))
            continue
        fn = compile_step(step, ladder_spec(size, size))["main"]
        out.fill_(float("nan"))
        seconds, got = measure(fn, [a, b, out])
        ok, err = check(got, expected, size)
        gf = flops / seconds / 1e9 if ok else None
        results.append(Result(step.name, size, gf, err, "" if ok else "WRONG RESULT"))
        log(f"  {size}: {step.name:<11} {gf or 0:8.1f} GFLOPS  max|err| {err:.1e}")
    # torch again after the steps: the best of both, so a burst of load from other
    # processes during one measurement does not flatter our ratios.
    torch_gf = max(torch_gf, torch_gflops())
    log(f"  {size}: torch.matmul {torch_gf:.1f} GFLOPS")
    return torch_gf, results


def run_tuned(size: int, trials: int, time_budget_s: float, progress: bool = True) -> Result:
    """The auto-tuned step: tune (or reuse the database), verify, time in this run."""
    import torch

    from .tune import _apply_trace, _compile, read_best, time_fn, tune_spec

    spec = ladder_spec(size, size)
    res = tune_spec(spec, size, trials=trials, time_budget_s=time_budget_s, progress=progress)
    best = read_best(spec)
    if best is None:
        return Result(TUNED_STEP, size, None, note=res.reason)
    fn = _compile(_apply_trace(spec, best["trace"]))  # the search's best, kept or not
    g = torch.Generator().manual_seed(size)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    out = torch.empty(size, size)
    seconds = time_fn(fn, [a, b, out])
    ok, err = check(out, a.double() @ b.double(), size)
    note = f"{res.trials} trials ({res.new_trials} new); " + (
        "kept" if res.kept else f"not kept: {res.reason}"
    )
    return Result(TUNED_STEP, size, 2.0 * size**3 / seconds / 1e9 if ok else None, err, note)
