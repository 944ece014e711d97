"""Checking and timing kernels against torch: one place for the tests, the tuner, the
ladder and the benchmarks.

``tolerance`` is the one tolerance table; ``check_correct`` compares a kernel with torch (in
float64) on fresh random data. ``time_fn`` is best-of-medians over rounds; ``time_interleaved``
and ``time_alternating`` alternate the contenders round by round, so that a change of
machine load hits all alike.
"""

from __future__ import annotations

import statistics
import time

import torch

from .kernels.gemm import GemmSpec, torch_activation
from .runtime.loader import sync_threads


def make_inputs(spec: GemmSpec, m: int, k: int | None = None, seed: int | None = None) -> list:
    g = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
    dtype = getattr(torch, spec.dtype)
    k = spec.problem_k(k)
    a = torch.randn(m, k, generator=g).to(dtype)
    b_shape = (k, spec.n) if spec.b_layout == "kn" else (spec.n, k)
    args = [a, torch.randn(*b_shape, generator=g).to(dtype)]
    if spec.bias:
        args.append(torch.randn(spec.n, generator=g).to(dtype))
    return args


def tolerance(dtype: torch.dtype, k: int = 1) -> dict:
    """One tolerance table: fp32/fp64 near torch's defaults; narrow dtypes scaled with K
    (the reduction depth), as their rounding errors grow with it."""
    if dtype == torch.float64:
        return {"rtol": 1e-7, "atol": 1e-7 * max(1, k) ** 0.5}
    if dtype == torch.float32:
        return {"rtol": 1.3e-5, "atol": 1e-5 * max(1, k) ** 0.5}
    eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
    return {"rtol": 2 * eps, "atol": 2 * eps * max(1, k) ** 0.5}


def reference(spec: GemmSpec, args: list):
    """What torch computes for the kernel's inputs (in float64, then cast)."""
    a, b = args[0].double(), args[1].double()
    y = a @ (b if spec.b_layout == "kn" else b.T)
    if spec.bias:
        y = y + args[2].double()
    return torch_activation(spec.activation)(y).to(getattr(torch, spec.dtype))


def check_correct(spec: GemmSpec, fn, m: int, k: int | None = None) -> tuple[bool, str]:
    """Compare ``fn`` with torch on fresh random data, at ``m`` and at an odd batch."""
    for rows in dict.fromkeys((m, 7 if m != 7 else 5)):
        args = make_inputs(spec, rows, k)
        out = torch.empty(rows, spec.n, dtype=args[0].dtype)
        fn(*args, out)
        expected = reference(spec, args)
        err = (out.double() - expected.double()).abs().max().item()
        if not torch.allclose(out, expected, **tolerance(out.dtype, args[0].shape[1])):
            return False, f"max |diff| {err:.2e} at M={rows}"
    return True, ""


def time_fn(fn, args: list, rounds: int = 3, min_time_s: float = 0.1, max_reps: int = 30) -> float:
    """Seconds per call: the best of ``rounds`` medians, after one warm-up call.

    Best-of-medians because these 2 cores are shared: a parallel kernel (torch's or ours)
    whose second thread loses its core waits a whole scheduler slice, and one such burst
    can hold a single median at 1% of the real speed (seen: torch.matmul at 2 GFLOPS).
    """
    fn(*args)
    medians = []
    for _ in range(rounds):
        times: list[float] = []
        while len(times) < 3 or (sum(times) < min_time_s and len(times) < max_reps):
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return min(medians)


def time_interleaved(spec: GemmSpec, m: int, k: int | None, fns: list, rounds: int = 3) -> list:
    """Seconds per call of each kernel on the same inputs, timed in interleaved rounds so
    that a change of machine load (2 shared cores) hits all alike; the best round of each."""
    sync_threads()  # the kernels are called directly here: size TVM's pool as torch's
    args = make_inputs(spec, m, k, seed=0)
    out = torch.empty(m, spec.n, dtype=args[0].dtype)
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], time_fn(fn, [*args, out], rounds=1))
    return best


def _median_time(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_alternating(tvm_fn, torch_fn, repeats: int, rounds: int = 3) -> tuple[float, float]:
    """Seconds per call of two no-argument functions: each round times both (a median of
    ``repeats`` calls each), the best round of each is kept."""
    t_tvm, t_torch = [], []
    for _ in range(rounds):
        t_tvm.append(_median_time(tvm_fn, repeats))
        t_torch.append(_median_time(torch_fn, repeats))
    return min(t_tvm), min(t_torch)
