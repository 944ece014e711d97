"""Which impls serve real tensors: C++ (csrc/, the fast path) or the Python ones.

The C++ impls (torch_tvm_gemm._C) mirror ``gemm_ops``' ``matmul_impl`` / ``linear_impl`` /
``gemm`` and call the same kernels; they reach Python only on a kernel-table miss (through
the tvm-ffi global function below) and on bad input (to raise ``checks``' own error). The
constants they mirror (variant thresholds, activations, dtypes) are handed to them here, at
registration, from their one home. Exactly one impl is registered per dispatch key;
``use_impl()`` switches, for tests and benchmarks.
"""

from __future__ import annotations

import threading

import torch
import tvm_ffi

from .. import _ext
from ..kernels.gemm import ACTIVATIONS, GemmSpec
from ..runtime.table import get_kernel, on_clear_table
from ..schedules.cpu import DOT2_MAX_M, DOT_MAX_M, GEMV_MAX_M, GEMV_MIN_B_ELEMENTS
from .checks import DTYPE_NAMES, SUPPORTED_DTYPES
from .gemm_ops import linear_impl, matmul_impl

_cpp_miss = threading.local()  # the miss handler's last exception, per thread
PY_IMPL_KEYS = ("CPU", "CUDA")  # dispatch keys the Python impls serve
_py_impls: torch.library.Library | None = None  # the Python registrations now active
_impl_path = ""


def _kernel_for_cpp(
    dtype: str,
    n: int,
    k: int,
    b_layout: str,
    bias: bool,
    activation: str,
    variant: str,
    device: str,
    batched: bool = False,
):
    """The C++ kernel table's miss handler: every GemmSpec field (k < 0: symbolic K).

    An exception is also kept for ``reraise_kernel_error`` (same thread): tvm-ffi hands C++
    only its class name and text, and the caller should see the exception itself, as on the
    Python path.
    """
    try:
        return _get_kernel_for_cpp(
            dtype, n, k, b_layout, bias, activation, variant, device, batched
        )
    except BaseException as err:
        _cpp_miss.error = err
        raise


def reraise_kernel_error() -> None:
    """Raise the exception the miss handler last kept on this thread (called from C++)."""
    err, _cpp_miss.error = getattr(_cpp_miss, "error", None), None
    if err is not None:
        raise err


def _get_kernel_for_cpp(
    dtype: str,
    n: int,
    k: int,
    b_layout: str,
    bias: bool,
    activation: str,
    variant: str,
    device: str,
    batched: bool,
):
    spec = GemmSpec(
        dtype=dtype,
        n=n,
        k=None if k < 0 else k,
        b_layout=b_layout,
        bias=bias,
        activation=activation,
        variant=variant,
        device=device,
        batched=batched,
    )
    return get_kernel(spec)


def impl_path() -> str:
    """Which impls serve the ops: ``"cpp"`` (the C++ extension) or ``"python"``."""
    return _impl_path


def use_impl(path: str) -> str:
    """Serve the ops with the ``"cpp"`` or ``"python"`` impls; return the previous choice.

    ``"cpp"`` needs the extension (``_ext.load()`` not None). Not meant to race with op calls.
    """
    global _py_impls, _impl_path
    if path not in ("cpp", "python"):
        raise ValueError(f"tvm_gemm: impl path must be 'cpp' or 'python', got {path!r}")
    ext = _ext.load()
    if path == "cpp" and ext is None:
        raise RuntimeError(f"tvm_gemm: the C++ extension is not available ({_ext.load_error})")
    previous = _impl_path
    if path == previous:
        return previous
    # Unregister first: one dispatch key must never have two kernels at once.
    if _py_impls is not None:
        _py_impls._destroy()
        _py_impls = None
    if ext is not None and previous == "cpp":
        ext.unregister_impls()
    cpp_keys: list[str] = []
    if path == "cpp":
        # After register_autograd (below the C++ autograd fast path sits the Python kernel).
        ext.register_impls(
            GEMV_MAX_M,
            GEMV_MIN_B_ELEMENTS,
            DOT_MAX_M,
            list(ACTIVATIONS),
            [DTYPE_NAMES[d] for d in SUPPORTED_DTYPES],
            dot2_max_m=DOT2_MAX_M,
        )
        cpp_keys = list(ext.dispatch_keys())
    py_keys = [key for key in PY_IMPL_KEYS if key not in cpp_keys]
    if py_keys:
        _py_impls = torch.library.Library("tvm_gemm", "IMPL")  # noqa: TOR901
        for key in py_keys:
            _py_impls.impl("matmul", matmul_impl, key)
            _py_impls.impl("linear", linear_impl, key)
    _impl_path = path
    # Python-side dispatch caches (used under the Python dispatcher, e.g. by AOTAutograd)
    # may still point at the kernels just removed.
    for name in ("matmul", "linear"):
        cache = getattr(getattr(torch.ops.tvm_gemm, name).default, "_dispatch_cache", None)
        if cache is not None:  # a private torch attribute: tolerate its absence
            cache.clear()
    return previous


def init_impls() -> None:
    ext = _ext.load()
    if ext is not None:
        tvm_ffi.register_global_func("tvm_gemm.get_kernel", _kernel_for_cpp, override=True)
        on_clear_table(ext.clear_table)
    if ext is None or _ext.python_impl_requested():
        use_impl("python")
        return
    try:
        use_impl("cpp")
    except Exception as err:  # e.g. an extension older than these ops: keep working
        _ext.warn(f"cannot register the C++ op impls ({err}); using the Python ones")
        use_impl("python")
