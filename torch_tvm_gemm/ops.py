"""Every torch.library definition of the ``tvm_gemm`` namespace: schemas, device impls,
fake kernels and autograd formulas.

Validation lives in one function per op, shared by the fake kernel (what torch.compile and
opcheck see) and the real impls, so both reject bad input with the same message: it names
the op, the argument and what was expected.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
import tvm_ffi
from torch import Tensor

from . import _ext
from .kernels.gemm import ACTIVATIONS, GemmSpec
from .runtime import get_kernel, on_clear_table, sync_threads
from .schedules.cpu import GEMV_MAX_M

LIB = torch.library.Library("tvm_gemm", "DEF")  # noqa: TOR901 (ops defined here, once)
LIB.define("matmul(Tensor a, Tensor b) -> Tensor")
LIB.define("linear(Tensor x, Tensor weight, Tensor? bias=None, str activation='none') -> Tensor")

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


# --- validation (shared by fake and real kernels) -------------------------------------------


def _check_tensor(op: str, name: str, t: Tensor, ranks: tuple[int, ...]) -> None:
    torch._check_type(
        t.dtype in SUPPORTED_DTYPES,
        lambda: (
            f"tvm_gemm.{op}: argument '{name}' must be float32, float64, bfloat16 or "
            f"float16, got {t.dtype}"
        ),
    )
    torch._check_value(
        t.dim() in ranks,
        lambda: (
            f"tvm_gemm.{op}: argument '{name}' must be "
            f"{' or '.join(f'{r}-D' for r in ranks)}, got a {t.dim()}-D tensor of shape "
            f"{tuple(t.shape)}"
        ),
    )


def _check_same(op: str, first: tuple[str, Tensor], other: tuple[str, Tensor]) -> None:
    (n1, t1), (n2, t2) = first, other
    torch._check_type(
        t1.dtype == t2.dtype,
        lambda: (
            f"tvm_gemm.{op}: argument '{n2}' has dtype {t2.dtype} but '{n1}' has "
            f"{t1.dtype}; mixed dtypes are not supported (convert one of them)"
        ),
    )
    torch._check(
        t1.device == t2.device,
        lambda: (
            f"tvm_gemm.{op}: argument '{n2}' is on {t2.device} but '{n1}' is on "
            f"{t1.device}; all tensors must be on one device"
        ),
    )


def check_matmul(a: Tensor, b: Tensor) -> list[int]:
    """Validate ``matmul(a, b)``; return the output shape."""
    _check_tensor("matmul", "a", a, (2, 3))
    _check_tensor("matmul", "b", b, (2, 3))
    _check_same("matmul", ("a", a), ("b", b))
    torch._check_value(
        a.shape[-1] == b.shape[-2],
        lambda: (
            f"tvm_gemm.matmul: inner dims differ: a is {tuple(a.shape)}, b is "
            f"{tuple(b.shape)} (a.shape[-1] must equal b.shape[-2])"
        ),
    )
    m, n = a.shape[-2], b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return [m, n]
    if b.dim() == 2:
        return [a.shape[0], m, n]
    ba = a.shape[0] if a.dim() == 3 else 1
    bb = b.shape[0]
    torch._check_value(
        ba == bb or ba == 1 or bb == 1,
        lambda: (
            f"tvm_gemm.matmul: batch dims of a {tuple(a.shape)} and b {tuple(b.shape)} "
            "cannot be broadcast"
        ),
    )
    return [bb if ba == 1 else ba, m, n]


def check_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> list[int]:
    """Validate ``linear(x, weight, bias, activation)``; return the output shape."""
    torch._check_value(
        activation in ACTIVATIONS,
        lambda: (
            f"tvm_gemm.linear: argument 'activation' must be one of {ACTIVATIONS}, "
            f"got {activation!r}"
        ),
    )
    _check_tensor("linear", "x", x, tuple(range(1, 9)))
    _check_tensor("linear", "weight", weight, (2,))
    _check_same("linear", ("x", x), ("weight", weight))
    torch._check_value(
        x.shape[-1] == weight.shape[1],
        lambda: (
            f"tvm_gemm.linear: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but "
            f"weight expects {weight.shape[1]} (shape {tuple(weight.shape)} = (out, in))"
        ),
    )
    if bias is not None:
        _check_tensor("linear", "bias", bias, (1,))
        _check_same("linear", ("x", x), ("bias", bias))
        torch._check_value(
            bias.shape[0] == weight.shape[0],
            lambda: (
                f"tvm_gemm.linear: argument 'bias' must have shape ({weight.shape[0]},) "
                f"to match weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
            ),
        )
    return [*x.shape[:-1], weight.shape[0]]


# --- the kernel call ------------------------------------------------------------------------

_ACT_FN: dict[str, Callable[[Tensor], Tensor]] = {
    "none": lambda t: t,
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
}


def _device_name(t: Tensor) -> str:
    return "cuda" if t.is_cuda else "cpu"


def gemm(
    a: Tensor,
    b: Tensor,
    b_layout: str,
    bias: Tensor | None = None,
    activation: str = "none",
    static_k: bool = True,
    out: Tensor | None = None,
) -> Tensor:
    """``act(a @ B + bias)`` for a 2-D ``a``; B is ``b`` (layout "kn") or ``b.T`` ("nk").

    Handles what the kernels do not: empty dims, non-contiguous inputs.
    """
    m, k = a.shape
    n = b.shape[1] if b_layout == "kn" else b.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: the result is act(bias) or act(0)
        zero = bias.expand(m, n) if bias is not None else torch.zeros_like(out)
        return out.copy_(_ACT_FN[activation](zero))
    spec = GemmSpec(
        dtype=_DTYPE_NAMES[a.dtype],
        n=n,
        k=k if static_k else None,
        b_layout=b_layout,
        bias=bias is not None,
        activation=activation,
        variant="gemv" if m <= GEMV_MAX_M else "gemm",
        device=_device_name(a),
    )
    kernel = get_kernel(spec)
    sync_threads()
    args = [a.contiguous(), b.contiguous()]
    if bias is not None:
        args.append(bias.contiguous())
    kernel(*args, out)
    return out


def _matmul_2d(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    # A transposed contiguous b (b = w.T, as in a Linear backward) is read in place as "nk".
    if not b.is_contiguous() and b.t().is_contiguous():
        return gemm(a, b.t(), "nk", static_k=False, out=out)
    return gemm(a, b, "kn", static_k=False, out=out)


def _rows(t: Tensor) -> Tensor:
    """``t`` as 2-D ``(rows, last dim)``; unlike ``reshape(-1, K)`` also fine when K = 0."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _matmul_impl(a: Tensor, b: Tensor) -> Tensor:
    shape = check_matmul(a, b)
    if b.dim() == 2:  # (.., M, K) @ (K, N): one GEMM over all rows
        return _matmul_2d(_rows(a), b).reshape(shape)
    batch, m, n = shape
    a3 = a.expand(batch, m, a.shape[-1])
    b3 = b.expand(batch, *b.shape[-2:])
    out = torch.empty(shape, dtype=a.dtype, device=a.device)
    for i in range(batch):  # one kernel call per batch entry: each is a full GEMM
        _matmul_2d(a3[i], b3[i], out=out[i])
    return out


def _linear_impl(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "none"
) -> Tensor:
    shape = check_linear(x, weight, bias, activation)
    x2 = _rows(x) if x.dim() != 2 else x
    return gemm(x2, weight, "nk", bias, activation).reshape(shape)


# --- fake kernels ---------------------------------------------------------------------------


@torch.library.register_fake("tvm_gemm::matmul")
def _matmul_fake(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(check_matmul(a, b))


@torch.library.register_fake("tvm_gemm::linear")
def _linear_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "none"
) -> Tensor:
    return x.new_empty(check_linear(x, weight, bias, activation))


# --- autograd -------------------------------------------------------------------------------


def _matmul_setup(ctx, inputs, output) -> None:
    a, b = inputs
    ctx.save_for_backward(
        a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None
    )
    ctx.a_shape, ctx.b_shape = a.shape, b.shape


def _matmul_backward(ctx, grad: Tensor):
    a, b = ctx.saved_tensors
    grad_a = grad_b = None
    mm = torch.ops.tvm_gemm.matmul
    if ctx.needs_input_grad[0]:  # dA = dC @ B^T, summed over broadcast batch dims
        grad_a = mm(grad, b.transpose(-1, -2)).sum_to_size(ctx.a_shape)
    if ctx.needs_input_grad[1]:  # dB = A^T @ dC
        if len(ctx.b_shape) == 2:  # shared B: one GEMM over all rows of the batch
            k, n = ctx.b_shape
            grad_b = mm(a.reshape(-1, k).t(), grad.reshape(-1, n))
        else:
            grad_b = mm(a.transpose(-1, -2), grad).sum_to_size(ctx.b_shape)
    return grad_a, grad_b


torch.library.register_autograd("tvm_gemm::matmul", _matmul_backward, setup_context=_matmul_setup)


def _gelu_grad(z: Tensor) -> Tensor:
    """d/dz of the exact GELU: Phi(z) + z * phi(z)."""
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def _linear_setup(ctx, inputs, output) -> None:
    # Trailing arguments equal to their defaults may be left out by the dispatcher.
    x, weight, bias, activation = (list(inputs) + [None, "none"][len(inputs) - 2 :])[:4]
    ctx.activation = activation
    ctx.has_bias = bias is not None
    # relu's derivative needs only the output; gelu's needs the pre-activation, recomputed
    # in the backward rather than kept alive between forward and backward.
    ctx.save_for_backward(
        x,
        weight,
        bias if activation == "gelu" else None,
        output if activation == "relu" else None,
    )


def _linear_backward(ctx, grad: Tensor):
    x, weight, bias, output = ctx.saved_tensors
    if ctx.activation == "relu":
        grad = grad * (output > 0)
    elif ctx.activation == "gelu":
        z = torch.ops.tvm_gemm.linear(x, weight, bias, "none")
        grad = grad * _gelu_grad(z)
    n, k = weight.shape
    grad2 = grad.reshape(-1, n)
    mm = torch.ops.tvm_gemm.matmul
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:  # dX = dZ @ W
        grad_x = mm(grad2, weight).reshape(x.shape)
    if ctx.needs_input_grad[1]:  # dW = dZ^T @ X
        grad_w = mm(grad2.t(), x.reshape(-1, k))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = grad2.sum(0)
    return grad_x, grad_w, grad_b, None


torch.library.register_autograd("tvm_gemm::linear", _linear_backward, setup_context=_linear_setup)


# --- which impls serve real tensors: C++ (csrc/, the fast path) or the Python ones above ----
#
# The C++ impls (torch_tvm_gemm._C) mirror _matmul_impl / _linear_impl / gemm and call the same
# kernels; they reach Python only on a kernel-table miss (through the tvm-ffi global function
# below) and on bad input (to raise check_matmul / check_linear's own error). Exactly one impl
# is registered per dispatch key; use_impl() switches, for tests and benchmarks.

_cpp_miss = threading.local()  # the miss handler's last exception, per thread
PY_IMPL_KEYS = ("CPU",)  # dispatch keys the Python impls serve
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
):
    """The C++ kernel table's miss handler: every GemmSpec field (k < 0: symbolic K).

    An exception is also kept for ``_reraise_kernel_error`` (same thread): tvm-ffi hands C++
    only its class name and text, and the caller should see the exception itself, as on the
    Python path.
    """
    try:
        return _get_kernel_for_cpp(dtype, n, k, b_layout, bias, activation, variant, device)
    except BaseException as err:
        _cpp_miss.error = err
        raise


def _reraise_kernel_error() -> None:
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
    )
    return get_kernel(spec)


def impl_path() -> str:
    """ "cpp" when the C++ impls serve the ops, else "python"."""
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
            GEMV_MAX_M, list(ACTIVATIONS), [_DTYPE_NAMES[d] for d in SUPPORTED_DTYPES]
        )
        cpp_keys = list(ext.dispatch_keys())
    py_keys = [key for key in PY_IMPL_KEYS if key not in cpp_keys]
    if py_keys:
        _py_impls = torch.library.Library("tvm_gemm", "IMPL")  # noqa: TOR901
        for key in py_keys:
            _py_impls.impl("matmul", _matmul_impl, key)
            _py_impls.impl("linear", _linear_impl, key)
    _impl_path = path
    # Python-side dispatch caches (used under the Python dispatcher, e.g. by AOTAutograd)
    # may still point at the kernels just removed.
    for name in ("matmul", "linear"):
        cache = getattr(getattr(torch.ops.tvm_gemm, name).default, "_dispatch_cache", None)
        if cache is not None:  # a private torch attribute: tolerate its absence
            cache.clear()
    return previous


def _init_impls() -> None:
    ext = _ext.load()
    if ext is not None:
        tvm_ffi.register_global_func("tvm_gemm.get_kernel", _kernel_for_cpp, override=True)
        on_clear_table(ext.clear_table)
    if ext is None or _ext.python_impl_requested():
        use_impl("python")
        return
    try:
        use_impl("cpp")
    except Exception as err:  # e.g. an extension older than this ops.py: keep working
        _ext.warn(f"cannot register the C++ op impls ({err}); using the Python ones")
        use_impl("python")


_init_impls()
