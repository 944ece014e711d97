"""Every torch.library definition of the ``tvm_gemm`` namespace: schemas, device impls,
fake kernels and autograd formulas.

Validation lives in one function per op, shared by the fake kernel (what torch.compile and
opcheck see) and the real impls, so both reject bad input with the same message: it names
the op, the argument and what was expected.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable

import torch
import tvm_ffi
from torch import Tensor

from . import _ext
from .func_autograd import register_function_autograd
from .kernels.gemm import ACTIVATIONS, GemmSpec, torch_activation
from .runtime.loader import sync_threads
from .runtime.table import get_kernel, on_clear_table
from .schedules.cpu import DOT_MAX_M, GEMV_MAX_M, GEMV_MIN_B_ELEMENTS, gemm_variant

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


def _require(cond, exc: type[Exception], message: Callable[[], str]) -> None:
    """Raise ``exc(message())`` unless ``cond``.

    A plain bool (real tensors) is tested directly, the hot path; a SymBool (fake tensors
    under torch.compile with dynamic shapes) goes through ``torch._check_with``, which
    records it as a runtime assertion instead of specialising the graph.
    """
    if cond is True:
        return
    if cond is False:
        raise exc(message())
    torch._check_with(exc, cond, message)


def _check_tensor(op: str, name: str, t: Tensor, ranks: tuple[int, ...]) -> None:
    _require(
        t.dtype in SUPPORTED_DTYPES,
        TypeError,
        lambda: (
            f"tvm_gemm.{op}: argument '{name}' must be float32, float64, bfloat16 or "
            f"float16, got {t.dtype}"
        ),
    )
    _require(
        t.dim() in ranks,
        ValueError,
        lambda: (
            f"tvm_gemm.{op}: argument '{name}' must be "
            f"{' or '.join(f'{r}-D' for r in ranks)}, got a {t.dim()}-D tensor of shape "
            f"{tuple(t.shape)}"
        ),
    )


def _check_same(op: str, first: tuple[str, Tensor], other: tuple[str, Tensor]) -> None:
    (n1, t1), (n2, t2) = first, other
    _require(
        t1.dtype == t2.dtype,
        TypeError,
        lambda: (
            f"tvm_gemm.{op}: argument '{n2}' has dtype {t2.dtype} but '{n1}' has "
            f"{t1.dtype}; mixed dtypes are not supported (convert one of them)"
        ),
    )
    _require(
        t1.device == t2.device,
        RuntimeError,
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
    _require(
        a.shape[-1] == b.shape[-2],
        ValueError,
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
    _require(
        ba == bb or ba == 1 or bb == 1,
        ValueError,
        lambda: (
            f"tvm_gemm.matmul: batch dims of a {tuple(a.shape)} and b {tuple(b.shape)} "
            "cannot be broadcast"
        ),
    )
    return [bb if ba == 1 else ba, m, n]


def check_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> list[int]:
    """Validate ``linear(x, weight, bias, activation)``; return the output shape."""
    _require(
        activation in ACTIVATIONS,
        ValueError,
        lambda: (
            f"tvm_gemm.linear: argument 'activation' must be one of {ACTIVATIONS}, "
            f"got {activation!r}"
        ),
    )
    _check_tensor("linear", "x", x, tuple(range(1, 9)))
    _check_tensor("linear", "weight", weight, (2,))
    _check_same("linear", ("x", x), ("weight", weight))
    _require(
        x.shape[-1] == weight.shape[1],
        ValueError,
        lambda: (
            f"tvm_gemm.linear: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but "
            f"weight expects {weight.shape[1]} (shape {tuple(weight.shape)} = (out, in))"
        ),
    )
    if bias is not None:
        _check_tensor("linear", "bias", bias, (1,))
        _check_same("linear", ("x", x), ("bias", bias))
        _require(
            bias.shape[0] == weight.shape[0],
            ValueError,
            lambda: (
                f"tvm_gemm.linear: argument 'bias' must have shape ({weight.shape[0]},) "
                f"to match weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
            ),
        )
    return [*x.shape[:-1], weight.shape[0]]


# --- the kernel call ------------------------------------------------------------------------


def _device_name(t: Tensor) -> str:
    return "cuda" if t.is_cuda else "cpu"


# Interned specs: a call reuses the spec object rather than building and validating a new one.
_spec = functools.lru_cache(maxsize=4096)(GemmSpec)


CUDA_MIN_CAPABILITY = (7, 0)
_INT32_MAX = 2**31 - 1


def _check_cuda_arch(a: Tensor) -> tuple[int, int]:
    """The CUDA kernels need a Volta or newer GPU. Returns its capability."""
    major, minor = torch.cuda.get_device_capability(a.device)
    if (major, minor) < CUDA_MIN_CAPABILITY:
        raise RuntimeError(
            f"tvm_gemm: {a.device} ({torch.cuda.get_device_name(a.device)}) is sm_{major}{minor}; "
            "the CUDA kernels need sm_70 (Volta) or newer"
        )
    return major, minor


def _check_cuda(a: Tensor, b: Tensor, m: int, n: int, k: int) -> tuple[int, int]:
    """What the CUDA kernels need beyond the shared checks: a Volta or newer GPU and sizes
    that 32-bit indices address (the kernels index in int32). Returns the capability."""
    major, minor = _check_cuda_arch(a)
    if max(m * k, n * k, m * n) > _INT32_MAX:
        raise ValueError(
            f"tvm_gemm: CUDA kernels index in 32 bits; a ({m}x{k}) @ ({k}x{n}) problem has an "
            "operand of 2**31 elements or more (split it)"
        )
    return major, minor


TF32_MIN_CAPABILITY = (8, 0)  # mma.sync with .tf32 operands: Ampere and newer


def _use_tf32(a: Tensor) -> bool:
    """Whether an fp32 product on ``a``'s GPU runs on tensor cores with TF32 inputs now."""
    return torch.cuda.get_device_capability(a.device) >= TF32_MIN_CAPABILITY and tf32_allowed()


def tf32_allowed() -> bool:
    """Whether fp32 GEMMs may use TF32 now, as torch decides for its own matmuls:
    ``torch.backends.cuda.matmul.allow_tf32`` (read at every call, so toggling it switches
    kernels). Torch raises on reading it after the newer ``fp32_precision`` API was used;
    that setting then says the same."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return getattr(matmul, "fp32_precision", "ieee") == "tf32"


def gemm(
    a: Tensor,
    b: Tensor,
    b_layout: str,
    bias: Tensor | None = None,
    activation: str = "none",
    static_k: bool = True,
    out: Tensor | None = None,
    bias_axis: str = "n",
) -> Tensor:
    """``act(a @ B + bias)`` for a 2-D ``a``; B is ``b`` (layout "kn") or ``b.T`` ("nk"); the
    bias is one per column (``bias_axis="n"``) or one per row ("m").

    Handles what the kernels do not: empty dims, non-contiguous inputs.
    """
    m, k = a.shape
    n = b.shape[1] if b_layout == "kn" else b.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: the result is act(bias) or act(0)
        row_bias = bias is not None and bias_axis == "m"
        zero = (
            (bias[:, None] if row_bias else bias).expand(m, n)
            if bias is not None
            else torch.zeros_like(out)
        )
        return out.copy_(torch_activation(activation)(zero))
    device = _device_name(a)
    cuda = device == "cuda"
    if a.is_cuda:
        _check_cuda(a, b, m, n, k)
    spec = _spec(
        _DTYPE_NAMES[a.dtype],
        n,
        k if static_k or cuda else None,  # CUDA tiles and loads are specialised on K
        b_layout,
        bias is not None,
        activation,
        gemm_variant(m, n, k, b_layout, device),
        device,
        bias_axis,
        cuda and a.dtype == torch.float32 and _use_tf32(a),
    )
    args = [a.contiguous(), b.contiguous()]
    if bias is not None:
        args.append(bias.contiguous())
    args = [_aligned(t) for t in args]
    dest = _aligned(out, copy=False)
    if a.is_cuda:
        # The tensors' GPU is the current device while the kernel is looked up (its arch
        # picks the schedule: WMMA on sm_70/75, mma.sync on sm_80+; see runtime.get_kernel)
        # and launched: tvm_ffi launches on torch's current stream of that device (it asks
        # torch through DLPack). The caller's current device is restored afterwards.
        with torch.cuda.device(a.device):
            get_kernel(spec)(*args, dest)
    else:
        kernel = get_kernel(spec)
        sync_threads()
        kernel(*args, dest)
    if dest is not out:
        out.copy_(dest)
    return out


# TVM kernels assume that each buffer starts on a boundary: 64 bytes on the CPU (TVM's
# allocation alignment; seen: a batch slice of B at a 660-byte offset crashed the packed
# kernel), 16 bytes for the CUDA kernels' vector accesses. A view that starts elsewhere (a
# storage offset, a batch slice) goes through a fresh, aligned tensor.
_ALIGNMENT = {"cpu": 64, "cuda": 16}


def _aligned(t: Tensor, copy: bool = True) -> Tensor:
    """``t`` if it starts on its device's kernel alignment, else a fresh tensor (a copy of
    ``t`` with ``copy``; uninitialised for an output that is copied back afterwards)."""
    if t.data_ptr() % _ALIGNMENT[_device_name(t)] == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format) if copy else torch.empty_like(t)


def _rows(t: Tensor) -> Tensor:
    """``t`` as a 2-D (rows, last dim) matrix (reshape(-1, 0) is ambiguous when empty)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _matmul_2d(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    # A transposed contiguous b (b = w.T, as in a Linear backward) is read in place as "nk".
    if not b.is_contiguous() and b.t().is_contiguous():
        return gemm(a, b.t(), "nk", static_k=False, out=out)
    return gemm(a, b, "kn", static_k=False, out=out)


def _matmul_impl(a: Tensor, b: Tensor) -> Tensor:
    shape = check_matmul(a, b)
    if b.dim() == 2:  # (.., M, K) @ (K, N): one GEMM over all rows
        return _matmul_2d(_rows(a), b).reshape(shape)
    if b.shape[0] == 1:  # one B for the whole batch: one GEMM over all rows of a
        return _matmul_2d(_rows(a), b[0]).reshape(shape)
    if not a.is_cuda:
        return _matmul_batched(a, b, shape)
    batch, m, n = shape
    a3 = a.expand(batch, m, a.shape[-1])
    out = torch.empty(shape, dtype=a.dtype, device=a.device)
    for i in range(batch):  # CUDA: one kernel call per batch entry, each a full GEMM
        _matmul_2d(a3[i], b[i], out=out[i])
    return out


def _matmul_batched(a: Tensor, b: Tensor, shape: list[int]) -> Tensor:
    """CPU ``(batch, M, K) @ (batch, K, N)`` (a may be broadcast) as one kernel launch, the
    batch a parallel axis. A batch of transposed contiguous matrices (``k.transpose(1, 2)``
    in attention) is read in place as "nk"."""
    batch, m, n = shape
    k = a.shape[-1]
    out = torch.empty(shape, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    a3 = a.expand(batch, m, k).contiguous()
    nk = not b.is_contiguous() and b.transpose(1, 2).is_contiguous()
    b3 = b.transpose(1, 2) if nk else b.contiguous()
    spec = _spec(_DTYPE_NAMES[a.dtype], n, None, "nk" if nk else "kn", False, "none", "gemm",
                 "cpu", "n", False, True)  # fmt: skip
    kernel = get_kernel(spec)
    sync_threads()
    kernel(_aligned(a3), _aligned(b3), out)  # out: fresh, hence aligned
    return out


def _linear_impl(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "none"
) -> Tensor:
    shape = check_linear(x, weight, bias, activation)
    # A weight that is the transpose of a contiguous (in, out) matrix (transformers' Conv1D
    # passes weight.t()) is read in place with the "kn" layout: no copy per call.
    if not weight.is_contiguous() and weight.t().is_contiguous():
        return gemm(_rows(x), weight.t(), "kn", bias, activation).reshape(shape)
    return gemm(_rows(x), weight, "nk", bias, activation).reshape(shape)


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
            grad_b = mm(_rows(a).t(), _rows(grad))
        else:
            grad_b = mm(a.transpose(-1, -2), grad).sum_to_size(ctx.b_shape)
    return grad_a, grad_b


def _matmul_jvp(ctx, inputs, output, tangent_a, tangent_b):
    """Forward-mode: d(a @ b) = da @ b + a @ db."""
    a, b = inputs
    mm = torch.ops.tvm_gemm.matmul
    parts = []
    if tangent_a is not None:
        parts.append(mm(tangent_a, b))
    if tangent_b is not None:
        parts.append(mm(a, tangent_b))
    return _sum_tangents(parts, output)


def _sum_tangents(parts: list[Tensor], output: Tensor) -> Tensor:
    total = torch.zeros_like(output) if not parts else parts[0]
    for part in parts[1:]:
        total = total + part
    return total.expand_as(output) if total.shape != output.shape else total


register_function_autograd("matmul", _matmul_backward, _matmul_setup, _matmul_jvp)


def _gelu_grad(z: Tensor) -> Tensor:
    """d/dz of the exact GELU: Phi(z) + z * phi(z)."""
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


# d act(z) / dz applied to the incoming gradient, from the pre-activation z (torch's own
# backward formulas, so the gradients match F.gelu(approximate="tanh") / F.silu exactly).
_PRE_ACTIVATION_GRADS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "gelu": lambda grad, z: grad * _gelu_grad(z),
    "gelu_tanh": lambda grad, z: torch.ops.aten.gelu_backward(grad, z, approximate="tanh"),
    "silu": lambda grad, z: torch.ops.aten.silu_backward(grad, z),
}


def _linear_setup(ctx, inputs, output) -> None:
    # Trailing arguments equal to their defaults may be left out by the dispatcher.
    x, weight, bias, activation = (list(inputs) + [None, "none"][len(inputs) - 2 :])[:4]
    ctx.activation = activation
    ctx.has_bias = bias is not None
    ctx.x_shape = x.shape
    need_x, need_w = ctx.needs_input_grad[:2]
    # Only what the backward needs is kept (an inference tensor cannot be saved at all, and
    # torch accepts one where it is not needed). relu's derivative needs only the output;
    # the others need the pre-activation, recomputed in the backward from x, weight and bias
    # rather than kept alive between forward and backward.
    if activation in _PRE_ACTIVATION_GRADS:
        ctx.save_for_backward(_saveable(x), _saveable(weight), _saveable(bias), None)
    else:
        ctx.save_for_backward(
            x if need_w else None,
            weight if need_x else None,
            None,
            output if activation == "relu" else None,
        )


def _saveable(t: Tensor | None) -> Tensor | None:
    """``t``, or a normal copy of an inference tensor (those cannot be saved for backward):
    where torch saves the pre-activation of a GELU, a normal tensor, we keep its inputs."""
    return t.clone() if t is not None and t.is_inference() else t


def _linear_backward(ctx, grad: Tensor):
    x, weight, bias, output = ctx.saved_tensors
    if ctx.activation == "relu":
        grad = grad * (output > 0)
    elif ctx.activation in _PRE_ACTIVATION_GRADS:
        z = torch.ops.tvm_gemm.linear(x, weight, bias, "none")
        grad = _PRE_ACTIVATION_GRADS[ctx.activation](grad, z)
    grad2 = _rows(grad)
    mm = torch.ops.tvm_gemm.matmul
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:  # dX = dZ @ W
        grad_x = mm(grad2, weight).reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:  # dW = dZ^T @ X
        grad_w = mm(grad2.t(), _rows(x))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = grad2.sum(0)
    return grad_x, grad_w, grad_b, None


def _linear_jvp(ctx, inputs, output, tangent_x, tangent_w, tangent_b, _):
    """Forward-mode: dz = dx @ W^T + x @ dW^T + db, then through the activation."""
    x, weight, bias, activation = (list(inputs) + [None, "none"][len(inputs) - 2 :])[:4]
    lin = torch.ops.tvm_gemm.linear
    parts = []
    if tangent_x is not None:
        parts.append(lin(tangent_x, weight, None, "none"))
    if tangent_w is not None:
        parts.append(lin(x, tangent_w, None, "none"))
    if tangent_b is not None:
        parts.append(tangent_b.expand_as(output))
    dz = _sum_tangents(parts, output)
    if activation == "relu":
        return dz * (output > 0)
    if activation in _PRE_ACTIVATION_GRADS:
        return _PRE_ACTIVATION_GRADS[activation](dz, lin(x, weight, bias, "none"))
    return dz


register_function_autograd("linear", _linear_backward, _linear_setup, _linear_jvp)


# --- conv2d + bias + relu -------------------------------------------------------------------
# One section for the conv op (schema, validation, CPU impl, fake kernel, autograd), kept
# together so that it merges apart from the GEMM ops above.

from .kernels.conv2d import Conv2dSpec, pack_weight  # noqa: E402
from .schedules.cpu_conv2d import pointwise_as_gemm, weight_block  # noqa: E402

LIB.define(
    "conv2d_bias_relu(Tensor x, Tensor weight, Tensor? bias, int[2] stride=1, "
    "int[2] padding=0, int[2] dilation=1, int groups=1, bool relu=True) -> Tensor"
)

_CONV = "conv2d_bias_relu"
_conv_spec = functools.lru_cache(maxsize=4096)(Conv2dSpec)  # one spec object per geometry


def _pair(op: str, name: str, value, minimum: int) -> tuple[int, int]:
    """``value`` (an int or a sequence of 2 ints) as a pair, each at least ``minimum``."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    torch._check_value(
        len(pair) == 2 and all(isinstance(v, int) and v >= minimum for v in pair),
        lambda: (
            f"tvm_gemm.{op}: argument '{name}' must be an int or 2 ints, each >= {minimum}, "
            f"got {value}"
        ),
    )
    return pair


def check_conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride,
    padding,
    dilation,
    groups: int,
) -> list[int]:
    """Validate ``conv2d_bias_relu``; return the output shape ``[N, K, OH, OW]``."""
    op = _CONV
    _check_tensor(op, "x", x, (4,))
    _check_tensor(op, "weight", weight, (4,))
    _check_same(op, ("x", x), ("weight", weight))
    stride = _pair(op, "stride", stride, 1)
    padding = _pair(op, "padding", padding, 0)
    dilation = _pair(op, "dilation", dilation, 1)
    k, cg, r, s = weight.shape
    torch._check_value(
        isinstance(groups, int) and groups >= 1 and k % groups == 0,
        lambda: (
            f"tvm_gemm.{op}: argument 'groups' must be a positive divisor of the "
            f"{k} output channels of weight {tuple(weight.shape)}, got {groups}"
        ),
    )
    torch._check_value(
        x.shape[1] == cg * groups,
        lambda: (
            f"tvm_gemm.{op}: given groups={groups}, weight of shape {tuple(weight.shape)} "
            f"expects x to have {cg * groups} channels, but x {tuple(x.shape)} has "
            f"{x.shape[1]} (x is (N, C, H, W), weight (K, C/groups, R, S))"
        ),
    )
    if bias is not None:
        _check_tensor(op, "bias", bias, (1,))
        _check_same(op, ("x", x), ("bias", bias))
        torch._check_value(
            bias.shape[0] == k,
            lambda: (
                f"tvm_gemm.{op}: argument 'bias' must have shape ({k},), one value per "
                f"output channel of weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
            ),
        )
    out_hw = []
    for dim, size, kernel in ((0, x.shape[2], r), (1, x.shape[3], s)):
        extent = dilation[dim] * (kernel - 1) + 1
        padded = size + 2 * padding[dim]
        torch._check_value(
            padded >= extent,
            lambda size=size, kernel=kernel, dim=dim, padded=padded, extent=extent: (
                f"tvm_gemm.{op}: the output would be empty: x {tuple(x.shape)} padded by "
                f"padding={list(padding)} has {'height' if dim == 0 else 'width'} {padded}, "
                f"smaller than the kernel's {kernel} taps at dilation={list(dilation)} "
                f"({extent})"
            ),
        )
        out_hw.append((padded - extent) // stride[dim] + 1)
    # Without input channels torch returns no output channels either (not relu(bias)).
    return [x.shape[0], k if x.shape[1] else 0, *out_hw]


def conv2d_spec(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride,
    padding,
    dilation,
    groups: int,
    relu: bool,
    device: str | None = None,
) -> Conv2dSpec:
    """The kernel a validated call asks for, on ``device`` (default: x's; ``cuda_cases``
    asks for the CUDA kernel of meta tensors)."""
    _, c, h, w = x.shape
    k, _, r, s = weight.shape
    return _conv_spec(
        dtype=_DTYPE_NAMES[x.dtype],
        c=c,
        k=k,
        r=r,
        s=s,
        h=h,
        w=w,
        stride=_pair(_CONV, "stride", stride, 1),
        padding=_pair(_CONV, "padding", padding, 0),
        dilation=_pair(_CONV, "dilation", dilation, 1),
        groups=groups,
        bias=bias is not None,
        relu=relu,
        device=device or _device_name(x),
    )


def _conv2d_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int = 1,
    relu: bool = True,
) -> Tensor:
    shape = check_conv2d(x, weight, bias, stride, padding, dilation, groups)
    # The kernel writes NCHW; channels_last / strided inputs are copied to NCHW first.
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:  # (no input channels included: check_conv2d)
        return out
    spec = conv2d_spec(x, weight, bias, stride, padding, dilation, groups, relu)
    if pointwise_as_gemm(spec):
        return _pointwise_conv(x, weight, bias, relu, out)
    kernel = get_kernel(spec)
    sync_threads()
    kb = weight_block(spec)
    w_arg = weight.contiguous() if kb is None else _packed_weight(weight, kb, spec.acc_dtype)
    args = [x.contiguous(), w_arg]
    if bias is not None:
        args.append(bias.contiguous())
    kernel(*[_aligned(t) for t in args], out)  # out: fresh, hence aligned
    return out


def _pointwise_conv(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool, out: Tensor):
    """A 1x1 conv as one GEMM per image, ``out[n] = relu(W @ x[n] + bias[:, None])`` over
    the flattened pixels (``schedules/cpu_conv2d.pointwise_as_gemm`` says when and why)."""
    n, c = x.shape[:2]
    k = weight.shape[0]
    w = weight.reshape(k, c)
    pixels = x.contiguous().view(n, c, -1)
    dest = out.view(n, k, -1)
    for i in range(n):
        gemm(w, pixels[i], "kn", bias, "relu" if relu else "none", out=dest[i], bias_axis="m")
    return out


def _packed_weight(weight: Tensor, kb: int, acc_dtype: str) -> Tensor:
    """``weight`` in the blocked kernels' layout, packed at every call.

    Not cached across calls: no key sees every change of a weight (a write through
    ``weight.data`` or a numpy view leaves ``_version`` as it was), and checking a cached
    pack against the weight's content costs a pass over the weight, as packing does. oneDNN
    reorders the weight of an eager ``F.conv2d`` at every call too.
    """
    return pack_weight(weight, kb, getattr(torch, acc_dtype))


LIB.impl(_CONV, _conv2d_impl, "CPU")


# CUDA: an implicit GEMM on tensor cores (kernels/conv2d_cuda.py) over an NHWC input and a
# (K, R*S*C) weight. The op stays NCHW: a channels_last x (the layout tensor-core convs want)
# is NHWC already, so it costs no copy and gives a channels_last output, as F.conv2d does;
# a contiguous x is permuted to NHWC first and the output copied back to contiguous NCHW.


def _cuda_channels_last(x: Tensor) -> bool:
    """Whether the CUDA impl returns a channels_last output for ``x`` (the fake kernel too)."""
    return (
        x.is_cuda
        and x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
    )


def _conv2d_cuda_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int = 1,
    relu: bool = True,
) -> Tensor:
    shape = check_conv2d(x, weight, bias, stride, padding, dilation, groups)
    if groups != 1:
        raise NotImplementedError(
            f"tvm_gemm.{_CONV}: argument 'groups' must be 1 on CUDA, got {groups} (grouped "
            "and depthwise convolutions have CPU kernels only; use F.conv2d on the GPU)"
        )
    _check_cuda_arch(x)
    n, k, oh, ow = shape
    if max(x.numel(), math.prod(shape), weight.numel()) > _INT32_MAX:
        raise ValueError(
            f"tvm_gemm.{_CONV}: CUDA kernels index in 32 bits; x {tuple(x.shape)} with weight "
            f"{tuple(weight.shape)} has a tensor of 2**31 elements or more (split the batch)"
        )
    channels_last = _cuda_channels_last(x)
    # The kernel writes NHWC: ``nhwc`` is its output, ``out`` the same memory as N, K, OH, OW.
    nhwc = torch.empty((n, oh, ow, k), dtype=x.dtype, device=x.device)
    out = nhwc.permute(0, 3, 1, 2)
    if out.numel() != 0:  # (no input channels: no output channels, see check_conv2d)
        spec = conv2d_spec(x, weight, bias, stride, padding, dilation, 1, relu, device="cuda")
        kernel = get_kernel(spec)
        x_nhwc = x.permute(0, 2, 3, 1).contiguous()  # a view of a channels_last x: no copy
        args = [x_nhwc, _weight_krsc(weight)]  # (at every call: see _packed_weight)
        if bias is not None:
            args.append(bias.contiguous())
        with torch.cuda.device(x.device):  # (as in gemm: tvm_ffi uses torch's current stream)
            kernel(*[_aligned(t) for t in args], nhwc.view(n * oh * ow, k))
    return out if channels_last else out.contiguous()


def _weight_krsc(weight: Tensor) -> Tensor:
    """The CUDA kernels' B operand: ``(K, C, R, S)`` -> ``(K, R*S*C)``, channels fastest."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1).contiguous()


LIB.impl(_CONV, _conv2d_cuda_impl, "CUDA")


@torch.library.register_fake("tvm_gemm::conv2d_bias_relu")
def _conv2d_fake(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int = 1,
    relu: bool = True,
) -> Tensor:
    shape = check_conv2d(x, weight, bias, stride, padding, dilation, groups)
    if _cuda_channels_last(x):
        return x.new_empty(shape, memory_format=torch.channels_last)
    return x.new_empty(shape)


_CONV_DEFAULTS = [None, [1, 1], [0, 0], [1, 1], 1, True]  # bias ... relu


def _conv2d_setup(ctx, inputs, output) -> None:
    # Trailing arguments equal to their defaults may be left out by the dispatcher.
    x, weight, bias, stride, padding, dilation, groups, relu = (
        list(inputs) + _CONV_DEFAULTS[len(inputs) - 2 :]
    )[:8]
    ctx.geometry = (
        list(_pair(_CONV, "stride", stride, 1)),
        list(_pair(_CONV, "padding", padding, 0)),
        list(_pair(_CONV, "dilation", dilation, 1)),
        groups,
    )
    ctx.bias_sizes = None if bias is None else list(bias.shape)
    ctx.x_shape, ctx.w_shape = x.shape, weight.shape
    need_x, need_w = ctx.needs_input_grad[:2]
    # Only what the backward needs (an inference tensor cannot be saved; torch accepts one
    # where no gradient needs it): dX needs the weight, dW the input, relu's derivative only
    # the output (the pre-activation is never kept).
    ctx.save_for_backward(
        x if need_w else None, weight if need_x else None, output if relu else None
    )


def _conv2d_backward(ctx, grad: Tensor):
    x, weight, output = ctx.saved_tensors
    if output is not None:
        grad = grad * (output > 0)
    # An operand whose values no requested gradient reads is passed as a shape only, as
    # torch.nn.grad.conv2d_input / conv2d_weight do.
    if x is None:
        x = grad.new_empty(1).expand(ctx.x_shape)
    if weight is None:
        weight = grad.new_empty(1).expand(ctx.w_shape)
    stride, padding, dilation, groups = ctx.geometry
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad,
        x,
        weight,
        ctx.bias_sizes,
        stride,
        padding,
        dilation,
        False,  # transposed
        [0, 0],  # output_padding
        groups,
        [need_x, need_w, need_b and ctx.bias_sizes is not None],
    )
    return grad_x, grad_w, grad_b, None, None, None, None, None


def _conv2d_jvp(ctx, inputs, output, tangent_x, tangent_w, tangent_b, *_):
    """Forward-mode: conv(dx, W) + conv(x, dW) + db, masked by the ReLU."""
    x, weight = inputs[0], inputs[1]
    stride, padding, dilation, groups = ctx.geometry
    conv = torch.nn.functional.conv2d
    parts = []
    if tangent_x is not None:
        parts.append(conv(tangent_x, weight, None, stride, padding, dilation, groups))
    if tangent_w is not None:
        parts.append(conv(x, tangent_w, None, stride, padding, dilation, groups))
    if tangent_b is not None:
        parts.append(tangent_b.view(1, -1, 1, 1).expand_as(output))
    dz = _sum_tangents(parts, output)
    relu = (list(inputs) + _CONV_DEFAULTS[len(inputs) - 2 :])[7]
    return dz * (output > 0) if relu else dz


register_function_autograd("conv2d_bias_relu", _conv2d_backward, _conv2d_setup, _conv2d_jvp)


# --- which impls serve real tensors: C++ (csrc/, the fast path) or the Python ones above ----
#
# The C++ impls (torch_tvm_gemm._C) mirror _matmul_impl / _linear_impl / gemm and call the same
# kernels; they reach Python only on a kernel-table miss (through the tvm-ffi global function
# below) and on bad input (to raise check_matmul / check_linear's own error). Exactly one impl
# is registered per dispatch key; use_impl() switches, for tests and benchmarks.

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

    An exception is also kept for ``_reraise_kernel_error`` (same thread): tvm-ffi hands C++
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
            [_DTYPE_NAMES[d] for d in SUPPORTED_DTYPES],
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
