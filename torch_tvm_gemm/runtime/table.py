"""The in-memory kernel table: ``get_kernel(spec)``, the one way the ops obtain a kernel.

A hit is a dict lookup; a miss asks, in order: a loaded CUDA kernel pack (built on another
machine), the disk cache, a build. A variant measured on this machine
(``variant_choice``) gets the faster of its candidate kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..target import cuda_arch
from . import cache, pack_loader, variant_choice

_lock = threading.RLock()
_table: dict[Any, Any] = {}  # spec (CPU) or (spec, arch) (CUDA) -> kernel function
_kernel_locks: dict[Any, threading.Lock] = {}  # the same keys -> held while one is built
_clear_hooks: list[Callable[[], None]] = []  # other tables of kernel handles (the C++ one)


def get_kernel(spec) -> Any:
    """The callable kernel for ``spec``: from the table, the disk cache, or a fresh build.

    A CUDA kernel is the one for the current GPU's arch (its schedule depends on it), so
    the table holds one per (spec, arch): two GPUs of different generations each get theirs.
    """
    key = (spec, cuda_arch()) if spec.device == "cuda" else spec
    fn = _table.get(key)
    if fn is not None:
        return fn
    # One build per kernel in this process (other processes: the cache's file lock); builds
    # of different kernels, asked for by different threads, run in parallel.
    with _kernel_lock(key):
        fn = _table.get(key)
        if fn is None and spec.device == "cuda":
            fn = pack_loader.lookup(spec, key[1])  # a loaded pack first (built elsewhere)
        if fn is None and variant_choice.measured(spec):
            fn = variant_choice.choose(spec, cache.load_or_build, get_kernel)
        if fn is None:
            fn = cache.load_or_build(spec)
        with _lock:
            _table[key] = fn
    return fn


def has_kernel(spec) -> bool:
    """Whether ``spec``'s kernel is in the table now (for CUDA: the current GPU's)."""
    return ((spec, cuda_arch()) if spec.device == "cuda" else spec) in _table


def _kernel_lock(key: Any) -> threading.Lock:
    with _lock:
        return _kernel_locks.setdefault(key, threading.Lock())


def on_clear_table(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever the table is cleared (for tables that cache our functions)."""
    _clear_hooks.append(hook)


def clear_table() -> None:
    """Forget loaded kernels (tests; after clearing the disk cache)."""
    with _lock:
        _table.clear()
        variant_choice.forget()
        for hook in _clear_hooks:
            hook()
