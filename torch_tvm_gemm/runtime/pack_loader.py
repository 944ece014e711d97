"""Loading CUDA kernel packs (built elsewhere by ``python -m torch_tvm_gemm compile``).

A pack is a folder of exported kernel libraries plus ``manifest.json`` (spec key, file,
SHA-256 and arches of each kernel). A GPU process registers it with ``load_pack(path)`` or
the ``TVM_GEMM_PACK`` environment variable; libraries load on first use with ``tvm_ffi``
and the TVM runtime libraries alone (``compiler/cuda_pack.py`` says how they are made).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from .. import schedules
from ..kernels.conv2d import Conv2dSpec
from ..kernels.gemm import GemmSpec
from .loader import load_kernel_file

ENV_PACK = "TVM_GEMM_PACK"  # pack folders (os.pathsep separated) a GPU process loads
READABLE_PACK_FORMATS = (1, 2)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def spec_from_key(key: dict):
    """The spec of a manifest key (``spec.key()`` read back from JSON)."""
    fields = {k: v for k, v in key.items() if k not in ("family", "conv_schedule_version")}
    if key["family"] == "conv2d":
        pairs = {name: tuple(fields[name]) for name in ("stride", "padding", "dilation")}
        return Conv2dSpec(**{**fields, **pairs})  # (JSON made the pairs lists)
    return GemmSpec(**fields)


_lock = threading.Lock()
_packs: dict[Any, list[tuple[Path, dict]]] = {}  # spec -> [(library path, entry)], per schedule
_env_loaded = False


def load_pack(path: str | os.PathLike) -> int:
    """Register the kernels of a pack folder; returns how many. Libraries load on first use."""
    root = Path(path)
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest.get("format") not in READABLE_PACK_FORMATS:
        raise RuntimeError(f"torch_tvm_gemm: {root} is a pack of unknown format")
    with _lock:
        for entry in manifest["kernels"]:
            spec = spec_from_key(entry["key"])
            # A later pack replaces an earlier one's library for the same arches.
            kept = [
                (p, e)
                for p, e in _packs.get(spec, [])
                if not set(e["arches"]) & set(entry["arches"])
            ]
            _packs[spec] = [*kept, (root / entry["file"], entry)]
    return len(manifest["kernels"])


def _load_env_packs() -> None:
    global _env_loaded
    if _env_loaded:
        return
    _env_loaded = True
    for folder in filter(None, os.environ.get(ENV_PACK, "").split(os.pathsep)):
        load_pack(folder)


def _runs_on(entry: dict, arch: str) -> bool:
    """Whether a pack entry has SASS for ``arch``: its own, or the base arch's for an
    ``sm_90a`` GPU (plain sm_90 code runs there)."""
    return arch in entry["arches"] or arch.rstrip("a") in entry["arches"]


def lookup(spec, arch: str) -> Any | None:
    """The kernel for ``spec`` from a loaded pack, or None if no pack has it. Of the
    entries that run on ``arch``, the one with the schedule a build here would use
    (``schedule_kind``: e.g. wgmma on sm_90a) comes first.

    A pack kernel without SASS for ``arch`` is an error, not a silent rebuild.
    """
    _load_env_packs()
    hits = _packs.get(spec)
    if not hits:
        return None
    found = [(p, e) for p, e in hits if _runs_on(e, arch)]
    wanted = schedules.module(spec.family, "cuda").schedule_kind(spec, arch)
    found.sort(key=lambda hit: hit[1].get("schedule") != wanted)
    if not found:
        built = sorted({a for _, e in hits for a in e["arches"]})
        raise RuntimeError(
            f"torch_tvm_gemm: kernel {spec.name()} in {hits[0][0].parent} was built for "
            f"{', '.join(built)}, not for this GPU ({arch}); rebuild the pack with "
            f"--arch {arch}"
        )
    path, entry = found[0]
    if _sha256(path) != entry["sha256"]:
        raise RuntimeError(f"torch_tvm_gemm: pack kernel {path} is corrupt (hash mismatch)")
    return load_kernel_file(path, spec.name(), device="cuda")
