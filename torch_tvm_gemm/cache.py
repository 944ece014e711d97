"""The on-disk kernel cache: keys, layout, locking, atomic writes, corruption recovery.

Layout: ``<cache dir>/kernels/<kernel name>-<key hash>.so`` plus a ``.json`` beside it holding
the full key, the file's SHA-256 and size. A kernel is trusted only if its ``.json`` exists and
the hash matches, so a truncated or corrupt file (a crash mid-write on another filesystem,
a disk error, a hand edit) is detected, reported and rebuilt rather than loaded.

Build protocol (as in flashinfer's JIT): try to load; else take a file lock on the kernel,
try to load again (another process may have built it meanwhile), build, write to a temporary
file, rename it into place (atomic), write the ``.json`` last, release the lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from filelock import FileLock

from . import build
from .cache_trust import (
    PRIVATE_FILE_MODE,
    make_private_dir,
    untrusted_dir,
    untrusted_file,
)
from .schedules import cuda as cuda_schedules
from .target import host_cpu

ENV_CACHE_DIR = "TVM_GEMM_CACHE_DIR"
ENV_NO_COMPILE = "TVM_GEMM_NO_COMPILE"  # "1": serve kernels from the cache only
LOCK_TIMEOUT_S = 900  # longest wait for another process's build of the same kernel


class KernelNotCachedError(RuntimeError):
    """A kernel is missing from the cache while compiling is forbidden."""


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_tvm_gemm"


def kernels_dir() -> Path:
    return cache_dir() / "kernels"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def device_key(device: str) -> str:
    if device == "cpu":
        return host_cpu().key()
    if device == "cuda":  # kernels are built for the current GPU's arch
        return f"cuda-{build.cuda_arch()}"
    return device


def full_key(spec) -> dict:
    """Everything that changes the binary: the spec, target, TVM and schedule versions, and
    the kept tuning record if any (``tune.tuned_key``: a tuned build never collides with the
    hand one, and a re-tuned kernel is rebuilt)."""
    from .tune import tuned_key

    key = {
        **spec.key(),
        "target": device_key(spec.device),
        "tvm": _version("apache-tvm"),
        "schedule_version": build.schedule_version(spec.device),
    }
    tuned = tuned_key(spec)
    if tuned is not None:  # absent when untuned: hand kernels keep their existing keys
        key["tuned"] = tuned
    if spec.family == "gemm" and spec.device == "cuda" and cuda_schedules.forced_wmma():
        key["forced_schedule"] = "wmma"  # a debugging switch's kernels stay apart
    return key


def kernel_path(spec) -> Path:
    digest = hashlib.sha256(json.dumps(full_key(spec), sort_keys=True).encode()).hexdigest()
    return kernels_dir() / f"{spec.name()}-{digest[:16]}.so"


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_meta(path: Path) -> dict | None:
    """The ``.json`` beside kernel ``path``, or None if missing or not a JSON object."""
    try:
        meta = json.loads(_meta_path(path).read_text())
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
    from .runtime import load_kernel_file

    meta = _meta_path(path)
    if not os.path.lexists(path) and not os.path.lexists(meta):
        return None
    problem = untrusted_file(path) or untrusted_file(meta)
    if problem is not None:
        _warn(f"not loading cached kernel {path}: {problem}; rebuilding it")
        _remove(path)
        return None
    if not is_intact(path):
        # A .json without its library is what a concurrent clear or prune leaves for a
        # moment (the library goes first): a plain miss. Anything else is damage.
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


def _unlink(p: Path) -> None:
    """Remove a file, link or (planted) directory at ``p``; nothing there is fine."""
    import shutil

    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _remove(path: Path) -> None:
    for p in (path, _meta_path(path)):
        try:
            _unlink(p)
        except OSError as err:  # read-only cache: nothing we can do but not use it
            _warn(f"cannot remove {p}: {err}")


def _temp_file(final: Path) -> Path:
    """A fresh temporary file beside ``final``, named ``<final name>.<random>.tmp``: the
    kernel it belongs to is the part of its name before the first dot (see ``_stem``)."""
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.name + ".", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def _stem(p: Path) -> str:
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


def _export(executable: Any, path: Path, spec, seconds: float) -> None:
    """Write the kernel and its ``.json`` into the cache; only a complete, flushed library
    is renamed into place. Raises on failure (a full disk), leaving nothing behind."""
    tmp = _temp_file(path)
    try:
        executable.export_library(str(tmp))
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
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    try:
        _atomic_write_text(_meta_path(path), json.dumps(meta, indent=1, sort_keys=True))
    except BaseException:
        path.unlink(missing_ok=True)  # a kernel without its .json would read as corrupt
        raise


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


def _in_memory(spec, executable: Any | None = None) -> Any:
    """``spec``'s kernel built (or given) in memory, not cached."""
    from .runtime import keep_alive

    if executable is None:
        executable, _ = build.compile_spec(spec)
    keep_alive(executable)
    return executable["main"]


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
    if os.environ.get(ENV_NO_COMPILE, "") not in ("", "0"):
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
    from .runtime import load_kernel_file

    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
        fn = _load_cached(path, spec.name(), spec.device)  # built by another process meanwhile?
        if fn is not None:
            return fn
        _remove_leftovers(path)
        executable, seconds = build.compile_spec(spec)
        try:
            _export(executable, path, spec, seconds)
        except Exception as err:  # e.g. a full disk: the kernel still works from memory
            _warn(
                f"cannot write {spec.name()} to the cache {path.parent} ({err}); using it from memory"
            )
            return _in_memory(spec, executable)
        # Loaded under the lock: a concurrent clear or prune waits for it.
        return load_kernel_file(path, spec.name(), spec.device)


# --- management: list, prune, clear, export, import (``python -m torch_tvm_gemm cache``) ----


def tuning_root() -> Path:
    return cache_dir() / "tuning"


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def entries() -> list[dict]:
    """Every cached kernel: path, name, key, size (library + metadata), last use, intact."""
    out = []
    for path in sorted(kernels_dir().glob("*.so")):
        meta = read_meta(path) or {}
        try:
            stat = path.stat()
        except OSError:  # removed meanwhile (a concurrent prune)
            continue
        meta_file = _meta_path(path)
        size = stat.st_size + (meta_file.stat().st_size if meta_file.is_file() else 0)
        key = meta.get("key")
        out.append(
            {
                "path": path,
                "name": str(meta.get("name", path.stem)),
                "key": key if isinstance(key, dict) else {},
                "size": size,
                "last_use": stat.st_mtime,
                "intact": path.is_file()
                and meta.get("sha256") is not None
                and meta.get("size") == stat.st_size,
            }
        )
    return out


def total_size() -> int:
    root = cache_dir()
    return _dir_size(root) if root.exists() else 0


def _kernel_lock(stem: str) -> FileLock:
    """The build lock of kernel ``stem``, not waited for: held means in use right now."""
    return FileLock(str(kernels_dir() / f"{stem}.so.lock"), timeout=0)


def _remove_kernel(stem: str) -> int | None:
    """Remove the files of kernel ``stem`` (library, metadata, leftover temporary files;
    returns how many) unless another process holds its lock (building it): then None."""
    lock = _kernel_lock(stem)
    try:
        with lock:
            files = [p for p in kernels_dir().glob(f"{stem}*") if _stem(p) == stem]
            removed = 0
            for p in files:
                if not p.name.endswith(".lock"):
                    _unlink(p)
                    removed += 1
    except TimeoutError:  # (filelock.Timeout)
        return None
    # The (empty) lock file stays: removing it while another process waits on it would let
    # a third one lock a new file of the same name and build beside the waiter.
    return removed


def prune(max_bytes: int) -> list[Path]:
    """Remove least-recently-used kernels until the cache holds at most ``max_bytes``.

    Tuning records count towards the size but are not removed: they cost minutes to hours
    of measurement, a kernel only seconds of compiling. A kernel being built or loaded by
    another process (its lock held) is skipped.
    """
    removed = []
    size = total_size()
    for entry in sorted(entries(), key=lambda e: e["last_use"]):
        if size <= max_bytes:
            break
        path = entry["path"]
        if _remove_kernel(path.stem) is None:
            continue
        size -= entry["size"]
        removed.append(path)
    return removed


def clear(tuning: bool = True) -> tuple[int, int]:
    """Remove every cached kernel (and the tuning records if ``tuning``). A kernel that
    another process is building or loading right now is left alone. Returns (files
    removed, kernels left because they were in use)."""
    import shutil

    count = busy = 0
    root = kernels_dir()
    stems = sorted({_stem(p) for p in root.iterdir()}) if root.is_dir() else []
    for stem in stems:
        removed = _remove_kernel(stem)
        if removed is None:
            busy += 1
        else:
            count += removed
    if tuning and tuning_root().exists():
        count += sum(1 for p in tuning_root().rglob("*") if p.is_file())
        shutil.rmtree(tuning_root())
    return count, busy


def _portable(path: Path) -> bool:
    """What travels in an export: libraries, metadata, databases; not locks or logs."""
    return not (path.suffix in (".lock", ".tmp") or "logs" in path.parts or path.name == "lock")


def export_cache(archive: Path) -> int:
    """Write kernels and tuning records to a .tar.gz; returns the number of files."""
    import tarfile

    root = cache_dir()
    files = [
        p
        for sub in (kernels_dir(), tuning_root())
        if sub.exists()
        for p in sorted(sub.rglob("*"))
        if p.is_file() and not p.is_symlink() and _portable(p.relative_to(root))
    ]
    with tarfile.open(archive, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(root)))
    return len(files)


class CacheImportError(ValueError):
    """An archive that ``import_cache`` refuses as a whole (nothing of it is imported)."""


_IMPORT_FOLDERS = ("kernels", "tuning")


def _member_problem(member) -> str | None:
    """Why an archive member must not be unpacked at all, or None."""
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts:
        return "a path outside the cache"
    if not (member.isfile() or member.isdir()):
        return "not a regular file or directory (a link or device)"
    return None


def import_cache(archive: Path, force: bool = False) -> tuple[int, list[str]]:
    """Unpack an exported cache into this one; returns (files added, what was skipped).

    Importing means trusting the archive's code: its kernels are loaded and run by every
    process that uses this cache. Only regular files under ``kernels/`` and ``tuning/`` are
    taken (others are skipped and listed); an archive holding a link, a device, an absolute
    path or ``..`` is refused with ``CacheImportError`` and nothing of it is imported. Kernels
    built for another target are skipped (they would not run here) unless ``force``. The
    files are unpacked into a temporary folder first and moved into place once all are out.
    """
    import shutil
    import tarfile

    root = cache_dir()
    here = device_key("cpu")
    skipped = []
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            problem = _member_problem(m)
            if problem is not None:
                raise CacheImportError(
                    f"torch_tvm_gemm: refusing to import {archive}: member {m.name!r} is "
                    f"{problem}; nothing was imported"
                )
        files = [m for m in members if m.isfile()]
        foreign = _foreign_kernels(tar, files, here)
        wanted = []
        for m in files:
            parts = PurePosixPath(m.name).parts
            if parts[0] not in _IMPORT_FOLDERS or (parts[0] == "kernels" and len(parts) != 2):
                skipped.append(f"{m.name} (not a kernel or tuning record)")
                continue
            stem = _stem(Path(m.name))
            if parts[0] == "kernels" and stem in foreign and not force:
                if m.name.endswith(".so"):
                    skipped.append(f"{stem} (built for {foreign[stem]}, this CPU is {here})")
                continue
            wanted.append(m)
        make_private_dir(kernels_dir())
        staging = Path(tempfile.mkdtemp(dir=root, prefix=".import-"))
        try:
            for m in wanted:  # ("data": no absolute paths or links; group/other write bits off)
                tar.extract(m, staging, filter="data")
            for m in wanted:
                dest = root / m.name
                make_private_dir(dest.parent)
                os.chmod(staging / m.name, PRIVATE_FILE_MODE)
                os.replace(staging / m.name, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return len(wanted), skipped


def _foreign_kernels(tar, members, here: str) -> dict[str, str]:
    """Kernel stems whose metadata names a CPU target other than ``here``."""
    foreign = {}
    for m in members:
        if m.name.startswith("kernels/") and m.name.endswith(".json"):
            try:
                key = json.loads(tar.extractfile(m).read()).get("key", {})
                target = key.get("target")
            except (ValueError, AttributeError):
                continue
            if key.get("device", "cpu") == "cpu" and target not in (None, here):
                foreign[_stem(Path(m.name))] = target
    return foreign
