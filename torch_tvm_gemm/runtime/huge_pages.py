"""Outputs of 32 MiB or more on transparent huge pages (Linux).

glibc maps an allocation this large afresh every time (its mmap threshold stops growing at
32 MiB on 64-bit), so each call's output is first touched by the kernel itself, one 4 KiB page
fault at a time. The GEMM kernels write their output by column strips (one N panel of every
row, then the next panel), so a strip touches a thousand pages, faulting each and evicting
the zeroed pages before the next strips fill them. Measured (2 threads, Intel Xeon,
linear 768 -> 50257 at M = 1024, a language-model head): the kernel ran at 311 GFLOPS on
a reused output and 233 on a fresh one (F.linear: 276, its bias copy touching the pages in
order first); with the fresh output advised as huge pages (``madvise(MADV_HUGEPAGE)``: one
fault per 2 MiB), 281-295. Smaller outputs come from the reused heap: no change (measured).

The advice is a hint on memory the op has just allocated and hands to the caller: it changes
no value, and where the kernel does not take it (``transparent_hugepage`` set to ``never``,
another OS) nothing changes. csrc/ does the same for the outputs of its impls, with
``HUGE_OUTPUT_BYTES`` (0 where the advice is unavailable) handed over at registration.
(torch's own ``THP_MEM_ALLOC_ENABLE=1`` advises every allocation of 2 MiB or more likewise.)
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch
from torch import Tensor

HUGE_OUTPUT_BYTES = 32 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def huge_output_bytes() -> int:
    """The output size from which outputs are advised as huge pages; 0: never (no advice on
    this OS)."""
    return HUGE_OUTPUT_BYTES if _madvise() is not None else 0


def empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty(shape)``; on the CPU, from HUGE_OUTPUT_BYTES on, advised as huge pages
    before anything touches it."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.device.type == "cpu" and out.numel() * out.element_size() >= HUGE_OUTPUT_BYTES:
        advise_huge_pages(out)
    return out


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
