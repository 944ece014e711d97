"""Running compiled kernels with the TVM *runtime* only.

A kernel exported by TVM calls a few runtime services (its thread pool through
``TVMBackendParallelLaunch``, workspace allocation) that live in ``libtvm_runtime.so``, a
3 MB library shipped inside the apache-tvm wheel beside the 259 MB compiler. We load that
library alone (``RTLD_GLOBAL``, so that kernels resolve against it) and load kernels with
``tvm_ffi.load_module``: a process whose kernels are all cached never imports ``tvm``.
Once a CPU kernel is loaded, its parallel launcher is pointed at torch's OpenMP pool (see
``_launch_on_torch_pool`` and csrc/parallel_launch.cpp).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

import torch
import tvm_ffi

ENV_RUNTIME_LIB_DIR = "TVM_GEMM_RUNTIME_LIB_DIR"  # folder with libtvm_runtime*.so (no tvm)
ENV_TVM_POOL = "TVM_GEMM_TVM_POOL"  # 1: CPU kernels keep TVM's own thread pool (not torch's)

_lock = threading.RLock()
_alive: list[Any] = []  # modules / executables whose functions we hand out
_runtime_loaded = False
_cuda_runtime_loaded = False


def tvm_lib_dir() -> Path:
    """Where ``libtvm_runtime*.so`` are: ``$TVM_GEMM_RUNTIME_LIB_DIR``, else the apache-tvm
    wheel's ``lib`` folder (found without importing ``tvm``)."""
    if os.environ.get(ENV_RUNTIME_LIB_DIR):
        return Path(os.environ[ENV_RUNTIME_LIB_DIR])
    spec = importlib.util.find_spec("tvm")
    if spec is None or spec.origin is None:
        raise ImportError(
            "torch_tvm_gemm: the TVM runtime was not found: pip install apache-tvm, or set "
            f"{ENV_RUNTIME_LIB_DIR} to a folder holding libtvm_runtime.so (and "
            "libtvm_runtime_cuda.so for CUDA) copied from the apache-tvm wheel"
        )
    return Path(spec.origin).parent / "lib"


def ensure_runtime(device: str = "cpu") -> None:
    """Load ``libtvm_runtime.so`` once, globally, before the first kernel; for CUDA kernels
    also ``libtvm_runtime_cuda.so`` (it registers the loader of CUDA device modules)."""
    global _runtime_loaded, _cuda_runtime_loaded
    if _runtime_loaded and (device != "cuda" or _cuda_runtime_loaded):
        return
    with _lock:
        if not _runtime_loaded:
            # TVM sizes its pool once, from TVM_NUM_THREADS, else half the hardware threads
            # on x86 (it assumes hyper-threading): 1 thread on a 2-core VM. Size it to the
            # cores we may run on; sync_threads() then uses as many as torch does.
            os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
            # TVM's pool shares the cores with torch's OpenMP pool, and the two alternate in a
            # model (TVM conv, torch max_pool, ...). Pinned TVM workers that spin after each
            # job starve torch's threads: a small CNN with fused convs ran 4x *slower* than
            # unfused until its workers were left unpinned and spun only briefly (measured:
            # 12.9 ms -> 2.3-2.6 ms, against 3.2 ms for the unfused model).
            os.environ.setdefault("TVM_BIND_THREADS", "0")
            os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "10000")
            ctypes.CDLL(str(tvm_lib_dir() / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
            _runtime_loaded = True
        if device == "cuda" and not _cuda_runtime_loaded:
            _load_cuda_runtime()
            _cuda_runtime_loaded = True


def _load_cuda_runtime() -> None:
    # libtvm_runtime_cuda.so needs libcudart.so.13; a pip-installed torch keeps it in its
    # nvidia/cu13/lib (or cuda_runtime/lib) folder, off the loader's path: load it first.
    import torch  # noqa: F401 (its CUDA libraries, when it has them, load with it)

    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13/lib", "cuda_runtime/lib"):
                for lib in sorted(Path(base, sub).glob("libcudart.so.*")):
                    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                    break
    except ImportError:
        pass
    path = tvm_lib_dir() / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise RuntimeError(
            f"torch_tvm_gemm: cannot load the TVM CUDA runtime {path}: {err} (it needs the "
            "CUDA driver and libcudart.so.13)"
        ) from err


def sync_threads() -> None:
    """Give TVM's thread pool as many threads as PyTorch uses (torch.set_num_threads).

    Both pools would otherwise start one thread per core each; following torch's setting
    means one knob. TVM keeps one pool per calling thread, and the C++ path configures it
    too, so the pool itself is asked (``runtime.NumThreads``, ~0.1 us) rather than a cache
    of what was last set, which went stale (seen: a tuning verdict timed on 1 thread).
    """
    n = torch.get_num_threads()
    ensure_runtime()
    if _tvm_func("runtime.NumThreads")() == n:
        return
    # With TVM_BIND_THREADS=1 (a user's choice), TVM pins the *calling* thread to a core
    # when it configures its pool. Put the caller's affinity back: else every thread that
    # torch starts later (its OpenMP pool) inherits one core, and a 2-thread torch.matmul
    # then runs both threads there (seen: 256^3 at 2 GFLOPS instead of 200).
    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    _tvm_func("runtime.config_threadpool")(1, n)  # mode 1: TVM's default ("big" cores)
    if saved is not None:
        os.sched_setaffinity(0, saved)


@functools.cache
def _tvm_func(name: str) -> Any:
    return tvm_ffi.get_global_func(name)


def keep_alive(obj: Any) -> None:
    """Keep a module alive for the life of the process (its functions point into it)."""
    _alive.append(obj)


# Each loaded kernel library costs ~5 memory maps (and ~29 KB) for the life of the process:
# its functions are handed out (to the op tables, the C++ one too), so it is never unloaded.
# Past vm.max_map_count (65530 by default) every mmap fails, torch's allocations included,
# so loading stops with a clear error while a margin of maps is left for the rest.
MAP_MARGIN_FRACTION = 0.1  # of vm.max_map_count, kept free for everything else
MAP_CHECK_EVERY = 32  # loads between two counts of this process's maps
_loaded_libraries = 0


def _max_map_count() -> int | None:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None  # not Linux: no such limit to watch


def _map_count() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def _check_map_room(name: str) -> None:
    """Raise before a kernel load would bring the process near ``vm.max_map_count``."""
    if _loaded_libraries % MAP_CHECK_EVERY:
        return
    limit = _max_map_count()
    if limit is None:
        return
    used = _map_count()
    if used > limit * (1 - MAP_MARGIN_FRACTION):
        raise RuntimeError(
            f"torch_tvm_gemm: not loading kernel {name}: this process has {used} memory maps, "
            f"near the system's limit vm.max_map_count={limit}, with {_loaded_libraries} kernel "
            "libraries loaded (~5 maps each, never unloaded). Each distinct shape (static N "
            "and K of a linear, conv geometry and input size) is a kernel: use fewer, or raise "
            "the limit (sysctl vm.max_map_count)"
        )


def load_kernel_file(path: os.PathLike, name: str, device: str = "cpu") -> Any:
    """Load an exported kernel library and return its ``main`` function."""
    global _loaded_libraries
    ensure_runtime(device)
    _check_map_room(name)
    try:
        module = tvm_ffi.load_module(str(path))
        fn = module["main"]
    except Exception as err:  # a file that passed its hash check but does not load
        raise RuntimeError(f"torch_tvm_gemm: cannot load kernel {name} from {path}: {err}") from err
    keep_alive(module)
    _loaded_libraries += 1
    if device == "cpu":
        _launch_on_torch_pool(path)
    return fn


def _launch_on_torch_pool(path: os.PathLike) -> None:
    """Point a loaded CPU kernel's parallel launcher at torch's OpenMP pool (the C++
    extension's ``parallel_launch``, csrc/parallel_launch.cpp says why). Without the extension,
    or for a kernel that synchronises its tasks with barriers (ours don't), TVM's pool stays."""
    from .. import _ext

    ext = _ext.load()
    if ext is None or os.environ.get(ENV_TVM_POOL, "") not in ("", "0"):
        return
    # The kernel library is already loaded: RTLD_NOLOAD hands back the same handle. Should
    # the loader not recognise it, the kernel keeps TVM's pool: slower beside torch, correct.
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return
    barrier = _has_symbol(lib, "__TVMBackendParallelBarrier")
    if barrier or not _has_symbol(lib, "__TVMBackendParallelLaunch"):  # no parallel loop
        return
    slot = ctypes.c_void_p.in_dll(lib, "__TVMBackendParallelLaunch")
    slot.value = _torch_pool_launcher(ext)


def _has_symbol(lib: ctypes.CDLL, name: str) -> bool:
    try:
        ctypes.c_void_p.in_dll(lib, name)
    except ValueError:
        return False
    return True


@functools.cache
def _torch_pool_launcher(ext) -> int:
    return ext.parallel_launch_address()


def parallel_launcher(path: os.PathLike) -> str | None:
    """Which pool the loaded kernel library at ``path`` runs its parallel loops on: "torch",
    "tvm", or None for a kernel without parallel loops."""
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    if not _has_symbol(lib, "__TVMBackendParallelLaunch"):
        return None
    from .. import _ext

    slot = ctypes.c_void_p.in_dll(lib, "__TVMBackendParallelLaunch")
    ext = _ext.load()
    return "torch" if ext is not None and slot.value == _torch_pool_launcher(ext) else "tvm"
