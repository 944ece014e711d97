"""Every torch.library definition of the ``tvm_gemm`` namespace: schemas, device impls,
fake kernels and autograd formulas.

Validation lives in one function per op, shared by the fake kernel (what torch.compile and
opcheck see) and the real impls, so both reject bad input with the same message: it names
the op, the argument and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .kernels.gemm import ACTIVATIONS, GemmSpec
from .runtime import get_kernel, sync_threads
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


CUDA_MIN_CAPABILITY = (7, 0)
_INT32_MAX = 2**31 - 1


def _check_cuda(a: Tensor, b: Tensor, m: int, n: int, k: int) -> None:
    """What the CUDA kernels need beyond the shared checks: a Volta or newer GPU and sizes
    that 32-bit indices address (the kernels index in int32)."""
    major, minor = torch.cuda.get_device_capability(a.device)
    if (major, minor) < CUDA_MIN_CAPABILITY:
        raise RuntimeError(
            f"tvm_gemm: {a.device} ({torch.cuda.get_device_name(a.device)}) is sm_{major}{minor}; "
            "the CUDA kernels need sm_70 (Volta) or newer"
        )
    if max(m * k, n * k, m * n) > _INT32_MAX:
        raise ValueError(
            f"tvm_gemm: CUDA kernels index in 32 bits; a ({m}x{k}) @ ({k}x{n}) problem has an "
            "operand of 2**31 elements or more (split it)"
        )


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
    device = _device_name(a)
    cuda = device == "cuda"
    if a.is_cuda:
        _check_cuda(a, b, m, n, k)
    spec = GemmSpec(
        dtype=_DTYPE_NAMES[a.dtype],
        n=n,
        k=k if static_k or cuda else None,  # CUDA tiles and loads are specialised on K
        b_layout=b_layout,
        bias=bias is not None,
        activation=activation,
        variant="gemv" if m <= GEMV_MAX_M else "gemm",
        device=device,
    )
    kernel = get_kernel(spec)
    args = [a.contiguous(), b.contiguous()]
    if bias is not None:
        args.append(bias.contiguous())
    if a.is_cuda:
        # The kernels use 16-byte vector loads and stores: a view starting mid-vector
        # (a storage offset, a batch slice of `out`) goes through an aligned copy.
        args = [t if t.data_ptr() % 16 == 0 else t.clone() for t in args]
        dest = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
        # tvm_ffi launches on torch's current stream of the tensors' device (it asks torch
        # through DLPack); the kernel sets the CUDA device of its arguments, so keep torch's
        # current device as the caller had it.
        with torch.cuda.device(a.device):
            kernel(*args, dest)
        if dest is not out:
            out.copy_(dest)
    else:
        sync_threads()
        kernel(*args, out)
    return out


def _matmul_2d(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    # A transposed contiguous b (b = w.T, as in a Linear backward) is read in place as "nk".
    if not b.is_contiguous() and b.t().is_contiguous():
        return gemm(a, b.t(), "nk", static_k=False, out=out)
    return gemm(a, b, "kn", static_k=False, out=out)


def _matmul_impl(a: Tensor, b: Tensor) -> Tensor:
    shape = check_matmul(a, b)
    if b.dim() == 2:  # (.., M, K) @ (K, N): one GEMM over all rows
        return _matmul_2d(a.reshape(-1, a.shape[-1]), b).reshape(shape)
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
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return gemm(x2, weight, "nk", bias, activation).reshape(shape)


for _key in ("CPU", "CUDA"):
    LIB.impl("matmul", _matmul_impl, _key)
    LIB.impl("linear", _linear_impl, _key)


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
