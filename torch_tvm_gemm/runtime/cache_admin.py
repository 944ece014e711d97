"""Managing the kernel cache (``python -m torch_tvm_gemm cache``): list, size, prune,
clear, export and import. Each removal takes the kernel's lock without waiting, so a kernel
that another process is building or loading is skipped, never pulled from under it.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from filelock import FileLock

from ..config import cache_dir, kernels_dir, tuning_root
from ..target import device_key
from .cache import kernel_stem, meta_path, read_meta, unlink_any
from .cache_trust import PRIVATE_FILE_MODE, make_private_dir


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
        meta_file = meta_path(path)
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
            files = [p for p in kernels_dir().glob(f"{stem}*") if kernel_stem(p) == stem]
            removed = 0
            for p in files:
                if not p.name.endswith(".lock"):
                    unlink_any(p)
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
    count = busy = 0
    root = kernels_dir()
    stems = sorted({kernel_stem(p) for p in root.iterdir()}) if root.is_dir() else []
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
            stem = kernel_stem(Path(m.name))
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
            # (each kernel's .json before its library, as a build writes them: a process
            # that finds a library without its .json removes it as damaged)
            for m in sorted(wanted, key=lambda m: m.name.endswith(".so")):
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
                foreign[kernel_stem(Path(m.name))] = target
    return foreign
