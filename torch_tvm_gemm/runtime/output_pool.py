"""The ops' large CPU outputs: a pool of blocks on transparent huge pages.

An output of POOL_MIN_BYTES (2 MiB, one huge page) or more is a block of whole 2 MiB pages,
aligned on them and advised as huge pages, and when the tensor is freed its block is kept for
the next output of the same size, up to ``TVM_GEMM_OUTPUT_POOL_MB`` MiB (default 128; 0: no
block is kept). In a model's steady state the outputs then never page-fault: with at::empty
they often did, both threads of the packed GEMM faulting on every page of a fresh output
(csrc/output_pool.cpp has the measurements). ``stats()`` says what the pool holds, ``release()``
returns its kept blocks to the system (``torch_tvm_gemm.output_pool_stats`` /
``release_output_pool``).

The pool lives in the C++ extension; both impl paths and the conv ops take their outputs from
it. Without the extension, an output of HUGE_OUTPUT_BYTES or more is ``torch.empty`` advised as
huge pages: glibc maps an allocation that large afresh every time, and its first writes,
the kernels' column strips, fault one 4 KiB page at a time (linear 768 -> 50257 at M = 1024,
2 threads, Intel Xeon: 233 GFLOPS on a fresh output, 311 on a reused one, 281-295 advised).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from types import ModuleType

import torch
from torch import Tensor

from .. import _ext

ENV_POOL_MB = "TVM_GEMM_OUTPUT_POOL_MB"
DEFAULT_POOL_MB = 128
POOL_MIN_BYTES = 2 << 20
HUGE_OUTPUT_BYTES = 32 << 20  # without the extension
_NO_LIMIT = (1 << 63) - 1  # (a larger TVM_GEMM_OUTPUT_POOL_MB means the same)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def pool_limit_bytes() -> int:
    """The most bytes of freed outputs the pool keeps (``TVM_GEMM_OUTPUT_POOL_MB``)."""
    raw = os.environ.get(ENV_POOL_MB, "").strip()
    if not raw:
        return DEFAULT_POOL_MB << 20
    if not raw.isdigit():
        raise ValueError(
            f"torch_tvm_gemm: {ENV_POOL_MB} must be a whole number of MiB (0: keep no "
            f"output), got {raw!r}"
        )
    return min(int(raw) << 20, _NO_LIMIT)


@functools.cache
def configure() -> ModuleType | None:
    """The extension with its pool set up (once), or None where there is no pool."""
    ext = _ext.load() if os.name == "posix" else None
    if ext is not None:
        ext.configure_output_pool(POOL_MIN_BYTES, pool_limit_bytes())
    return ext


def empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty(shape)`` for an op's output; on the CPU, from the pool (see above)."""
    if torch.device(device).type == "cpu":
        ext = configure()
        if ext is not None:
            return ext.empty_output([int(s) for s in shape], dtype)
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.device.type == "cpu" and out.numel() * out.element_size() >= HUGE_OUTPUT_BYTES:
        advise_huge_pages(out)
    return out


def stats() -> dict[str, int]:
    """What the pool holds: ``kept_bytes`` / ``kept_blocks`` (freed outputs kept for reuse),
    ``live_bytes`` (its outputs still alive), ``min_bytes``, ``limit_bytes``; zeros without
    the extension."""
    ext = configure()
    if ext is None:
        return dict.fromkeys(
            ("kept_bytes", "kept_blocks", "live_bytes", "min_bytes", "limit_bytes"), 0
        )
    return dict(ext.output_pool_stats())


def release() -> None:
    """Return the pool's kept blocks to the system (outputs still alive are untouched)."""
    ext = configure()
    if ext is not None:
        ext.release_output_pool()


def advise_huge_pages(t: Tensor) -> None:
    """Advise the whole pages inside ``t``'s memory as huge pages (errors ignored: a hint)."""
    madvise = _madvise()
    if madvise is None:
        return
    page = mmap.PAGESIZE
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        madvise(first, last - first, _MADV_HUGEPAGE)


@functools.cache
def _madvise():
    if _MADV_HUGEPAGE is None or os.name != "posix":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
