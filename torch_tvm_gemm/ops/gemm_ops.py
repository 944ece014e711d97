"""The GEMM ops, ``tvm_gemm::matmul`` and ``tvm_gemm::linear``: the one function that
decides which kernel a call needs (``gemm_spec``), the Python impls, fake kernels and
autograd formulas. (The C++ impls in csrc/ mirror the impls here; ``impls.py`` picks.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..func_autograd import register_function_autograd
from ..kernels.gemm import GemmSpec, torch_activation
from ..runtime import output_pool
from ..runtime.loader import sync_threads
from ..runtime.table import get_kernel
from ..schedules.cpu import gemm_variant
from . import schemas  # noqa: F401 (the schemas are defined before their kernels)
from .checks import (
    DTYPE_NAMES,
    check_cuda_gemm,
    check_linear,
    check_matmul,
    tf32_allowed,
    use_tf32,
)
from .plan import Plan
from .plan import active as active_plan


def device_name(t: Tensor) -> str:
    return "cuda" if t.is_cuda else "cpu"


def kernel_device(t: Tensor) -> str:
    """The device whose kernels a call on ``t`` uses: t's, or the one being planned for."""
    found = active_plan()
    return device_name(t) if found is None else found.device_for(device_name(t))


# Interned specs: a call reuses the spec object rather than building and validating a new one.
_spec = functools.lru_cache(maxsize=4096)(GemmSpec)


def gemm_spec(
    dtype: str,
    m: int,
    n: int,
    k: int,
    b_layout: str,
    *,
    bias: bool = False,
    activation: str = "none",
    device: str = "cpu",
    static_k: bool = True,
    bias_axis: str = "n",
    tf32: bool = False,
    batched: bool = False,
) -> GemmSpec:
    """The kernel an ``(m, k) @ B`` product needs (B ``(k, n)`` for layout "kn", ``(n, k)``
    for "nk"): the one rule, used by the impls, ``tune``, ``compile`` and the GPU case table.

    K is part of the kernel when ``static_k`` (a Linear's weight), else symbolic (matmul of
    two activations: a backward's dW reduces over the batch); CUDA kernels always fix K
    (their tiles and loads are specialised on it). The variant follows M
    (``schedules/cpu.py`` ``gemm_variant``); a batched kernel has one variant.
    """
    cuda = device == "cuda"
    variant = "gemm" if batched else gemm_variant(m, n, k, b_layout, device, dtype, static_k)
    return _spec(
        dtype,
        n,
        k if static_k or cuda else None,
        b_layout,
        bias,
        activation,
        variant,
        device,
        bias_axis,
        tf32,
        batched,
    )


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
        out = output_pool.empty((m, n), a.dtype, a.device)
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
    found = active_plan()
    device = kernel_device(a)
    cuda = device == "cuda"
    if a.is_cuda:
        check_cuda_gemm(a, b, m, n, k)
    spec = gemm_spec(
        DTYPE_NAMES[a.dtype],
        m,
        n,
        k,
        b_layout,
        bias=bias is not None,
        activation=activation,
        device=device,
        static_k=static_k,
        bias_axis=bias_axis,
        tf32=cuda and a.dtype == torch.float32 and _tf32(a, found),
    )
    if found is not None:
        found.record(spec)
        return _planned_gemm(found, a, b, b_layout, bias, activation, bias_axis, out)
    args = [a.contiguous(), b.contiguous()]
    if bias is not None:
        args.append(bias.contiguous())
    args = [aligned(t) for t in args]
    dest = aligned(out, copy=False)
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


def _tf32(a: Tensor, found: Plan | None) -> bool:
    """Whether an fp32 CUDA product takes the TF32 kernel (planned on CPU tensors: as torch's
    flag says, for an sm_80+ GPU)."""
    if found is not None and found.tf32 is not None:
        return found.tf32
    return use_tf32(a) if a.is_cuda else tf32_allowed()


def _planned_gemm(
    found: Plan,
    a: Tensor,
    b: Tensor,
    b_layout: str,
    bias: Tensor | None,
    activation: str,
    bias_axis: str,
    out: Tensor,
) -> Tensor:
    """A planned call's result (ops/plan.py): torch's, or ``out`` untouched."""
    if found.compute:
        z = a @ (b if b_layout == "kn" else b.t())
        if bias is not None:
            z = z + (bias[:, None] if bias_axis == "m" else bias)
        out.copy_(torch_activation(activation)(z))
    return out


# TVM kernels assume that each buffer starts on a boundary: 64 bytes on the CPU (TVM's
# allocation alignment; seen: a batch slice of B at a 660-byte offset crashed the packed
# kernel), 16 bytes for the CUDA kernels' vector accesses. A view that starts elsewhere (a
# storage offset, a batch slice) goes through a fresh, aligned tensor. The C++ impls get the
# CPU value at registration (ops/impls.py).
KERNEL_ALIGNMENT = {"cpu": 64, "cuda": 16}


def aligned(t: Tensor, copy: bool = True) -> Tensor:
    """``t`` if it starts on its device's kernel alignment, else a fresh tensor (a copy of
    ``t`` with ``copy``; uninitialised for an output that is copied back afterwards)."""
    if t.data_ptr() % KERNEL_ALIGNMENT[device_name(t)] == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format) if copy else torch.empty_like(t)


def rows(t: Tensor) -> Tensor:
    """``t`` as a 2-D (rows, last dim) matrix (reshape(-1, 0) is ambiguous when empty)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def shaped_output(shape: list[int], like: Tensor) -> tuple[Tensor, Tensor]:
    """(the op's output, its rows as the 2-D matrix the kernel writes). The output is the
    allocation itself, not a view of a 2-D result: autograd refuses in-place writes into a
    view made inside an op (``hidden[mask] = ...`` after a Linear, as wav2vec2 does)."""
    out = output_pool.empty(shape, like.dtype, like.device)
    return out, rows(out)


def _matmul_2d(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    # A transposed contiguous b (``x @ w.T``, a matmul's backward) is read in place as "nk",
    # with K part of the kernel as in a Linear (b's rows are a weight's, and attention's K^T
    # the head dim): the kernels that read a (N, K) B by rows (dot, gemv) need a static K,
    # and with a symbolic one ran at 0.01-0.2x torch.matmul (M = 1 to 32, 768 x 3072).
    if not b.is_contiguous() and b.t().is_contiguous():
        return gemm(a, b.t(), "nk", static_k=True, out=out)
    return gemm(a, b, "kn", static_k=False, out=out)


def matmul_impl(a: Tensor, b: Tensor) -> Tensor:
    shape = check_matmul(a, b)
    if b.dim() == 2 or b.shape[0] == 1:  # one B for all rows of a: one GEMM
        out, out_rows = shaped_output(shape, a)
        _matmul_2d(rows(a), b if b.dim() == 2 else b[0], out=out_rows)
        return out
    if kernel_device(a) != "cuda":
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
    out = output_pool.empty(shape, a.dtype, a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    a3 = a.expand(batch, m, k).contiguous()
    nk = not b.is_contiguous() and b.transpose(1, 2).is_contiguous()
    b3 = b.transpose(1, 2) if nk else b.contiguous()
    # "nk" (attention's K^T, K the head dim): K is part of the kernel, so that its loops
    # are unrolled and its panel packed without a bounds test (Q @ K^T: 0.89x -> 1.04x
    # torch.bmm at S=128, D=64). "kn" keeps a symbolic K: in P @ V it is the sequence length.
    spec = gemm_spec(DTYPE_NAMES[a.dtype], m, n, k, "nk" if nk else "kn", static_k=nk, batched=True)
    found = active_plan()
    if found is not None:
        found.record(spec)
        return out.copy_(torch.matmul(a3, b)) if found.compute else out
    kernel = get_kernel(spec)
    sync_threads()
    kernel(aligned(a3), aligned(b3), out)  # out: fresh, hence aligned
    return out


def linear_impl(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "none"
) -> Tensor:
    shape = check_linear(x, weight, bias, activation)
    # A weight that is the transpose of a contiguous (in, out) matrix (transformers' Conv1D
    # passes weight.t()) is read in place with the "kn" layout: no copy per call.
    kn = not weight.is_contiguous() and weight.t().is_contiguous()
    out, out_rows = shaped_output(shape, x)
    gemm(
        rows(x), weight.t() if kn else weight, "kn" if kn else "nk", bias, activation, out=out_rows
    )
    return out


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
            grad_b = mm(rows(a).t(), rows(grad))
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
    return sum_tangents(parts, output)


def sum_tangents(parts: list[Tensor], output: Tensor) -> Tensor:
    total = torch.zeros_like(output) if not parts else parts[0]
    for part in parts[1:]:
        total = total + part
    return total.expand_as(output) if total.shape != output.shape else total


register_function_autograd("matmul", _matmul_backward, _matmul_setup, _matmul_jvp)


def silu_grad(grad: Tensor, z: Tensor) -> Tensor:
    """``grad`` times d silu(z) / dz, as torch's F.silu computes it: aten::silu_backward has
    no derivative of its own, so where the backward is itself differentiated (create_graph,
    torch.func.hessian) torch's formula in ops, else the one kernel."""
    if torch.is_grad_enabled():
        s = torch.sigmoid(z)
        return grad * s * (1 + z * (1 - s))
    return torch.ops.aten.silu_backward(grad, z)


# d act(z) / dz applied to the incoming gradient, from the pre-activation z (torch's own
# backward formulas, so the gradients match F.gelu / F.silu exactly, and differentiate again).
_PRE_ACTIVATION_GRADS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "gelu": lambda grad, z: torch.ops.aten.gelu_backward(grad, z),
    "gelu_tanh": lambda grad, z: torch.ops.aten.gelu_backward(grad, z, approximate="tanh"),
    "silu": silu_grad,
}


def _linear_setup(ctx, inputs, output) -> None:
    # Trailing arguments equal to their defaults may be left out by the dispatcher.
    x, weight, bias, activation = (list(inputs) + [None, "none"][len(inputs) - 2 :])[:4]
    ctx.activation = activation
    ctx.has_bias = bias is not None
    ctx.x_shape = x.shape
    # (a weight stored (in, out), read as its transpose: transformers' Conv1D)
    ctx.weight_kn = not weight.is_contiguous() and weight.t().is_contiguous()
    need_x, need_w = ctx.needs_input_grad[:2]
    # Only what the backward needs is kept (an inference tensor cannot be saved at all, and
    # torch accepts one where it is not needed). relu's derivative needs only the output;
    # the others need the pre-activation, recomputed in the backward from x, weight and bias
    # rather than kept alive between forward and backward.
    if activation in _PRE_ACTIVATION_GRADS:
        ctx.save_for_backward(saveable(x), saveable(weight), saveable(bias), None)
    else:
        ctx.save_for_backward(
            x if need_w else None,
            weight if need_x else None,
            None,
            output if activation == "relu" else None,
        )


def saveable(t: Tensor | None) -> Tensor | None:
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
    grad2 = rows(grad)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        # dX = dZ @ W: a linear over W^T, W read in place; its K (the weight's rows) is fixed,
        # as in the forward, where a matmul's is symbolic (GPT-2's lm_head, K = 50257: 101 ms
        # as a matmul, where torch's mm took 40)
        grad_x = torch.ops.tvm_gemm.linear(grad2, weight.t(), None, "none").reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        mm = torch.ops.tvm_gemm.matmul
        if ctx.weight_kn:
            # (its gradient made in the layout the weight is stored in, dW^T = X^T @ dZ: as
            # dZ^T @ X its transpose reached the parameter, and adding it into .grad across
            # the strides took 8 ms a step for GPT-2's 768 x 3072)
            grad_w = mm(rows(x).t(), grad2).t()
        else:  # dW = dZ^T @ X
            grad_w = mm(grad2.t(), rows(x))
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
    dz = sum_tangents(parts, output)
    if activation == "relu":
        return dz * (output > 0)
    if activation in _PRE_ACTIVATION_GRADS:
        return _PRE_ACTIVATION_GRADS[activation](dz, lin(x, weight, bias, "none"))
    return dz


register_function_autograd("linear", _linear_backward, _linear_setup, _linear_jvp)
