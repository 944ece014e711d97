"""Writing CUDA kernel packs: every spec compiled for every requested arch, plus a manifest.

A pack is a folder of libraries (``compiler/cuda_pack.py``: SASS in place of the CUDA
source) and ``manifest.json``; ``runtime/pack_loader.py`` loads it on the GPU machine. The
schedule of a kernel depends on the arch (WMMA on sm_70/75, mma.sync on sm_80+, ...), so a
spec gets one library per group of arches that share a schedule.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..config import dist_version
from ..schedules import cuda, cuda_conv2d
from . import build
from .cuda_pack import check_nvcc_arches, normalize_arches

PACK_FORMAT = 2  # 2: a spec may have several entries (one per schedule), told apart by arches


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def schedule_groups(spec, arches) -> dict[str, list[str]]:
    """``arches`` grouped by the schedule ``spec`` gets there: {kind: [arch, ...]}.

    TVM generates the source for the first arch of a group and nvcc compiles it for all of
    them; arches of different schedules must not share a source (sm_80's mma.sync does not
    exist on sm_75, and sm_75's WMMA source would run on sm_80 slower than mma.sync).
    """
    schedule_kind = cuda_conv2d.schedule_kind if spec.family == "conv2d" else cuda.schedule_kind
    groups: dict[str, list[str]] = {}
    for arch in normalize_arches(arches):
        groups.setdefault(schedule_kind(spec, arch), []).append(arch)
    return groups


def build_kernels(spec, arches, out_dir: str | os.PathLike) -> list[dict]:
    """Compile one CUDA kernel into ``out_dir``, one library per schedule group of
    ``arches``; their manifest entries."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for kind, group in schedule_groups(spec, arches).items():
        executable, seconds = build.compile_spec(spec, arch=group[0], arches=group)
        path = out / f"{spec.name()}-{kind}.so"
        info = executable.export_library(path)
        entries.append(
            {
                "key": spec.key(),
                "name": spec.name(),
                "file": path.name,
                "sha256": _sha256(path),
                "arches": info["arches"],
                "schedule": kind,
                "build_seconds": round(seconds, 2),
            }
        )
    return entries


def write_pack(specs, arches, out_dir: str | os.PathLike, log=print) -> Path:
    """Build every spec for every arch into a pack folder; returns the manifest path."""
    out = Path(out_dir)
    (out / "kernels").mkdir(parents=True, exist_ok=True)
    check_nvcc_arches(arches)  # before the first (slow) build
    entries = []
    for i, spec in enumerate(specs, 1):
        for entry in build_kernels(spec, arches, out / "kernels"):
            entry["file"] = f"kernels/{entry['file']}"
            entries.append(entry)
            log(
                f"[{i}/{len(specs)}] {spec.name()} ({entry['schedule']}: "
                f"{','.join(entry['arches'])})  {entry['build_seconds']} s"
            )
    manifest = {
        "format": PACK_FORMAT,
        "arches": normalize_arches(arches),
        "tvm": dist_version("apache-tvm"),
        "kernels": entries,
    }
    path = out / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return path
