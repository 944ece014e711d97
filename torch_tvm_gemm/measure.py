"""Checking and timing kernels against torch: one place for the tests, the tuner, the
ladder and the benchmarks.

``tolerance`` is the one tolerance table; ``check_correct`` compares a kernel with torch (in
float64) on fresh random data. ``time_interleaved`` is the one timer: it alternates the
contenders round by round, so that a change of machine load hits all alike, each sample a
median of single calls (``median_call``) or the mean of a block of calls (``mean_call``);
``gflops_vs_torch`` and ``time_kernels`` apply it to a pair of calls and to GEMM kernels. ``keep_freed_memory`` keeps
the allocator from returning large outputs' memory to the OS between calls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

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


def median_call(
    fn: Callable[[], object],
    calls: int = 3,
    min_time_s: float = 0.0,
    max_calls: int = 30,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of single calls of ``fn``, after one untimed call: ``calls`` of them,
    more (up to ``max_calls``) while they add up to less than ``min_time_s``."""
    fn()
    times: list[float] = []
    while len(times) < calls or (sum(times) < min_time_s and len(times) < max_calls):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def mean_call(
    fn: Callable[[], object], calls: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``, timed as one block: for
    calls too short to time one by one, and for what a loop of them costs."""
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def time_interleaved(
    fns: Sequence[Callable[[], object]],
    rounds: int = 3,
    sample: Callable[[Callable[[], object]], float] = median_call,
    keep: Callable[[list[float]], float] = min,
    warm_up: bool = True,
) -> list[float]:
    """Seconds per call of each no-argument function: after one warm-up call of each (it
    builds or loads kernels), ``rounds`` rounds that take one ``sample`` of every function
    in turn, so that a change of machine load (shared cores) hits all alike; then ``keep``
    of each function's samples: ``min``, its best round (default), or ``statistics.median``.

    The best round by default because these cores are shared: a parallel kernel (torch's or
    ours) whose second thread loses its core waits a whole scheduler slice, and one such
    burst can hold a sample at 1% of the real speed (seen: torch.matmul at 2 GFLOPS).
    """
    if warm_up:
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(sample(fn))
    return [keep(s) for s in samples]


def gflops_vs_torch(tvm_fn, torch_fn, flops: float, calls: int) -> dict:
    """``tvm_gflops``, ``torch_gflops`` and ``ratio`` (torch's time over ours) of two
    no-argument functions that each compute ``flops``: ``time_interleaved``, each sample a
    median of ``calls`` calls."""
    t_tvm, t_torch = time_interleaved(
        [tvm_fn, torch_fn], sample=lambda fn: median_call(fn, calls=calls)
    )
    return {
        "tvm_gflops": flops / t_tvm / 1e9,
        "torch_gflops": flops / t_torch / 1e9,
        "ratio": t_torch / t_tvm,
    }


def time_kernels(spec: GemmSpec, m: int, k: int | None, fns: list, rounds: int = 3) -> list:
    """Seconds per call of each GEMM kernel of ``spec`` on the same inputs (``time_interleaved``,
    each sample a median of calls over at least 0.1 s)."""
    sync_threads()  # the kernels are called directly here: size TVM's pool as torch's
    args = make_inputs(spec, m, k, seed=0)
    out = torch.empty(m, spec.n, dtype=args[0].dtype)
    calls = [lambda fn=fn: fn(*args, out) for fn in fns]
    return time_interleaved(calls, rounds, sample=lambda fn: median_call(fn, min_time_s=0.1))


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks instead of handing them back to the OS.

    By default a freed block of more than ~128 KB-32 MB goes back to the OS and the next
    call's output is page-faulted in afresh: ~0.3 ms for a 3 MB output, as much as the conv
    itself, and on one side or the other depending on the allocator's history (seen: torch's
    56x56 64->256 1x1 conv at 0.35 or 1.9 ms from run to run, ours at 0.28 or 0.66). Both
    sides allocate their outputs the same way; this times the computations. False where
    ``mallopt`` is unavailable (not glibc). It lasts for the process.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        big = 1 << 30
        return bool(libc.mallopt(m_mmap_threshold, big) and libc.mallopt(m_trim_threshold, big))
    except (OSError, AttributeError):
        return False
