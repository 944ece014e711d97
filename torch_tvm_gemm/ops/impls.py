"""Which impls serve real tensors: C++ (csrc/, the fast path) or the Python ones.

The C++ impls (torch_tvm_gemm._C) mirror ``gemm_ops``' ``matmul_impl`` / ``linear_impl`` /
``gemm`` and call the same kernels; they reach Python only on a kernel-table miss (through
the tvm-ffi global function below) and on bad input (to raise ``checks``' own error). The
constants they mirror (variant thresholds, activations, dtypes, the kernel alignment) are
handed to them here, at registration, from their one home; on a miss they hand over the
call's shape, and ``gemm_spec`` decides the kernel, as on the Python path. Exactly one impl
is registered per dispatch key; ``use_impl()`` switches, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import tvm_ffi

from .. import _ext
from ..kernels.conv2d import ACTIVATIONS as CONV_ACTIVATIONS
from ..kernels.gemm import ACTIVATIONS
from ..runtime import output_pool
from ..runtime.table import get_kernel, on_clear_table
from ..schedules import cpu as cpu_schedules
from ..schedules.cpu import DOT2_MAX_M, DOT_MAX_M, GEMV_MAX_M, GEMV_MIN_B_ELEMENTS
from . import plan
from .checks import CONV, DTYPE_NAMES, SUPPORTED_DTYPES
from .conv_ops import _conv2d_impl, cpp_conv_kernel
from .gemm_ops import KERNEL_ALIGNMENT, gemm_spec, linear_impl, matmul_impl

_cpp_miss = threading.local()  # the miss handler's last exception, per thread
PY_IMPL_KEYS = ("CPU", "CUDA")  # dispatch keys the Python impls serve
_py_impls: torch.library.Library | None = None  # the Python registrations now active
_impl_path = ""


def _kernel_for_cpp(
    dtype: str,
    m: int,
    n: int,
    k: int,
    b_layout: str,
    bias: bool,
    activation: str,
    static_k: bool,
    batched: bool,
    variant: str,
    device: str,
):
    """The C++ kernel table's miss handler: the call's shape and options, from which
    ``gemm_spec`` (the one rule) makes the spec; ``variant`` is the one the C++ table key holds.

    An exception is also kept for ``reraise_kernel_error`` (same thread): tvm-ffi hands C++
    only its class name and text, and the caller should see the exception itself, as on the
    Python path.
    """
    try:
        spec = gemm_spec(
            dtype,
            m,
            n,
            k,
            b_layout,
            bias=bias,
            activation=activation,
            device=device,
            static_k=static_k,
            batched=batched,
        )
        if spec.variant != variant:  # the table would keep this kernel under another key
            raise RuntimeError(
                f"tvm_gemm: internal error: for an ({m}, {k}) @ {b_layout} (n={n}) product the "
                f"C++ impl keys the kernel as variant {variant!r} but gemm_spec picks "
                f"{spec.variant!r}; the variant rule in csrc/tvm_gemm_ops.cpp and "
                "schedules/cpu.py gemm_variant disagree (rebuild the extension; please report "
                "this if it persists)"
            )
        return get_kernel(spec)
    except BaseException as err:
        _cpp_miss.error = err
        raise


def reraise_kernel_error() -> None:
    """Raise the exception the miss handler last kept on this thread (called from C++)."""
    err, _cpp_miss.error = getattr(_cpp_miss, "error", None), None
    if err is not None:
        raise err


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
        output_pool.configure()  # the C++ impls' outputs come from it
        # After register_autograd (below the C++ autograd fast path sits the Python kernel).
        ext.register_impls(
            GEMV_MAX_M,
            GEMV_MIN_B_ELEMENTS,
            DOT_MAX_M,
            list(ACTIVATIONS),
            [DTYPE_NAMES[d] for d in SUPPORTED_DTYPES],
            KERNEL_ALIGNMENT["cpu"],
            DOT2_MAX_M,
            [cpu_schedules.SWAP_MIN_M, cpu_schedules.SWAP_MAX_M, cpu_schedules.swap_max_k()],
            amx_dot=list(cpu_schedules.amx_dot_limits()),
            bf16_dot_max_m=cpu_schedules.bf16_dot_max_m(),
            bf16_gemv_max_m=cpu_schedules.bf16_gemv_max_m(),
            k_tail=[
                cpu_schedules.DOT_K_MULTIPLE,
                cpu_schedules.KTAIL_GEMV_MAX_M,
                cpu_schedules.KTAIL_BF16_GEMV_MAX_M,
            ],
            # (by M; for N of DOT_WIDE_MIN_N rows or more, then below it)
            dot_min_k=[
                cpu_schedules.dot_min_k(m, n)
                for n in (cpu_schedules.DOT_WIDE_MIN_N, cpu_schedules.DOT_WIDE_MIN_N - 1)
                for m in range(DOT_MAX_M + 1)
            ],
            dot_wide_min_n=cpu_schedules.DOT_WIDE_MIN_N,
            conv_epilogues=[a for a in CONV_ACTIVATIONS if a not in ACTIVATIONS],
            ksplit=[
                cpu_schedules.KSPLIT_MAX_M,
                cpu_schedules.KSPLIT_MIN_N,
                cpu_schedules.KSPLIT_N_MULTIPLE,
            ],
            # (min_m, max_m, min_n, max_k) of "swap32", then of "swap48" (csrc/'s order)
            one_panel_swaps=[
                value
                for variant in ("swap32", "swap48")
                for value in (
                    *cpu_schedules.swap_rows(variant),
                    cpu_schedules.ONE_PANEL_SWAPS[variant][2],
                    cpu_schedules.one_panel_swap_max_k(variant),
                )
            ],
            swap2=[
                cpu_schedules.SWAP2_MIN_M,
                cpu_schedules.SWAP2_MAX_M,
                cpu_schedules.SWAP2_MIN_N,
                cpu_schedules.swap_max_k(),
            ],
            rows=[
                cpu_schedules.ROWS_MIN_M,
                cpu_schedules.ROWS_MAX_N,
                cpu_schedules.rows_max_k(),
                cpu_schedules.ROWS_PANEL,
                cpu_schedules.ROWS_PACK_ROWS,
            ],
        )
        cpp_keys = list(ext.dispatch_keys())
    py_keys = [key for key in PY_IMPL_KEYS if key not in cpp_keys]
    if py_keys:
        _py_impls = torch.library.Library("tvm_gemm", "IMPL")  # noqa: TOR901
        for key in py_keys:
            _py_impls.impl("matmul", matmul_impl, key)
            _py_impls.impl("linear", linear_impl, key)
        if "CPU" in py_keys:  # (the conv op's CUDA impl is conv_ops' own registration)
            _py_impls.impl(CONV, _conv2d_impl, "CPU")
    _impl_path = path
    # Python-side dispatch caches (used under the Python dispatcher, e.g. by AOTAutograd)
    # may still point at the kernels just removed.
    for name in ("matmul", "linear", CONV):
        cache = getattr(getattr(torch.ops.tvm_gemm, name).default, "_dispatch_cache", None)
        if cache is not None:  # a private torch attribute: tolerate its absence
            cache.clear()
    return previous


@contextlib.contextmanager
def planning(
    device: str | None = None, tf32: bool | None = None, compute: bool = True
) -> Iterator[plan.Plan]:
    """Plan instead of run: the ops record the kernel each call needs and compute with torch.

        with torch_tvm_gemm.ops.planning() as found:
            model(x)                          # no kernel is built, loaded or called
        found.specs                           # the kernels a real model(x) asks for

    Each ``tvm_gemm`` GEMM and conv call picks its kernel spec as it would for real
    (``gemm_spec``, ``conv2d_spec``; backward passes included), records it once in the
    yielded ``Plan`` and returns torch's result. ``device`` ("cpu" or "cuda") plans that
    device's kernels whatever the tensors' device (a GPU run, planned on CPU tensors of the
    same shapes); ``tf32`` (CUDA float32) overrides ``torch.backends.cuda.matmul.allow_tf32``;
    ``compute=False`` leaves the results uninitialised (cheap, for code whose control flow
    reads no values).

    The Python impls serve the ops while it is active (the C++ fast path would not see
    it), and the previous choice is restored afterwards. Process-wide and not for
    concurrent use: other threads' op calls meanwhile are planned too; it does not nest.
    """
    if device not in plan.DEVICES:
        raise ValueError(f"tvm_gemm.planning: device must be 'cpu', 'cuda' or None, got {device!r}")
    if plan.active() is not None:
        raise RuntimeError("tvm_gemm.planning: already planning (planning() does not nest)")
    found = plan.Plan(device=device, tf32=tf32, compute=compute)
    previous = use_impl("python")
    plan.activate(found)
    try:
        yield found
    finally:
        plan.activate(None)
        use_impl(previous)


def init_impls() -> None:
    ext = _ext.load()
    if ext is not None:
        tvm_ffi.register_global_func("tvm_gemm.get_kernel", _kernel_for_cpp, override=True)
        tvm_ffi.register_global_func("tvm_gemm.conv_kernel", cpp_conv_kernel, override=True)
        on_clear_table(ext.clear_table)
    if ext is None or _ext.python_impl_requested():
        use_impl("python")
        return
    try:
        use_impl("cpp")
    except Exception as err:  # e.g. an extension older than these ops: keep working
        _ext.warn(f"cannot register the C++ op impls ({err}); using the Python ones")
        use_impl("python")
