"""Reading tuning verdicts, without the compiler: what the kernel cache key needs.

Layout: ``<cache dir>/tuning/<kernel name>-<key hash>/`` per kernel, holding MetaSchedule's
JSON database and ``best.json``, the verdict of the last tuning (``compiler/tune.py`` writes
both). A kept verdict changes the kernel's cache key (``tuned_key``), so a tuned build never
collides with the hand one, and a re-tuned kernel is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..config import cache_dir, dist_version, tuning_root
from ..kernels.gemm import GemmSpec
from ..target import device_key
from .cache_trust import untrusted_dir, untrusted_file

SPACE_VERSION = 3  # bump when the tuning design space changes: old records no longer replay
BEST = "best.json"


def tuning_key(spec: GemmSpec) -> dict:
    """What a tuning record depends on: the kernel (spec, target, TVM) and our space."""
    return {
        **spec.key(),
        "target": device_key(spec.device),
        "tvm": dist_version("apache-tvm"),
        "space_version": SPACE_VERSION,
    }


def tuning_dir(spec: GemmSpec) -> Path:
    digest = hashlib.sha256(json.dumps(tuning_key(spec), sort_keys=True).encode()).hexdigest()
    return tuning_root() / f"{spec.name()}-{digest[:16]}"


def read_best(spec: GemmSpec, warn: bool = True) -> dict | None:
    """The verdict of the last tuning of ``spec``, or None (absent or unreadable)."""
    path = tuning_dir(spec) / BEST
    if not path.exists():
        return None
    # A record is a schedule trace that is replayed and compiled (its annotations can
    # bring in code): read only from folders that no one else can write.
    for where in (cache_dir(), tuning_root(), path.parent):
        problem = untrusted_dir(where)
        if problem is not None:
            break
    problem = problem or untrusted_file(path)
    if problem is not None:
        if warn:
            warnings.warn(
                f"torch_tvm_gemm: ignoring tuning record {path}: {problem} (the hand "
                "schedule is used)",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    try:
        best = json.loads(path.read_text())
        if not isinstance(best, dict) or "trace" not in best or "kept" not in best:
            raise ValueError("missing fields")
        return best
    except (OSError, ValueError) as err:
        if warn:
            warnings.warn(
                f"torch_tvm_gemm: tuning record {path} is corrupt ({err}); ignoring it "
                "(the hand schedule is used; re-tune to replace it)",
                RuntimeWarning,
                stacklevel=2,
            )
        return None


def tuned_key(spec: GemmSpec) -> str | None:
    """A short hash of the kept tuned trace of ``spec`` (for the cache key), or None."""
    if spec.device != "cpu":
        return None
    best = read_best(spec, warn=False)
    if best is None or not best["kept"]:
        return None
    return hashlib.sha256(json.dumps(best["trace"], sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class TuneResult:
    """What a tuning run of one kernel found (``compiler.tune.tune_spec``), and its verdict."""

    spec: GemmSpec
    m: int
    trials: int  # measured records for this workload in the database
    new_trials: int  # of which this run measured
    tuned_gflops: float | None
    hand_gflops: float | None
    kept: bool
    reason: str
