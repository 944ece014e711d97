"""Variants whose kernel is chosen by a measurement on this machine, not by a fixed rule.

The swap variants (``schedules/cpu.py``: a float32 Linear whose M is within a few rows of one
panel of 32, 48 or 64 rows of x, "swap32" / "swap48" / "swap", or of two, "swap2", at a
vocabulary-sized N) each have two correct kernels: the swap kernel (x packed, the weight read
in place) and the packed kernel (the weight packed per call). Which is faster depends on the
machine and on the weight's shape: on one Intel Xeon the swap kernels won at every shape
measured, on another they lost wherever K <= 2048 and won by 20-80% at K >= 3072 (the
swap2 kernel won by 3-12% on GPT-2's lm_head on one, lost by 15-20% on the other). So at the
first use of each such spec in a process both kernels are loaded (or built), timed in turn on
inputs of that shape (M in the middle of the variant's rows), and the faster one serves the
spec from then on. The packed kernel keeps the spec unless the swap kernel is ahead by more
than ``MARGIN`` (timing noise). Both compute each output as the same sum in the same order. A
process that may not compile (``TVM_GEMM_NO_COMPILE``) takes whichever of the two the cache
holds.

``TVM_GEMM_SWAP``: ``auto`` (default) measures (weights up to ``MAX_MEASURED_BYTES``; larger
ones get ``UNTIMED``'s kernel); ``1`` always takes the swap kernel, ``0`` the packed one
(tests, or a machine too busy to measure on).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

ENV_SWAP = "TVM_GEMM_SWAP"
MEASURED_VARIANTS = ("swap32", "swap48", "swap", "swap2")
MARGIN = 0.02  # the swap kernel must be this much faster (fraction of the packed kernel's time)
ROUNDS = 10  # timing rounds, the two kernels in turn; the best round of each counts
ROUND_SECONDS = 2e-3  # each round calls a kernel at least this long
MEASURE_SECONDS, MIN_ROUNDS = 0.3, 3  # fewer rounds for long calls (a 100 ms product: 3)
RING_BYTES, RING_MAX = 32 << 20, 8  # the weights cycled through while timing (see _time_pair)
# The timing allocates a weight of the spec's shape; past this size (fp32: LLaMA-7B's 32000 x
# 4096 head, 0.5 GB) a kernel serves unmeasured: the packed one for two panels of x (they
# lost by 15-20% at vocabulary widths on one machine and gained only 3-4% at that head on
# another), the swap kernel for one panel (at large weights it won on every machine measured:
# 4096 x 4096, M = 32, 1.7-1.8x F.linear against 1.0-1.1x).
MAX_MEASURED_BYTES = 256 << 20
UNTIMED = {"swap2": "gemm"}  # variant -> the kernel past MAX_MEASURED_BYTES (else its own)
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
    setting = os.environ.get(ENV_SWAP, "auto").strip().lower() or "auto"
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"tvm_gemm: {ENV_SWAP} must be 'auto', '0' or '1', got {setting!r}")
    packed_spec = dataclasses.replace(spec, variant="gemm")
    if setting == "auto" and spec.n * spec.k * 4 > MAX_MEASURED_BYTES:
        setting = "0" if UNTIMED.get(spec.variant, spec.variant) == "gemm" else "1"
    if setting == "0":
        fn, variant = get_kernel(packed_spec), "gemm"
    elif setting == "1":
        fn, variant = load(spec), spec.variant
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
    """Best seconds per call of each kernel on inputs of ``spec``'s shape (M in the middle
    of the variant's rows: the swap kernel's time is the same for all of them, the packed
    kernel's grows with M), timed in alternating rounds."""
    import torch

    from ..measure import mean_call, median_call, time_interleaved
    from ..schedules.cpu import swap_rows

    m, dtype = sum(swap_rows(spec.variant)) // 2, getattr(torch, spec.dtype)
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
