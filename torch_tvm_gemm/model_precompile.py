"""``precompile(model, *example_inputs)``: every kernel a model needs, ready before its first call.

Left to themselves, a converted model's kernels are built as each layer first runs, one after
another (seconds each). ``precompile`` finds them all first, by running the model once in the
ops' planning mode (``ops.planning``: each TVM op records the kernel it needs and computes
its result with torch; nothing is built), then loads the cached ones and builds the missing
ones in parallel compile workers (``runtime/precompile.py`` ``precompile_specs``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .ops import planning
from .runtime import variant_choice
from .runtime.precompile import precompile_specs
from .runtime.table import has_kernel

_WHO = "torch_tvm_gemm.precompile"


@dataclass(frozen=True)
class PrecompileSummary:
    """What ``precompile`` did: ``kernels`` needed = ``built`` + ``loaded`` (from the disk
    cache or a CUDA pack) + ``ready`` (in memory already); ``seconds`` in all (planning run
    included); ``specs``, the kernels themselves."""

    kernels: int
    built: int
    loaded: int
    ready: int
    seconds: float
    specs: tuple = ()

    def __str__(self) -> str:
        return (
            f"precompile: {self.kernels} kernels ({self.built} built, {self.loaded} loaded from "
            f"the cache, {self.ready} already loaded) in {self.seconds:.1f} s"
        )


def precompile(
    model,
    *example_inputs: Any,
    workers: int | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> PrecompileSummary:
    """Load or build every kernel ``model(*example_inputs, **example_kwargs)`` calls.

    The model runs once under ``torch.no_grad()`` in its current mode (``eval()`` it first
    for inference), in planning mode: no kernel is built meanwhile, torch computes each TVM
    op. The kernels it asked for are then loaded from the cache, or built by up to
    ``workers`` compile workers at once (default: the usable cores, or
    ``TVM_GEMM_BUILD_WORKERS``). Afterwards calls of those shapes build nothing; another
    batch size or sequence length uses the same kernels (M is symbolic) except across the
    M-range variants (``ops.gemm_spec``), and a backward pass may need more (built on first
    use). Returns a ``PrecompileSummary``; a kernel that fails to build raises
    ``KernelBuildError`` naming each one, after the others are ready.
    """
    if not callable(model):
        raise TypeError(f"{_WHO}: expected a model to call, got {type(model).__name__}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise TypeError(f"{_WHO}: workers must be an int or None, got {workers!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"{_WHO}: workers must be >= 1, got {workers}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(
            f"{_WHO}: example_kwargs must be a dict, got {type(example_kwargs).__name__}"
        )
    start = time.perf_counter()
    # (A variant chosen by a measurement at first use needs each of its candidate kernels.)
    planned = model_kernels(model, example_inputs, example_kwargs or {})
    specs = variant_choice.with_candidates(planned)
    ready = sum(has_kernel(spec) for spec in specs)
    built = precompile_specs(specs, workers)
    return PrecompileSummary(
        kernels=len(specs),
        built=built,
        # (built counts this process's other builds meanwhile too: never below zero)
        loaded=max(0, len(specs) - ready - built),
        ready=ready,
        seconds=time.perf_counter() - start,
        specs=tuple(specs),
    )


def model_kernels(model, args: tuple, kwargs: dict) -> list:
    """The kernel specs one no-grad call ``model(*args, **kwargs)`` asks for (planned)."""
    try:
        with torch.no_grad(), planning() as found:
            model(*args, **kwargs)
    except Exception as err:
        if hasattr(err, "add_note"):  # Python 3.11+
            err.add_note(
                f"(raised by the model while {_WHO} ran it on the example inputs, with torch "
                "computing the TVM ops)"
            )
        raise
    return found.specs


def split_example_inputs(example_inputs) -> tuple[tuple, dict]:
    """``convert``'s ``example_inputs`` as call arguments: a tuple is the positional
    arguments, a dict the keyword ones, anything else (a tensor) the one argument."""
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, dict):
        return (), example_inputs
    return (example_inputs,), {}
