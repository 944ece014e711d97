"""Variants whose kernel is chosen by a measurement on this machine, not by a fixed rule.

"swap2" (``schedules/cpu.py``: a float32 vocabulary-sized Linear, N >= 16384, at M = 120..128)
has two correct kernels: the swap kernel over two panels of x (the weight read in place) and
the packed kernel (the weight packed per call). Which is faster depends on the machine: on
one Intel Xeon the swap kernel won by 3-12% (GPT-2's lm_head, 50257 x 768: +7.6% for the
whole 4-layer GPT-2 at batch 1), on another of the same family (2.0 GHz) it lost by 15-20%.
So at the first use of each such spec in a process both kernels are loaded (or built), timed
in turn on inputs of that shape, and the faster one serves the spec from then on. The packed
kernel keeps the spec unless the swap kernel is ahead by more than ``MARGIN`` (timing noise).
Both compute each output as the same sum in the same order. A process that may not compile
(``TVM_GEMM_NO_COMPILE``) takes whichever of the two the cache holds.

``TVM_GEMM_SWAP2``: ``auto`` (default) measures (weights up to ``MAX_MEASURED_BYTES``; larger
ones keep the packed kernel); ``1`` always takes the swap kernel, ``0`` the packed one (tests,
or a machine too busy to measure on).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

ENV_SWAP2 = "TVM_GEMM_SWAP2"
MEASURED_VARIANTS = ("swap2",)
MARGIN = 0.02  # the swap kernel must be this much faster (fraction of the packed kernel's time)
ROUNDS = 10  # timing rounds, the two kernels in turn; the best round of each counts
ROUND_SECONDS = 2e-3  # each round calls a kernel at least this long
MEASURE_SECONDS, MIN_ROUNDS = 0.3, 3  # fewer rounds for long calls (a 100 ms product: 3)
RING_BYTES, RING_MAX = 32 << 20, 8  # the weights cycled through while timing (see _time_pair)
# The timing allocates a weight of the spec's shape; past this size (fp32: LLaMA-7B's 32000 x
# 4096 head, 0.5 GB, where the swap kernel gained 3-4%) the packed kernel serves unmeasured.
MAX_MEASURED_BYTES = 256 << 20
_choices: dict[Any, str] = {}  # spec -> the variant whose kernel serves it (for tests, reports)


def measured(spec) -> bool:
    """Whether ``spec``'s kernel is chosen by a measurement (a GEMM spec of such a variant)."""
    return getattr(spec, "variant", None) in MEASURED_VARIANTS


def with_candidates(specs) -> list:
    """``specs`` with every candidate kernel's spec of each, once, in order."""
    return list(dict.fromkeys(c for spec in specs for c in candidates(spec)))


def candidates(spec) -> list:
    """The specs whose kernels serve ``spec``: the spec itself, and for a measured variant the
    packed kernel's spec too (``precompile`` builds both)."""
    if measured(spec):
        return [spec, dataclasses.replace(spec, variant="gemm")]
    return [spec]


def choose(spec, load: Callable[[Any], Any], get_kernel: Callable[[Any], Any]) -> Any:
    """The kernel for a measured-variant ``spec``: ``load(spec)`` gives its own kernel,
    ``get_kernel`` the packed one's."""
    setting = os.environ.get(ENV_SWAP2, "auto").strip().lower() or "auto"
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"tvm_gemm: {ENV_SWAP2} must be 'auto', '0' or '1', got {setting!r}")
    packed_spec = dataclasses.replace(spec, variant="gemm")
    if setting == "0":
        fn, variant = get_kernel(packed_spec), "gemm"
    elif setting == "1":
        fn, variant = load(spec), spec.variant
    elif spec.n * spec.k * 4 > MAX_MEASURED_BYTES:  # (timing needs a weight of its own)
        fn, variant = get_kernel(packed_spec), "gemm"
    else:
        own, packed = _cached(load, spec), _cached(get_kernel, packed_spec)
        if own is None and packed is None:
            load(spec)  # raises: neither kernel is in the cache
        if own is None or packed is None:  # a cache-only process: the one it has
            fn, variant = (own, spec.variant) if packed is None else (packed, "gemm")
        else:
            own_s, packed_s = _time_pair(spec, own, packed)
            faster = own_s < (1 - MARGIN) * packed_s
            fn, variant = (own, spec.variant) if faster else (packed, "gemm")
    _choices[spec] = variant
    return fn


def _cached(load: Callable[[Any], Any], spec) -> Any:
    """``load(spec)``, or None where kernels come from the cache only
    (``TVM_GEMM_NO_COMPILE``) and this one is not there."""
    from .cache import KernelNotCachedError

    try:
        return load(spec)
    except KernelNotCachedError:
        return None


def chosen_variant(spec) -> str | None:
    """The variant whose kernel serves ``spec`` in this process (None: not chosen yet)."""
    return _choices.get(spec)


def forget() -> None:
    """Drop the choices made (with the kernel table: the next use measures again)."""
    _choices.clear()


def _time_pair(spec, first, second) -> tuple[float, float]:
    """Best seconds per call of each kernel on inputs of ``spec``'s shape (M = the variant's
    largest), timed in alternating rounds."""
    import torch

    from ..measure import mean_call, median_call, time_interleaved
    from ..schedules.cpu import SWAP2_MAX_M

    m, dtype = SWAP2_MAX_M, getattr(torch, spec.dtype)
    # In a model each weight comes from L3 or memory, not from the L2 where the last call
    # left it, and the swap kernel reads it in place: the calls cycle through weights of
    # RING_BYTES or more (docs/inference-shapes.md, section 19: on one hot weight it won by
    # 3-10% at BERT's widths, in the model it lost by 2-11%). Filled, not zeros: an
    # untouched zero page reads from the cache.
    weight_bytes = spec.n * spec.k * torch.finfo(dtype).bits // 8
    ring = max(1, min(RING_MAX, -(-RING_BYTES // weight_bytes)))
    x = torch.full((m, spec.k), 0.5, dtype=dtype)
    weights = itertools.cycle(
        [torch.full((spec.n, spec.k), 0.25, dtype=dtype) for _ in range(ring)]
    )
    bias = [torch.full((spec.n,), 1.0, dtype=dtype)] if spec.bias else []
    out = torch.empty(m, spec.n, dtype=dtype)
    calls = [lambda fn=fn: fn(x, next(weights), *bias, out) for fn in (first, second)]
    once = max(median_call(call, calls=1) for call in calls)  # (after a warm-up call each)
    per_round = max(ring, int(ROUND_SECONDS / max(once, 1e-9)) + 1)
    rounds = max(MIN_ROUNDS, min(ROUNDS, int(MEASURE_SECONDS / (2 * per_round * once))))
    first_s, second_s = time_interleaved(
        calls, rounds, sample=lambda call: mean_call(call, per_round), warm_up=False
    )
    return first_s, second_s
