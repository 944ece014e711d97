"""The tuning database: MetaSchedule's JSON files of one kernel, kept readable.

MetaSchedule appends every measured trial to ``database_tuning_record.json`` line by line
(a run killed by Ctrl-C or a crash resumes from what it measured), and stops reading at the
first bad line: ``open_database`` first drops lines that a torn write (a crash mid-append,
a full disk) left unreadable, so that one of them cannot fail every later tuning.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from ..runtime.cache_trust import make_private_dir

DB_FILES = ("database_workload.json", "database_tuning_record.json")


# --- the database -------------------------------------------------------------------------


def sanitize_database(work_dir: Path) -> int:
    """Drop unreadable lines of the JSON database (with a warning); return how many.

    MetaSchedule stops at the first bad line, so one torn write (a crash mid-append, a full
    disk) would otherwise make every later tuning of the kernel fail.
    """
    wl_path, rec_path = (work_dir / f for f in DB_FILES)
    workloads = _read_lines(wl_path)
    records = _read_lines(rec_path)
    # Renumber records when a workload line is dropped: they point at workloads by index.
    new_index, kept_workloads = {}, []
    for idx, (line, value) in enumerate(workloads):
        if value is not None:
            new_index[idx] = len(kept_workloads)
            kept_workloads.append(line)
    kept_records = []
    for line, value in records:
        if not (_valid_record(value) and value[0] in new_index):
            continue
        if new_index[value[0]] == value[0]:
            kept_records.append(line)  # untouched, byte for byte
        else:
            kept_records.append(json.dumps([new_index[value[0]], value[1]], separators=(",", ":")))
    dropped = len(workloads) - len(kept_workloads) + len(records) - len(kept_records)
    if dropped:
        warnings.warn(
            f"torch_tvm_gemm: skipped {dropped} corrupt tuning record(s) in {work_dir}",
            RuntimeWarning,
            stacklevel=2,
        )
        _rewrite(wl_path, kept_workloads)
        _rewrite(rec_path, kept_records)
    return dropped


def _read_lines(path: Path) -> list[tuple[str, Any]]:
    """(line, parsed value or None if it does not parse) for each non-empty line."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except ValueError:
            out.append((line, None))
    return out


def _valid_record(value: Any) -> bool:
    # [workload index, [trace, run_secs, target, args_info]]
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], int)
        and isinstance(value[1], list)
        and len(value[1]) == 4
    )


def _rewrite(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def open_database(work_dir: Path):
    from tvm.s_tir import meta_schedule as ms

    make_private_dir(work_dir)
    sanitize_database(work_dir)
    return ms.database.JSONDatabase(work_dir=str(work_dir))


def records_of(db, mod) -> list:
    """The measured (valid) records of ``mod`` in ``db``, best first."""
    if not db.has_workload(mod):
        return []
    return list(db.get_top_k(db.commit_workload(mod), 1 << 30))


def record_seconds(record) -> float:
    secs = [float(s) for s in record.run_secs]
    return sum(secs) / len(secs)
