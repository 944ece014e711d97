"""The on-disk kernel cache: keys, layout, locking, atomic writes, corruption recovery.

Layout: ``<cache dir>/kernels/<kernel name>-<key hash>.so`` plus a ``.json`` beside it holding
the full key, the file's SHA-256 and size. A kernel is trusted only if its ``.json`` exists and
the hash matches, so a truncated or corrupt file (a crash mid-write on another filesystem,
a disk error, a hand edit) is detected, reported and rebuilt rather than loaded.

Build protocol (as in flashinfer's JIT): try to load; else take a file lock on the kernel,
try to load again (another process may have built it meanwhile), have a compile worker
(``runtime/build_worker.py``) build the kernel into a temporary file, rename it into place (atomic),
write the ``.json`` last, release the lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from filelock import FileLock

from .. import schedules
from ..config import (
    ENV_CACHE_DIR,
    ENV_NO_COMPILE,
    cache_dir,
    compile_forbidden,
    dist_version,
    kernels_dir,
    tuning_root,
)
from ..schedules import cuda as cuda_schedules
from ..target import cuda_arch, device_key
from . import build_worker
from .loader import load_kernel_file
from .records import tuned_key

LOCK_TIMEOUT_S = 900  # longest wait for another process's build of the same kernel


class KernelNotCachedError(RuntimeError):
    """A kernel is missing from the cache while compiling is forbidden."""


def full_key(spec) -> dict:
    """Everything that changes the binary: the spec, target, TVM and schedule versions, and
    the kept tuning record if any (``tune.tuned_key``: a tuned build never collides with the
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
    try:
        return json.loads(_meta_path(path).read_text())
    except (OSError, ValueError):
        return None


def is_intact(path: Path) -> bool:
    """True if ``path`` is a complete cached kernel (its recorded hash matches)."""
    meta = read_meta(path)
    if meta is None or not path.exists():
        return False
    try:
        return path.stat().st_size == meta.get("size") and _sha256(path) == meta.get("sha256")
    except OSError:
        return False


def _load_cached(path: Path, name: str, device: str = "cpu") -> Any | None:
    """The kernel function if ``path`` holds an intact cached kernel, else None."""
    if not path.exists() and not _meta_path(path).exists():
        return None
    if not is_intact(path):
        warnings.warn(
            f"torch_tvm_gemm: cached kernel {path} is corrupt or incomplete; rebuilding it",
            RuntimeWarning,
            stacklevel=3,
        )
        _remove(path)
        return None
    try:
        os.utime(path)  # last use, for pruning; may fail on a read-only cache
    except OSError:
        pass
    return load_kernel_file(path, name, device)


def _remove(path: Path) -> None:
    for p in (path, _meta_path(path)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:  # read-only cache: nothing we can do but not use it
            warnings.warn(f"torch_tvm_gemm: cannot remove {p}: {err}", RuntimeWarning, stacklevel=4)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _export(path: Path, spec) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".so.tmp")
    os.close(fd)
    try:
        seconds = build_worker.build(spec, tmp, _arch(spec))  # a worker writes the library
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    meta = {
        "key": full_key(spec),
        "name": spec.name(),
        "sha256": _sha256(path),
        "size": path.stat().st_size,
        "build_seconds": round(seconds, 3),
    }
    _atomic_write_text(_meta_path(path), json.dumps(meta, indent=1, sort_keys=True))


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def _arch(spec) -> str | None:
    """The GPU arch a CUDA kernel is built for (this process's GPU, as in its key)."""
    return cuda_arch() if spec.device == "cuda" else None


def _build_private(spec) -> Any:
    """Build ``spec`` into a private temporary dir and load it from there (the library can
    go once loaded: the loaded copy stays mapped)."""
    with tempfile.TemporaryDirectory(prefix="tvm_gemm_") as tmp:
        path = os.path.join(tmp, spec.name() + ".so")
        build_worker.build(spec, path, _arch(spec))
        return load_kernel_file(path, spec.name(), spec.device)


def load_or_build(spec) -> Any:
    """The callable kernel for ``spec``: from the cache, or built (once) and cached."""
    path = kernel_path(spec)
    fn = _load_cached(path, spec.name(), spec.device)
    if fn is not None:
        return fn
    if compile_forbidden():
        raise KernelNotCachedError(
            f"torch_tvm_gemm: kernel {spec.name()} is not in the cache {kernels_dir()} and "
            f"{ENV_NO_COMPILE} forbids compiling it (build it once without {ENV_NO_COMPILE})"
        )
    if not _writable(path.parent):
        warnings.warn(
            f"torch_tvm_gemm: cache dir {path.parent} is not writable; building "
            f"{spec.name()} in memory only (set {ENV_CACHE_DIR} to a writable dir)",
            RuntimeWarning,
            stacklevel=2,
        )
        return _build_private(spec)
    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
        fn = _load_cached(path, spec.name(), spec.device)  # built by another process meanwhile?
        if fn is not None:
            return fn
        _export(path, spec)
    return load_kernel_file(path, spec.name(), spec.device)


# --- management: list, prune, clear, export, import (``python -m torch_tvm_gemm cache``) ----


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
        size = stat.st_size + (_meta_path(path).stat().st_size if _meta_path(path).exists() else 0)
        out.append(
            {
                "path": path,
                "name": meta.get("name", path.stem),
                "key": meta.get("key", {}),
                "size": size,
                "last_use": stat.st_mtime,
                "intact": meta.get("sha256") is not None and meta.get("size") == stat.st_size,
            }
        )
    return out


def total_size() -> int:
    root = cache_dir()
    return _dir_size(root) if root.exists() else 0


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
        lock = FileLock(str(path) + ".lock", timeout=0)
        try:
            with lock:
                _remove(path)
        except TimeoutError:
            continue
        Path(str(path) + ".lock").unlink(missing_ok=True)
        size -= entry["size"]
        removed.append(path)
    return removed


def clear(tuning: bool = True) -> int:
    """Remove every cached kernel (and the tuning records if ``tuning``); files removed."""
    import shutil

    count = 0
    for path in list(kernels_dir().glob("*")) if kernels_dir().exists() else []:
        path.unlink(missing_ok=True)
        count += 1
    if tuning and tuning_root().exists():
        count += sum(1 for p in tuning_root().rglob("*") if p.is_file())
        shutil.rmtree(tuning_root())
    return count


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
        if p.is_file() and _portable(p.relative_to(root))
    ]
    with tarfile.open(archive, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(root)))
    return len(files)


def import_cache(archive: Path, force: bool = False) -> tuple[int, list[str]]:
    """Unpack an exported cache into this one. Kernels built for another target are
    skipped (they would not run here) unless ``force``; returns (files added, skipped)."""
    import tarfile

    root = cache_dir()
    here = device_key("cpu")
    added, skipped = 0, []
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        foreign = _foreign_kernels(tar, members, here)
        for member in members:
            stem = Path(member.name).with_suffix("").name
            if member.name.startswith("kernels/") and stem in foreign and not force:
                if member.name.endswith(".so"):
                    skipped.append(f"{stem} (built for {foreign[stem]}, this CPU is {here})")
                continue
            tar.extract(member, root, filter="data")  # no absolute paths or links out
            added += 1
    return added, skipped


def _foreign_kernels(tar, members, here: str) -> dict[str, str]:
    """Kernel stems whose metadata names a CPU target other than ``here``."""
    foreign = {}
    for m in members:
        if m.name.startswith("kernels/") and m.name.endswith(".json"):
            try:
                key = json.loads(tar.extractfile(m).read()).get("key", {})
            except (ValueError, AttributeError):
                continue
            if key.get("device", "cpu") == "cpu" and key.get("target") not in (None, here):
                foreign[Path(m.name).with_suffix("").name] = key.get("target")
    return foreign
