"""The on-disk kernel cache: keys, layout, locking, atomic writes, corruption recovery.

Layout: ``<cache dir>/kernels/<kernel name>-<key hash>.so`` plus a ``.json`` beside it holding
the full key, the file's SHA-256 and size. A kernel is trusted only if its ``.json`` exists and
the hash matches, so a truncated or corrupt file (a crash mid-write on another filesystem,
a disk error, a hand edit) is detected, reported and rebuilt rather than loaded.

Build protocol (as in flashinfer's JIT): try to load; else take a file lock on the kernel,
try to load again (another process may have built it meanwhile), have a compile worker
(``build_worker.py``) build the library into a temporary file, rename it into place (atomic),
write the ``.json`` last, release the lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from filelock import FileLock

from .. import schedules
from ..config import (
    ENV_CACHE_DIR,
    ENV_NO_COMPILE,
    compile_forbidden,
    dist_version,
    kernels_dir,
)
from ..schedules import cuda as cuda_schedules
from ..target import cuda_arch, device_key
from . import build_worker
from .cache_trust import (
    PRIVATE_FILE_MODE,
    make_private_dir,
    untrusted_dir,
    untrusted_file,
)
from .loader import load_kernel_file
from .records import tuned_key

LOCK_TIMEOUT_S = 900  # longest wait for another process's build of the same kernel


class KernelNotCachedError(RuntimeError):
    """A kernel is missing from the cache while compiling is forbidden."""


def full_key(spec) -> dict:
    """Everything that changes the binary: the spec, target, TVM and schedule versions, and
    the kept tuning record if any (``records.tuned_key``: a tuned build never collides with the
    hand one, and a re-tuned kernel is rebuilt)."""
    key = {
        **spec.key(),
        "target": device_key(spec.device),
        "tvm": dist_version("apache-tvm"),
        "schedule_version": schedules.version(spec.family, spec.device),
    }
    tuned = tuned_key(spec)
    if tuned is not None:  # absent when untuned: hand kernels keep their existing keys
        key["tuned"] = tuned
    if spec.family == "gemm" and spec.device == "cuda":
        # (the switches TVM_GEMM_CUDA_FORCE_WMMA / TVM_GEMM_CUDA_WGMMA change it: their
        # kernels stay apart)
        key["schedule"] = cuda_schedules.schedule_kind(spec, key["target"].removeprefix("cuda-"))
    return key


def kernel_path(spec) -> Path:
    digest = hashlib.sha256(json.dumps(full_key(spec), sort_keys=True).encode()).hexdigest()
    return kernels_dir() / f"{spec.name()}-{digest[:16]}.so"


def meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_meta(path: Path) -> dict | None:
    """The ``.json`` beside kernel ``path``, or None if missing or not a JSON object."""
    try:
        meta = json.loads(meta_path(path).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_intact(path: Path) -> bool:
    """True if ``path`` is a complete cached kernel (its recorded hash matches)."""
    meta = read_meta(path)
    if meta is None or not path.is_file():
        return False
    try:
        return path.stat().st_size == meta.get("size") and _sha256(path) == meta.get("sha256")
    except OSError:
        return False


def _warn(message: str) -> None:
    warnings.warn(f"torch_tvm_gemm: {message}", RuntimeWarning, stacklevel=4)


def _load_cached(path: Path, name: str, device: str = "cpu") -> Any | None:
    """The kernel function if ``path`` holds an intact, trusted cached kernel, else None
    (then it is built anew). Safe against a concurrent ``clear``/``prune``: a file removed
    between the checks and the load reads as a miss."""
    meta = meta_path(path)
    if not os.path.lexists(path) and not os.path.lexists(meta):
        return None
    problem = untrusted_file(path) or untrusted_file(meta)
    if problem is not None:
        _warn(f"not loading cached kernel {path}: {problem}; rebuilding it")
        _remove(path)
        return None
    if not is_intact(path):
        # A .json without its library is what a concurrent build (the .json goes in
        # first: _export), clear or prune leaves for a moment: a plain miss. Anything
        # else is damage.
        if os.path.lexists(path):
            _warn(f"cached kernel {path} is corrupt or incomplete; rebuilding it")
            _remove(path)
        return None
    try:
        os.utime(path)  # last use, for pruning; may fail on a read-only cache
    except OSError:
        pass
    try:
        return load_kernel_file(path, name, device)
    except RuntimeError:
        if not is_intact(path):  # removed or replaced while loading: a miss
            return None
        raise


def unlink_any(p: Path) -> None:
    """Remove a file, link or (planted) directory at ``p``; nothing there is fine."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _remove(path: Path) -> None:
    for p in (path, meta_path(path)):
        try:
            unlink_any(p)
        except OSError as err:  # read-only cache: nothing we can do but not use it
            _warn(f"cannot remove {p}: {err}")


def _temp_file(final: Path) -> Path:
    """A fresh temporary file beside ``final``, named ``<final name>.<random>.tmp``: the
    kernel it belongs to is the part of its name before the first dot (see ``kernel_stem``)."""
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.name + ".", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def kernel_stem(p: Path) -> str:
    """The kernel a cache file belongs to: ``<name>-<hash>`` of its ``.so``, ``.json``,
    ``.so.lock`` and temporary files (kernel names hold no dots)."""
    return p.name.split(".", 1)[0]


def _remove_leftovers(path: Path) -> None:
    """Temporary files of kernel ``path`` left by a killed process. Call with its lock
    held: then no other process is writing them."""
    # (Every name that starts with the stem is this kernel's: stems end in a fixed-length
    # hash. The glob also takes the older "<stem><random>.so.tmp" names.)
    for tmp in path.parent.glob(f"{path.stem}*.tmp"):
        tmp.unlink(missing_ok=True)


def _sync(path: Path) -> None:
    """Flush ``path`` to its disk: a full disk can refuse blocks only at this point."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_complete_elf(path: Path) -> None:
    """Raise OSError unless ``path`` is a whole ELF file: its section header table, which
    linkers write last, must lie inside the file (a full disk can leave a truncated one)."""
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # (ELFCLASS64)
        raise OSError(f"{path} is not a complete 64-bit ELF library ({size} bytes)")
    order = "<" if head[5] == 1 else ">"
    (shoff,) = struct.unpack_from(order + "Q", head, 0x28)
    shentsize, shnum = struct.unpack_from(order + "HH", head, 0x3A)
    if shoff + shentsize * shnum > size:
        raise OSError(f"{path} is truncated ({size} bytes, its headers end at {shoff})")


def _export(path: Path, spec) -> None:
    """Build the kernel (in a compile worker) and write it and its ``.json`` into the cache;
    only a complete, flushed library is renamed into place, after its ``.json``. Raises on
    failure (a full disk), leaving nothing behind."""
    tmp = _temp_file(path)
    try:
        seconds = build_worker.build(spec, tmp, _arch(spec))  # a worker writes the library
        os.chmod(tmp, PRIVATE_FILE_MODE)  # (the linker created it with the umask's mode)
        _check_complete_elf(tmp)
        _sync(tmp)
        meta = {
            "key": full_key(spec),
            "name": spec.name(),
            "sha256": _sha256(tmp),
            "size": tmp.stat().st_size,
            "build_seconds": round(seconds, 3),
        }
        # The .json first: a process that finds the library (looking without the lock)
        # must find its .json too, else it reads the library as damaged and removes it
        # while this one is about to load it (two test workers did: one warned "corrupt",
        # the other's load found no file).
        _atomic_write_text(meta_path(path), json.dumps(meta, indent=1, sort_keys=True))
        try:
            os.replace(tmp, path)
        except BaseException:
            meta_path(path).unlink(missing_ok=True)
            raise
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = _temp_file(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _writable(directory: Path) -> bool:
    try:
        make_private_dir(directory)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def _arch(spec) -> str | None:
    """The GPU arch a CUDA kernel is built for (this process's GPU, as in its key)."""
    return cuda_arch() if spec.device == "cuda" else None


def _in_memory(spec) -> Any:
    """``spec``'s kernel, not cached: built into a private temporary dir and loaded from
    there (the library can go once loaded: the loaded copy stays mapped)."""
    with tempfile.TemporaryDirectory(prefix="tvm_gemm_") as tmp:
        path = os.path.join(tmp, spec.name() + ".so")
        build_worker.build(spec, path, _arch(spec))
        return load_kernel_file(path, spec.name(), spec.device)


LOW_SPACE_BYTES = 16 << 20  # less free space than this in the cache: a build may not fit


def _disk_trouble(err: Exception, directory: Path) -> bool:
    """Whether building into the cache failed in a way a private build may not (a full or
    size-limited disk): an OSError, a worker that exited (LLVM ends the process on an I/O
    failure), or any error while the cache's disk is (nearly) full (the linker's failure
    arrives as TVM's RuntimeError). A worker killed by a signal (out of memory, a kill) is
    not retried."""
    if isinstance(err, build_worker.KernelBuildError) and err.exit_code is not None:
        return err.exit_code > 0
    if isinstance(err, OSError):
        return True
    try:
        return shutil.disk_usage(directory).free < LOW_SPACE_BYTES
    except OSError:
        return True


def load_or_build(spec) -> Any:
    """The callable kernel for ``spec``: from the cache, or built (once) and cached.

    A cache that cannot be used (read-only, not private to this user, full) gives a
    warning and a kernel built in memory; a concurrent ``cache clear``/``prune`` reads as
    a miss (the kernel is rebuilt).
    """
    path = kernel_path(spec)
    writable = _writable(path.parent)
    problem = untrusted_dir(path.parent.parent) or untrusted_dir(path.parent)
    if problem is None:
        fn = _load_cached(path, spec.name(), spec.device)
        if fn is not None:
            return fn
    if compile_forbidden():
        raise KernelNotCachedError(
            f"torch_tvm_gemm: kernel {spec.name()} is not in the cache {kernels_dir()} and "
            f"{ENV_NO_COMPILE} forbids compiling it (build it once without {ENV_NO_COMPILE})"
        )
    if not writable:
        _warn(
            f"cache dir {path.parent} is not writable; building {spec.name()} in memory "
            f"only (set {ENV_CACHE_DIR} to a writable dir)"
        )
        return _in_memory(spec)
    if problem is not None:
        _warn(
            f"not using the kernel cache: {problem}, so others could run code in this "
            f"process; building {spec.name()} in memory only (make it private: chmod 700 "
            f"on it, or set {ENV_CACHE_DIR} to a directory of yours)"
        )
        return _in_memory(spec)
    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
        fn = _load_cached(path, spec.name(), spec.device)  # built by another process meanwhile?
        if fn is not None:
            return fn
        _remove_leftovers(path)
        try:
            _export(path, spec)
        except Exception as err:
            if not _disk_trouble(err, path.parent):
                raise
            _warn(
                f"cannot write {spec.name()} to the cache {path.parent} ({err}); using it "
                "from memory"
            )
            return _in_memory(spec)
        # Loaded under the lock: a concurrent clear or prune waits for it.
        return load_kernel_file(path, spec.name(), spec.device)
