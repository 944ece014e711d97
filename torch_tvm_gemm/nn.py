"""Modules backed by the TVM ops, and swapping them into a model.

``TVMLinear`` is an ``nn.Linear`` subclass: same parameters, same ``state_dict`` keys, so
checkpoints load either way; it can also carry a fused activation (ReLU / GELU) that ran as
a separate module before the swap.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .kernels.gemm import ACTIVATIONS

# Activation modules that can be fused into the preceding linear, with the name the op takes.
_FUSABLE: dict[type, Callable[[nn.Module], str | None]] = {
    nn.ReLU: lambda m: "relu",
    nn.GELU: lambda m: "gelu" if m.approximate == "none" else None,  # tanh form: not fused
}


class TVMLinear(nn.Linear):
    """``nn.Linear`` (optionally followed by an activation) computed by ``tvm_gemm.linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "none",
        device=None,
        dtype=None,
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"TVMLinear: activation must be one of {ACTIVATIONS}, got {activation!r}"
            )
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str = "none") -> TVMLinear:
        """A TVMLinear sharing ``linear``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.activation = activation
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Module:
        """Back to ``nn.Linear`` (+ the activation module), sharing the parameters."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        linear.train(self.training)
        if self.activation == "none":
            return linear
        act = nn.ReLU() if self.activation == "relu" else nn.GELU()
        return nn.Sequential(linear, act)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.tvm_gemm.linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"


class _Fused(nn.Identity):
    """Stands where an activation module was fused into the TVMLinear before it."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original


def swap_linear(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    activation_fusion: bool = True,
) -> nn.Module:
    """Replace ``nn.Linear`` modules of ``model`` (recursively, in place) by ``TVMLinear``.

    ``filter_fn(module, fqn)`` chooses which linears to swap (default: all). With
    ``activation_fusion``, an ``nn.ReLU`` / ``nn.GELU`` that directly follows a linear inside
    an ``nn.Sequential`` is fused into it; that is safe there because a Sequential feeds each
    output only to the next module. The fused activation is replaced by an identity that
    remembers it. Returns the model; ``unswap_linear`` undoes it.
    """
    _swap(model, "", filter_fn, activation_fusion)
    return model


def _swap(module: nn.Module, prefix: str, filter_fn, fuse: bool) -> None:
    children = list(module.named_children())
    for idx, (name, child) in enumerate(children):
        fqn = f"{prefix}.{name}" if prefix else name
        if type(child) is nn.Linear and (filter_fn is None or filter_fn(child, fqn)):
            activation = "none"
            if fuse and isinstance(module, nn.Sequential) and idx + 1 < len(children):
                nxt_name, nxt = children[idx + 1]
                act = _FUSABLE.get(type(nxt), lambda m: None)(nxt)
                if act is not None:
                    activation = act
                    setattr(module, nxt_name, _Fused(nxt))
            setattr(module, name, TVMLinear.from_linear(child, activation))
        elif not isinstance(child, (TVMLinear, _Fused)):
            _swap(child, fqn, filter_fn, fuse)


def unswap_linear(model: nn.Module) -> nn.Module:
    """Undo ``swap_linear``: TVMLinear back to ``nn.Linear``, fused activations restored."""
    for name, child in list(model.named_children()):
        if isinstance(child, TVMLinear):
            setattr(
                model,
                name,
                child.to_linear() if not isinstance(model, nn.Sequential) else _plain(child),
            )
        elif isinstance(child, _Fused):
            setattr(model, name, child.original)
        else:
            unswap_linear(child)
    return model


def _plain(tvm_linear: TVMLinear) -> nn.Linear:
    """In a Sequential the activation module is restored in its own slot, not nested."""
    linear = tvm_linear.to_linear()
    return linear[0] if isinstance(linear, nn.Sequential) else linear
