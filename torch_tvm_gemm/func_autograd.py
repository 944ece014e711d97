"""Autograd for the tvm_gemm ops that torch.func composes with.

``torch.library.register_autograd`` wraps the formulas in an ``autograd.Function`` without a
``setup_context`` staticmethod, which torch.func rejects (``grad``, ``vjp``, ``jacrev`` over
the ops raise), and without a ``jvp``, so forward-mode AD drops the tangent. Here the same
``setup_context`` / ``backward`` formulas, plus a ``jvp`` formula, go into an
``autograd.Function`` registered as the op's Autograd kernel.

That kernel runs inside the dispatcher, below torch.func's transform layers: there the
tensors are the transforms' wrappers, and plain autograd on them is how torch.func
differentiates every built-in op. So the Function is applied through autograd's own entry
(``_FunctionBase.apply``), not ``Function.apply``, whose torch.func path is meant for calls
from user code, above the transforms.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd import forward_ad

_LIB = torch.library.Library("tvm_gemm", "IMPL")  # noqa: TOR901 (Autograd kernels only)


def _defaults(schema) -> tuple:
    """Each argument's default value (None where it has none), in the schema's order."""
    return tuple(a.default_value for a in schema.arguments)


def _has_tangent(args) -> bool:
    level = forward_ad._current_level
    if level < 0:
        return False
    return any(
        isinstance(a, Tensor) and torch._VF._unpack_dual(a, level=level).tangent is not None
        for a in args
    )


def _apply(function: type, *args):
    """Autograd's ``Function`` entry without the torch.func redirection (see above). Under a
    transform, functorch asks for its permission to record one level of autograd, as its own
    rule for a Function does."""
    apply = super(torch.autograd.Function, function).apply
    if not torch._C._are_functorch_transforms_active():
        return apply(*args)
    with enable_single_level_autograd_function():
        return apply(*args)


def register_function_autograd(
    name: str,
    backward: Callable,
    setup_context: Callable,
    jvp: Callable,
) -> None:
    """Register ``backward`` / ``setup_context`` (``register_autograd``'s signatures) and
    ``jvp(ctx, inputs, output, *tangents)`` as the Autograd kernel of ``tvm_gemm::<name>``."""
    op = getattr(torch.ops.tvm_gemm, name).default
    # (read once: the schema's argument list is built anew at each access, ~1 us a call)
    defaults = _defaults(op._schema)

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            # needs_input_grad is as long as inputs: the formulas index it as for the op.
            setup_context(ctx, inputs, output)
            # The output by a weak reference: held here it would hold its own grad_fn (this
            # ctx), a cycle only Python's garbage collector frees: every output made with
            # gradients wanted stayed alive until then (a converted ResNet-50 called outside
            # no_grad() kept 20 MB more a forward, and writing fresh pages for its outputs
            # took its forward from 60 to 120-130 ms). The jvp runs while the output is
            # still alive, inside the op's call.
            ctx.fwd_inputs, ctx.fwd_output = inputs, weakref.ref(output)

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

        @staticmethod
        def jvp(ctx, *tangents):
            return jvp(ctx, ctx.fwd_inputs, ctx.fwd_output(), *tangents)

    Function.__name__ = Function.__qualname__ = f"TVMGemm_{name}"

    def kernel(*args):
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(a, Tensor) and a.requires_grad for a in args
        )
        if needs_grad or _has_tangent(args):
            # (with the trailing arguments the dispatcher leaves out, at their defaults)
            return _apply(Function, *args, *defaults[len(args) :])
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    _LIB.impl(name, kernel, "Autograd")
