"""The tuning design space of CPU GEMM kernels, and replaying a kept tuning record.

What limits a CPU GEMM is the micro-kernel, which MetaSchedule's generic multi-level tiling
does not find in a short budget (0.63x torch after 32 trials). So the space is the
production schedule's structure (packed B, register tile, SIMD, unroll) with its free
parameters sampled: the register tile's height, the loop order (panel-major, or row blocks
of a sampled height), which loop runs in parallel, if any. Its traces use only splits with
a symbolic outer factor, so a trace tuned at one M replays on the symbolic-M kernel that
serves every batch size. ``compiler/tune.py`` searches it; ``compiler/build.py`` asks
``tuned_module`` for a kept record before using the hand schedule.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..kernels.gemm import GemmSpec, gemm_compute
from ..runtime.records import read_best
from ..target import host_cpu

# The tuned kernels pad M to M_PAD, which every sampled register-tile height divides. It is
# the production schedule's own tile height, so that the space contains that schedule with
# the same padding (a pad of 12 cost 0.6% at M=1024 against the hand schedule's 6).
M_PAD = 6
MR_CHOICES = (2, 3, 6)
# Unrolling the K loop by this much (a static K only): fewer loop-counter updates per FMA
# (measured at 1024^3: -0.6% to +1.3% against the hand schedule, within this machine's noise).
K_UNROLL_CHOICES = (1, 2, 4, 8)
ROW_BLOCK_CHOICES = (2, 4, 8, 16)  # register tiles per row block in the row-major order


def _tile(spec: GemmSpec) -> tuple[int, int]:
    from ..schedules.cpu import register_tile

    _, nr, vec = register_tile(spec, host_cpu())
    return nr, vec


def tuned_compute(spec: GemmSpec, m: int | None = None, k: int | None = None):
    """The math the tuned schedules apply to: M padded to ``M_PAD``; ``m`` (and ``k``
    for a symbolic-K kernel) fix the dims for measuring."""
    from tvm import tirx

    nr, _ = _tile(spec)
    func = gemm_compute(spec, M_PAD, nr)
    if m is None:
        return func
    # MetaSchedule measures concrete shapes: bind M (A's first dim) to the tuning batch.
    a = func.params[0]
    shape = (tirx.IntImm("int64", m), tirx.IntImm("int64", spec.problem_k(k)))
    return func.specialize({a: tirx.decl_buffer(shape, spec.dtype, "A")})


def _space(spec: GemmSpec, row_major: bool, parallel: str):
    """One structural variant of the production schedule, parameters sampled.

    ``parallel``: "outer" or "inner" loop of the tile grid over the cores, or "none": on
    shared or SMT cores a second thread can cost more than it brings (measured here: the
    serial kernel beat the parallel one at 256^3), and only a measurement can tell."""

    def apply(sch) -> None:
        nr, vec = _tile(spec)
        acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
        a_pad, b_pad = sch.get_sblock("A_pad"), sch.get_sblock("B_pad")
        if spec.dtype == spec.acc_dtype:
            sch.compute_inline(a_pad)
        else:
            if parallel != "none":
                sch.parallel(sch.get_loops(a_pad)[0])
        if spec.b_layout == "kn":
            sch.transform_layout(b_pad, ("write", 0), lambda k, n: (n // nr, k, n % nr))
        else:
            sch.transform_layout(b_pad, ("write", 0), lambda n, k: (n // nr, k, n % nr))
        if parallel != "none" and row_major:
            sch.parallel(sch.get_loops(b_pad)[0])
        mr = _sample(sch, MR_CHOICES)
        i, j, k = sch.get_loops(acc)
        io, ii = sch.split(i, [None, mr])
        jo, ji = sch.split(j, [None, nr])
        jio, jii = sch.split(ji, [None, vec])
        ku = _sample(sch, _k_unroll_choices(spec))
        ko, ki = sch.split(k, [None, ku])
        if row_major:  # row blocks of A outside, each swept over all panels of B
            rb = _sample(sch, ROW_BLOCK_CHOICES)
            ioo, ioi = sch.split(io, [None, rb])
            sch.reorder(ioo, jo, ioi, ko, ki, ii, jio, jii)
            outer, inner, anchor = ioo, jo, ioi
        else:  # panel-major, as the production schedule
            sch.reorder(jo, io, ko, ki, ii, jio, jii)
            outer, inner, anchor = jo, io, io
        sch.reverse_compute_at(out, anchor)
        sch.set_scope(acc, 0, "local")
        sch.unroll(ki)
        sch.unroll(ii)
        sch.unroll(jio)
        sch.vectorize(jii)
        if parallel != "none":
            sch.parallel(outer if parallel == "outer" else inner)
        if not row_major:  # as the production schedule: each panel packed just before use
            sch.compute_at(b_pad, jo)
        sch.decompose_reduction(acc, ko)

    return apply


def _sample(sch, choices: tuple[int, ...]):
    """A uniformly sampled choice, as a MetaSchedule decision (recorded in the trace)."""
    return sch.sample_categorical(list(choices), [1 / len(choices)] * len(choices))


def _k_unroll_choices(spec: GemmSpec) -> tuple[int, ...]:
    # A symbolic K (or one the factor does not divide) would put a bounds check in the loop.
    if spec.k is None:
        return (1,)
    return tuple(u for u in K_UNROLL_CHOICES if spec.k % u == 0)


def hand_space(spec: GemmSpec):
    """A ScheduleFn returning the structural variants (MetaSchedule samples their knobs)."""

    def fn(sch):
        variants = []
        for row_major in (False, True):
            for parallel in ("outer", "inner", "none"):
                copy = sch.copy()
                _space(spec, row_major, parallel)(copy)
                variants.append(copy)
        return variants

    return fn


def apply_trace(spec: GemmSpec, trace_json: Any):
    """Replay a tuned trace on the symbolic-M kernel; the scheduled IRModule."""
    from tvm import s_tir
    from tvm.s_tir.schedule import Trace

    sch = s_tir.Schedule(tuned_compute(spec))
    Trace.apply_json_to_schedule(trace_json, sch)
    return sch.mod


def tuned_module(spec: GemmSpec):
    """The scheduled IRModule of ``spec`` from its kept tuning record, or None.

    A record that cannot be read or replayed is reported and ignored: the caller falls back
    to the hand schedule.
    """
    if spec.device != "cpu":
        return None
    best = read_best(spec)
    if best is None or not best["kept"]:
        return None
    try:
        return apply_trace(spec, best["trace"])
    except Exception as err:  # a record from another space or TVM: not fatal
        warnings.warn(
            f"torch_tvm_gemm: tuning record of {spec.name()} does not apply ({err}); "
            "using the hand schedule",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
