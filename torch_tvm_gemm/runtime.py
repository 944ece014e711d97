"""Running compiled kernels with the TVM *runtime* only, and the in-memory kernel table.

A kernel exported by TVM calls a few runtime services (its thread pool through
``TVMBackendParallelLaunch``, workspace allocation) that live in ``libtvm_runtime.so``, a
3 MB library shipped inside the apache-tvm wheel beside the 259 MB compiler. We load that
library alone (``RTLD_GLOBAL``, so that kernels resolve against it) and load kernels with
``tvm_ffi.load_module``: a process whose kernels are all cached never imports ``tvm``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import tvm_ffi

_lock = threading.RLock()
_table: dict[Any, Any] = {}  # spec -> kernel function
_alive: list[Any] = []  # modules / executables whose functions we hand out
_clear_hooks: list[Callable[[], None]] = []  # other tables of kernel handles (the C++ one)
_runtime_loaded = False
_threads = 0


def tvm_lib_dir() -> Path:
    """The apache-tvm wheel's ``lib`` folder, found without importing ``tvm``."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or spec.origin is None:
        raise ImportError("torch_tvm_gemm: apache-tvm is not installed (pip install apache-tvm)")
    return Path(spec.origin).parent / "lib"


def ensure_runtime() -> None:
    """Load ``libtvm_runtime.so`` once, globally, before the first kernel."""
    global _runtime_loaded
    if _runtime_loaded:
        return
    with _lock:
        if not _runtime_loaded:
            # TVM sizes its pool once, from TVM_NUM_THREADS, else half the hardware threads
            # on x86 (it assumes hyper-threading): 1 thread on a 2-core VM. Size it to the
            # cores we may run on; sync_threads() then uses as many as torch does.
            os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
            ctypes.CDLL(str(tvm_lib_dir() / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
            _runtime_loaded = True


def sync_threads() -> None:
    """Give TVM's thread pool as many threads as PyTorch uses (torch.set_num_threads).

    Both pools would otherwise start one thread per core each; following torch's setting
    means one knob, and neither oversubscribes the other since they never run at once.
    """
    global _threads
    n = torch.get_num_threads()
    if n != _threads:
        ensure_runtime()
        # (mode 1: bind to cores as TVM does by default; n threads)
        tvm_ffi.get_global_func("runtime.config_threadpool")(1, n)
        _threads = n


def keep_alive(obj: Any) -> None:
    """Keep a module alive for the life of the process (its functions point into it)."""
    _alive.append(obj)


def load_kernel_file(path: os.PathLike, name: str) -> Any:
    """Load an exported kernel library and return its ``main`` function."""
    ensure_runtime()
    try:
        module = tvm_ffi.load_module(str(path))
        fn = module["main"]
    except Exception as err:  # a file that passed its hash check but does not load
        raise RuntimeError(f"torch_tvm_gemm: cannot load kernel {name} from {path}: {err}") from err
    keep_alive(module)
    return fn


def get_kernel(spec) -> Any:
    """The callable kernel for ``spec``: from the table, the disk cache, or a fresh build."""
    fn = _table.get(spec)
    if fn is not None:
        return fn
    with _lock:  # one build per kernel in this process; other processes: cache.py's lock
        fn = _table.get(spec)
        if fn is None:
            from .cache import load_or_build

            fn = load_or_build(spec)
            _table[spec] = fn
    return fn


def on_clear_table(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever the table is cleared (for tables that cache our functions)."""
    _clear_hooks.append(hook)


def clear_table() -> None:
    """Forget loaded kernels (tests; after clearing the disk cache)."""
    with _lock:
        _table.clear()
        for hook in _clear_hooks:
            hook()
