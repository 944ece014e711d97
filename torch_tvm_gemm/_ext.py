"""Soft loading of the C++ extension ``torch_tvm_gemm._C`` (csrc/tvm_gemm_ops.cpp).

The extension holds the ops' per-call hot path. Without it (not built, or built against
another torch) the package still works through the Python impls in ops/, and says so once,
on one line. ``TVM_GEMM_PYTHON_IMPL=1`` selects the Python impls even when it is present.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import ModuleType

ENV_PYTHON_IMPL = "TVM_GEMM_PYTHON_IMPL"

_log = logging.getLogger("torch_tvm_gemm")
_module: ModuleType | None = None
_tried = False
load_error: str | None = None  # why the extension is unavailable, when it is


def load() -> ModuleType | None:
    """The extension module, or None (with a one-line warning, once) when it can't load."""
    global _module, _tried, load_error
    if _tried:
        return _module
    _tried = True
    try:
        import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so globally: the extension links to it)

        if importlib.util.find_spec(f"{__package__}._C") is None:
            raise ImportError("not built: the package was installed without it")
        from . import _C
    except (ImportError, OSError) as err:
        load_error = f"{type(err).__name__}: {err}"
        if not python_impl_requested():
            warn(
                f"C++ extension not available ({load_error}); using the slower Python op "
                "impls (reinstall with `pip install --no-build-isolation .` to build it)"
            )
        return None
    _module = _C
    return _module


def warn(msg: str) -> None:
    """One visible line on stderr (logging's last-resort handler prints just the message)."""
    _log.warning("torch_tvm_gemm: %s", msg)


def python_impl_requested() -> bool:
    """True when the environment asks for the Python impls (``TVM_GEMM_PYTHON_IMPL=1``)."""
    return os.environ.get(ENV_PYTHON_IMPL, "") not in ("", "0")
