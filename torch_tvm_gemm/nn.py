"""Modules backed by the TVM ops, and swapping them into a model.

``TVMLinear`` is an ``nn.Linear`` subclass: same parameters, same ``state_dict`` keys, so
checkpoints load either way; it can also carry a fused activation (ReLU, GELU, tanh-GELU,
SiLU) that ran as a separate module before the swap. ``TVMConv1D`` does the same for
transformers' ``Conv1D`` (GPT-2's projections, weight stored ``(in, out)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .kernels.gemm import ACTIVATIONS, torch_activation
from .linear_subclasses import note_subclasses, plain_forward
from .moe_experts import unconvert_experts
from .ops import entry

# transformers' activation classes (matched by name: transformers is optional), with the
# activation each one computes. FastGELU and NewGELU write the tanh form out by hand.
_TRANSFORMERS_ACTIVATIONS = {
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",  # F.gelu, or its erf formula written out: the same function
}


def activation_name(module: nn.Module) -> str | None:
    """The ``tvm_gemm.linear`` activation that ``module`` computes, or None if there is none."""
    kind = type(module)
    if kind is nn.ReLU:
        return "relu"
    if kind is nn.GELU:
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    if kind is nn.SiLU:
        return "silu"
    if kind.__module__ == "transformers.activations":
        return _TRANSFORMERS_ACTIVATIONS.get(kind.__name__)
    return None


def activation_module(activation: str) -> nn.Module:
    """A torch module computing ``activation`` (for undoing a fusion)."""
    if activation == "relu":
        return nn.ReLU()
    if activation in ("gelu", "gelu_tanh"):
        return nn.GELU(approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return nn.SiLU()
    raise ValueError(f"torch_tvm_gemm: no module for activation {activation!r}")


def _check_activation(owner: str, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def linear_forward(module: nn.Module, x: Tensor, weight: Tensor) -> Tensor:
    """``module.activation(x @ weight.T + module.bias)`` for a TVM linear module: one kernel,
    except in training with gradients wanted, where an activation whose derivative needs its
    input (GELU, SiLU) runs after the product as a torch op, which keeps that input for the
    backward as torch's own layers do. The fused kernel keeps none, so its backward computed
    the product again: a training step (batch 1, 2 threads, Intel Xeon, converted / eager)
    ran at 0.95-0.96x with it for a BERT-style encoder, 0.99-1.02x without; LLaMA-style
    0.91-0.95x -> 0.96-0.97x. (ReLU's derivative needs only the output: fused always.)"""
    act, bias = module.activation, module.bias
    if (
        act not in ("none", "relu")
        and module.training
        and torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    ):
        return torch_activation(act)(entry.linear(x, weight, bias, "none"))
    return entry.linear(x, weight, bias, act)


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
        _check_activation("TVMLinear", activation)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str = "none") -> TVMLinear:
        """A TVMLinear sharing ``linear``'s parameters (no copy: tied weights stay tied)."""
        _check_activation("TVMLinear", activation)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.activation = activation
        new.train(linear.training)
        take_hooks(new, linear)
        return new

    def to_linear(self) -> nn.Module:
        """Back to ``nn.Linear`` (+ the activation module), sharing the parameters."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        linear.train(self.training)
        take_hooks(linear, self)
        if self.activation == "none":
            return linear
        return nn.Sequential(linear, activation_module(self.activation))

    def forward(self, x: Tensor) -> Tensor:
        return linear_forward(self, x, self.weight)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"


class TVMConv1D(nn.Module):
    """transformers' ``Conv1D`` (a linear layer whose weight is stored ``(in, out)``), optionally
    followed by an activation, computed by ``tvm_gemm.linear``.

    The op reads ``weight.t()`` in place (the GEMM's "kn" layout): no copy per call. Same
    parameters and ``state_dict`` keys (``weight``, ``bias``) and attributes (``nf``, ``nx``).
    """

    def __init__(self, nf: int, nx: int, activation: str = "none") -> None:
        _check_activation("TVMConv1D", activation)
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)
        self.activation = activation

    @classmethod
    def from_conv1d(cls, conv1d: nn.Module, activation: str = "none") -> TVMConv1D:
        """A TVMConv1D sharing ``conv1d``'s parameters (no copy)."""
        _check_activation("TVMConv1D", activation)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.nf, new.nx = conv1d.nf, conv1d.nx
        new.weight, new.bias = conv1d.weight, conv1d.bias
        new.activation = activation
        new.train(conv1d.training)
        take_hooks(new, conv1d)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return linear_forward(self, x, self.weight.t())

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, activation={self.activation}"


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's projections)."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")


def linear_kind(module: nn.Module) -> tuple[str | None, str]:
    """``("linear" | "conv1d", "")`` for a layer that the TVM modules can stand in for;
    ``(None, reason)`` for a linear-like layer they cannot; ``(None, "")`` for anything else."""
    if isinstance(module, (TVMLinear, TVMConv1D)):
        return None, ""
    if isinstance(module, nn.Linear):
        if type(module).forward is not nn.Linear.forward and not plain_forward(module):
            return None, f"{type(module).__name__} overrides nn.Linear.forward"
        kind = "linear"
    elif is_conv1d(module):
        if type(module).forward.__qualname__ != "Conv1D.forward":
            return None, f"{type(module).__name__} overrides Conv1D.forward"
        kind = "conv1d"
    else:
        return None, ""
    # Read from _parameters: under torch.fx tracing, attribute access returns proxies.
    weight = module._parameters.get("weight", getattr(module, "weight", None))
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        return None, "its weight is not a 2-D tensor"
    if weight.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return None, f"weight dtype {weight.dtype} is not supported"
    return kind, ""


def take_hooks(new: nn.Module, old: nn.Module) -> None:
    """``new`` stands where ``old`` was: it takes over ``old``'s hooks (forward, backward,
    state_dict), the very dicts, so that the handles the user holds still remove them."""
    for name, value in vars(old).items():
        if "hook" in name:
            new.__dict__[name] = value


# A module's own forward and backward hooks (nn.Module keeps each kind in a dict of these names)
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a forward or backward hook of its own."""
    return any(getattr(module, name) for name in HOOK_DICTS)


def tvm_module_for(module: nn.Module, activation: str = "none") -> nn.Module:
    """The TVM module standing in for the linear-like ``module`` (parameters shared)."""
    if is_conv1d(module):
        return TVMConv1D.from_conv1d(module, activation)
    return TVMLinear.from_linear(module, activation)


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
    """Replace the linear layers of ``model`` (recursively, in place) by TVM modules.

    Swapped: ``nn.Linear`` and its subclasses that keep ``nn.Linear.forward`` or whose own
    forward is exactly the linear (``linear_subclasses.py``) (-> ``TVMLinear``) and
    transformers' ``Conv1D`` (-> ``TVMConv1D``); parameters are shared, not copied, so
    tied weights stay tied and ``state_dict`` keys do not change, and so are the layer's
    hooks (``take_hooks``). Not swapped: the
    ``out_proj`` of an ``nn.MultiheadAttention`` (the attention reads its weight directly,
    never calls it). ``filter_fn(module, fqn)`` chooses which layers to swap (default: all).
    With ``activation_fusion``, an activation module (ReLU, GELU, tanh-GELU, SiLU) that
    directly follows a linear inside an ``nn.Sequential`` is fused into it (unless one of the
    two has a hook); that is safe there
    because a Sequential feeds each output only to the next module. The fused activation is
    replaced by an identity that remembers it. Returns the model; ``unswap_linear`` undoes it.
    """
    swap_linear_layers(model, filter_fn, activation_fusion)
    return model


def swap_linear_layers(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    activation_fusion: bool = False,
    prefix: str = "",
    skip: Callable[[str], bool] | None = None,
) -> dict[str, str]:
    """``swap_linear``'s work; returns ``{fqn: what happened}`` for every linear-like layer
    (``"swapped"``, ``"swapped + <act>"`` or ``"left alone: <reason>"``). Layers whose fqn
    ``skip`` accepts are not visited (their record is the caller's)."""
    record: dict[str, str] = {}
    note_subclasses(model)
    _swap(model, prefix, filter_fn, activation_fusion, record, skip or (lambda fqn: False))
    return record


def _swap(module: nn.Module, prefix: str, filter_fn, fuse: bool, record, skip) -> None:
    children = list(module.named_children())
    for idx, (name, child) in enumerate(children):
        fqn = f"{prefix}.{name}" if prefix else name
        if skip(fqn):
            continue
        if isinstance(module, nn.MultiheadAttention):
            if isinstance(child, nn.Linear):
                record[fqn] = (
                    "left alone: nn.MultiheadAttention reads this projection's weight "
                    "directly, so a swapped module would never run"
                )
            continue
        kind, reason = linear_kind(child)
        if kind is None and reason:
            record[fqn] = f"left alone: {reason}"
            continue
        if kind is None:
            if not isinstance(child, (TVMLinear, TVMConv1D, _Fused)):
                _swap(child, fqn, filter_fn, fuse, record, skip)
            continue
        if filter_fn is not None and not _call_filter(filter_fn, child, fqn):
            record[fqn] = "left alone: filter_fn said no"
            continue
        activation = "none"
        if fuse and isinstance(module, nn.Sequential) and idx + 1 < len(children):
            nxt_name, nxt = children[idx + 1]
            act = activation_name(nxt)
            # (a hook on either would see another tensor, or not run, in one fused call)
            if act is not None and not has_hooks(child) and not has_hooks(nxt):
                activation = act
                setattr(module, nxt_name, _Fused(nxt))
        setattr(module, name, tvm_module_for(child, activation))
        record[fqn] = "swapped" + ("" if activation == "none" else f" + {activation}")


def _call_filter(filter_fn, module: nn.Module, fqn: str) -> bool:
    try:
        return bool(filter_fn(module, fqn))
    except Exception as err:
        raise RuntimeError(
            f"torch_tvm_gemm: the filter function raised on {fqn!r} ({type(err).__name__}: {err})"
        ) from err


def unswap_linear(model: nn.Module) -> nn.Module:
    """Undo ``swap_linear``: TVMLinear back to ``nn.Linear``, fused activations restored
    (and MoE experts converted by ``convert`` on their own forward again)."""
    unconvert_experts(model)
    for name, child in list(model.named_children()):
        if isinstance(child, TVMConv1D):
            setattr(model, name, _conv1d_back(child))
        elif isinstance(child, TVMLinear):
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


def _conv1d_back(tvm: TVMConv1D) -> nn.Module:
    """transformers' Conv1D again, sharing the parameters (the fused activation is lost only
    where it was fused, in a Sequential: that slot gets it back from its _Fused)."""
    from transformers.pytorch_utils import Conv1D

    conv1d = Conv1D.__new__(Conv1D)
    nn.Module.__init__(conv1d)
    conv1d.nf, conv1d.nx = tvm.nf, tvm.nx
    conv1d.weight, conv1d.bias = tvm.weight, tvm.bias
    conv1d.train(tvm.training)
    take_hooks(conv1d, tvm)
    return conv1d
