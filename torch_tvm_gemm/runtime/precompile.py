"""Load or build many kernels at once, the missing ones in parallel compile workers.

A model converted for TVM kernels needs a dozen or more of them; built on first use they
build one after another, as each layer first runs. ``precompile_specs`` asks for all of them
up front: cached kernels are loaded, missing ones built by up to ``workers`` compile workers
at a time (``build_worker``), each then in the kernel table as if it had been used. A
variant chosen by a measurement (``variant_choice``) has each of its candidate kernels made
ready; the measurement waits for its first use, when no builds compete for the cores.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from . import build_worker, cache, variant_choice
from .build_worker import KernelBuildError
from .table import get_kernel


def precompile_specs(specs: Iterable, workers: int | None = None) -> int:
    """Make every kernel of ``specs`` ready (loaded, built first where missing); returns how
    many builds this process ran meanwhile (other threads' included).

    ``workers`` bounds the builds at once (default ``build_worker.max_workers()``: the usable
    cores, or ``TVM_GEMM_BUILD_WORKERS``). Every kernel is tried; if any failed, a
    ``KernelBuildError`` names each failed kernel and its error (``.errors``: name ->
    exception) once the others are ready.
    """
    unique = variant_choice.with_candidates(specs)
    if not unique:
        return 0
    if workers is not None and workers < 1:
        raise ValueError(f"torch_tvm_gemm.precompile_specs: workers must be >= 1, got {workers}")
    threads = min(len(unique), workers or build_worker.max_workers())
    before = build_worker.build_count()
    errors: dict[str, BaseException] = {}
    with ThreadPoolExecutor(threads, thread_name_prefix="tvm_gemm_build") as pool:
        futures = {spec: pool.submit(_make_ready, spec) for spec in unique}
        for spec, future in futures.items():
            err = future.exception()
            if err is not None:
                errors[spec.name()] = err
    build_worker.trim()  # keep one idle worker for later misses, not one per core
    if errors:
        lines = "\n".join(f"  {name}: {type(e).__name__}: {e}" for name, e in errors.items())
        failure = KernelBuildError(
            f"torch_tvm_gemm: {len(errors)} of {len(unique)} kernels failed to build:\n{lines}",
            kernel=", ".join(errors),
        )
        failure.errors = errors
        raise failure
    return build_worker.build_count() - before


def _make_ready(spec) -> None:
    if variant_choice.measured(spec):
        cache.load_or_build(spec)  # built and cached; chosen against the other at first use
    else:
        get_kernel(spec)
