"""Validation of the ops' arguments, shared by the fake kernels (what torch.compile and
opcheck see) and the real impls, so that both reject bad input with the same message: it
names the op, the argument and what was expected. The C++ impls raise through these too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.conv2d import ACTIVATIONS as CONV_ACTIVATIONS
from ..kernels.conv2d import is_activation as is_conv_activation
from ..kernels.gemm import ACTIVATIONS

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def require(cond, exc: type[Exception], message: Callable[[], str]) -> None:
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


def check_tensor(op: str, name: str, t: Tensor, ranks: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):  # torch.ops hands a None given for a tensor over as is
        raise TypeError(
            f"tvm_gemm.{op}: argument '{name}' must be a tensor, got {type(t).__name__}"
        )
    require(
        t.dtype in SUPPORTED_DTYPES,
        TypeError,
        lambda: (
            f"tvm_gemm.{op}: argument '{name}' must be float32, float64, bfloat16 or "
            f"float16, got {t.dtype}"
        ),
    )
    require(
        t.dim() in ranks,
        ValueError,
        lambda: (
            f"tvm_gemm.{op}: argument '{name}' must be "
            f"{' or '.join(f'{r}-D' for r in ranks)}, got a {t.dim()}-D tensor of shape "
            f"{tuple(t.shape)}"
        ),
    )


def check_same(op: str, first: tuple[str, Tensor], other: tuple[str, Tensor]) -> None:
    (n1, t1), (n2, t2) = first, other
    require(
        t1.dtype == t2.dtype,
        TypeError,
        lambda: (
            f"tvm_gemm.{op}: argument '{n2}' has dtype {t2.dtype} but '{n1}' has "
            f"{t1.dtype}; mixed dtypes are not supported (convert one of them)"
        ),
    )
    require(
        t1.device == t2.device,
        RuntimeError,
        lambda: (
            f"tvm_gemm.{op}: argument '{n2}' is on {t2.device} but '{n1}' is on "
            f"{t1.device}; all tensors must be on one device"
        ),
    )


def check_matmul(a: Tensor, b: Tensor) -> list[int]:
    """Validate ``matmul(a, b)``; return the output shape."""
    check_tensor("matmul", "a", a, (2, 3))
    check_tensor("matmul", "b", b, (2, 3))
    check_same("matmul", ("a", a), ("b", b))
    require(
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
    require(
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
    require(
        activation in ACTIVATIONS,
        ValueError,
        lambda: (
            f"tvm_gemm.linear: argument 'activation' must be one of {ACTIVATIONS}, "
            f"got {activation!r}"
        ),
    )
    check_tensor("linear", "x", x, tuple(range(1, 9)))
    check_tensor("linear", "weight", weight, (2,))
    check_same("linear", ("x", x), ("weight", weight))
    require(
        x.shape[-1] == weight.shape[1],
        ValueError,
        lambda: (
            f"tvm_gemm.linear: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but "
            f"weight expects {weight.shape[1]} (shape {tuple(weight.shape)} = (out, in))"
        ),
    )
    if bias is not None:
        check_tensor("linear", "bias", bias, (1,))
        check_same("linear", ("x", x), ("bias", bias))
        require(
            bias.shape[0] == weight.shape[0],
            ValueError,
            lambda: (
                f"tvm_gemm.linear: argument 'bias' must have shape ({weight.shape[0]},) "
                f"to match weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
            ),
        )
    return [*x.shape[:-1], weight.shape[0]]


# --- CUDA ------------------------------------------------------------------------------------

CUDA_MIN_CAPABILITY = (7, 0)
INT32_MAX = 2**31 - 1


def check_cuda_arch(a: Tensor) -> tuple[int, int]:
    """The CUDA kernels need a Volta or newer GPU. Returns its capability."""
    major, minor = torch.cuda.get_device_capability(a.device)
    if (major, minor) < CUDA_MIN_CAPABILITY:
        raise RuntimeError(
            f"tvm_gemm: {a.device} ({torch.cuda.get_device_name(a.device)}) is sm_{major}{minor}; "
            "the CUDA kernels need sm_70 (Volta) or newer"
        )
    return major, minor


def check_cuda_gemm(a: Tensor, b: Tensor, m: int, n: int, k: int) -> tuple[int, int]:
    """What the CUDA kernels need beyond the shared checks: a Volta or newer GPU and sizes
    that 32-bit indices address (the kernels index in int32). Returns the capability."""
    major, minor = check_cuda_arch(a)
    if max(m * k, n * k, m * n) > INT32_MAX:
        raise ValueError(
            f"tvm_gemm: CUDA kernels index in 32 bits; a ({m}x{k}) @ ({k}x{n}) problem has an "
            "operand of 2**31 elements or more (split it)"
        )
    return major, minor


TF32_MIN_CAPABILITY = (8, 0)  # mma.sync with .tf32 operands: Ampere and newer


def use_tf32(a: Tensor) -> bool:
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


# --- conv2d -----------------------------------------------------------------------------------

CONV = "conv2d_bias_relu"


def pair(op: str, name: str, value, minimum: int) -> tuple[int, int]:
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


def conv_activation(relu: bool, activation: str | None) -> str:
    """The conv's epilogue: ``activation`` when given (it replaces ``relu``), else relu or none."""
    if activation is None:
        return "relu" if relu else "none"
    torch._check_value(
        is_conv_activation(activation),
        lambda: (
            f"tvm_gemm.{CONV}: argument 'activation' must be one of "
            f"{', '.join(CONV_ACTIVATIONS)}, leaky_relu_<slope> for another slope >= 0 "
            f"(written as Python prints the float: leaky_relu_0.1), or None (relu "
            f"decides), got {activation!r}"
        ),
    )
    return activation


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
    op = CONV
    check_tensor(op, "x", x, (4,))
    check_tensor(op, "weight", weight, (4,))
    check_same(op, ("x", x), ("weight", weight))
    stride = pair(op, "stride", stride, 1)
    padding = pair(op, "padding", padding, 0)
    dilation = pair(op, "dilation", dilation, 1)
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
        check_tensor(op, "bias", bias, (1,))
        check_same(op, ("x", x), ("bias", bias))
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
