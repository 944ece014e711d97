"""Where the package keeps its files, and the versions that name them (no imports of ours).

Every layer reads these: the runtime (kernel cache, tuning records), the compiler (the
tuning database it writes), the CLI (``cache info``).
"""

from __future__ import annotations

import functools
import os
from importlib import metadata
from pathlib import Path

ENV_CACHE_DIR = "TVM_GEMM_CACHE_DIR"
ENV_NO_COMPILE = "TVM_GEMM_NO_COMPILE"  # "1": serve kernels from the cache only


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_tvm_gemm"


def kernels_dir() -> Path:
    return cache_dir() / "kernels"


def tuning_root() -> Path:
    return cache_dir() / "tuning"


def compile_forbidden() -> bool:
    return os.environ.get(ENV_NO_COMPILE, "") not in ("", "0")


@functools.cache
def dist_version(dist: str) -> str:
    """An installed distribution's version ("unknown" if absent): part of cache keys."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"
