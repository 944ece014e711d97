"""Mixture-of-experts layers (transformers' Mixtral, Qwen-MoE, DeepSeek, OLMoE, gpt-oss, ...)
on the TVM ops.

transformers keeps a MoE layer's experts in one module with 3-D parameters
(``gate_up_proj``: experts x 2I x H, ``down_proj``: experts x H x I, or their transposes) and
no ``nn.Linear`` in it, so the Linear swap never reaches the experts, which hold most of such
a model's weights and products. Its classes are marked ``@use_experts_implementation``: the
module dispatches to a function chosen by ``config._experts_implementation`` (``"eager"``,
``"grouped_mm"``, ...), whose arguments are the tokens ``(T, H)``, each token's chosen experts
``(T, k)`` and their routing weights ``(T, k)``.

``convert`` sets a ``forward`` on each such module (not on the config, which every layer
shares and the user may change) that runs the experts as ``tvm_gemm.linear`` calls: the
token-expert pairs sorted by expert, then per expert with tokens one product for gate and up
together, the module's own gate (``_apply_gate``: SiLU(gate) * up, gpt-oss's clamped form,
...), one product for down; the routing weights applied and each token's k results summed
in a fixed order, as transformers' ``grouped_mm`` does. Under ``torch.compile`` the module's
own forward runs instead (the per-expert loop depends on the routing, which a full graph
cannot hold).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops.entry import grouped_linear, linear

# Token-expert pairs x gate-up width up to which the gate runs once on all experts' outputs.
GATE_ONCE_MAX = 1 << 19

# The dtypes the linear op takes (an FP8 experts module keeps its own kernels).
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module: the attributes ``@use_experts_implementation`` gives
    its class, and 3-D expert weights."""
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "_apply_gate")):
        return False
    up = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    down = getattr(module, "down_proj", None)
    return isinstance(up, Tensor) and isinstance(down, Tensor) and up.dim() == down.dim() == 3


def why_not(module: nn.Module) -> str | None:
    """Why this experts module stays on its own kernels, or None."""
    up = module.gate_up_proj if module.has_gate else module.up_proj
    for dtype in (up.dtype, module.down_proj.dtype):
        if dtype not in _DTYPES:
            return (
                f"experts' weights in {dtype}: the TVM linear takes float32/64, bfloat16, float16"
            )
    return None


class ExpertsForward:
    """The ``forward`` set on a converted experts module. An object rather than a bound
    function so that the model pickles and deep-copies. The module's own forward runs where
    this one does not apply, and once the model's experts implementation is set to another
    one than at conversion (``model.set_experts_implementation(...)``: the user's choice)."""

    def __init__(self, module: nn.Module, implementation: str | None = None) -> None:
        self.module = module
        self.implementation = implementation or _implementation(module)

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor):
        module = self.module
        if (
            torch.compiler.is_compiling()
            or _implementation(module) != self.implementation
            or getattr(module, "_is_expert_parallel", False)
            or hidden_states.dim() != 2
            or top_k_index.dim() != 2
            or hidden_states.device.type not in ("cpu", "cuda")
        ):
            return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
        return experts_forward(module, hidden_states, top_k_index, top_k_weights)

    def __reduce__(self):
        return (ExpertsForward, (self.module, self.implementation))


def _implementation(module: nn.Module) -> str | None:
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:  # fmt: skip
    """The experts' output ``(T, H)`` for tokens ``(T, H)`` routed by ``top_k_index`` /
    ``top_k_weights`` ``(T, k)``, every product on ``tvm_gemm.linear``."""
    tokens, k = top_k_index.shape
    experts = module.down_proj.shape[0]
    expert_ids = top_k_index.reshape(-1)
    try:  # (a host sync for the loop's bounds, as the eager forward's nonzero)
        counts = torch.bincount(expert_ids, minlength=experts).tolist()
    except RuntimeError:  # (a negative index)
        counts = []
    if len(counts) != experts:
        raise ValueError(
            f"torch_tvm_gemm: MoE experts {type(module).__name__}: top_k_index holds an expert "
            f"outside 0..{experts - 1}"
        )
    order = torch.argsort(expert_ids, stable=True)
    up_w = module.gate_up_proj if module.has_gate else module.up_proj
    up_b = _bias(module, "gate_up_proj_bias" if module.has_gate else "up_proj_bias")
    down_w, down_b = module.down_proj, _bias(module, "down_proj_bias")
    gate = module._apply_gate if module.has_gate else module.act_fn
    x = hidden_states[order // k].to(up_w.dtype)
    if not x.shape[0]:  # (no tokens)
        return torch.zeros_like(hidden_states)
    if x.shape[0] * up_w.shape[2 if module.is_transposed else 1] <= GATE_ONCE_MAX:
        # A few tokens: every expert's products in one call (grouped_linear: the loop over
        # the experts in C++) and the gate's torch ops (a split, the activation, a product)
        # once on all of them, not per expert (a Mixtral-style layer's 8 experts against
        # grouped_mm: 8 tokens 0.86 -> 0.92x, 32 tokens 1.13 -> 1.18x with the gate once; at
        # 1024 tokens the copy into one tensor cost more than it saved, 1.07 -> 0.99x).
        h = gate(grouped_linear(x, counts, up_w, up_b, module.is_transposed))
        out = grouped_linear(h, counts, down_w, down_b, module.is_transposed)
    else:
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                xe = x[start : start + n]
                h = gate(linear(xe, _nk(module, up_w[e]), _at(up_b, e)))
                outs.append(linear(h, _nk(module, down_w[e]), _at(down_b, e)))
            start += n
        out = torch.cat(outs)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    # Back to token order, then each token's k results summed (no atomics: deterministic).
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back].view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _nk(module: nn.Module, weight: Tensor) -> Tensor:
    # (a transposed module stores (in, out): its transpose is read in place by the op)
    return weight.T if module.is_transposed else weight


def _bias(module: nn.Module, name: str) -> Tensor | None:
    return getattr(module, name, None) if getattr(module, "has_bias", False) else None


def _at(bias: Tensor | None, e: int) -> Tensor | None:
    return None if bias is None else bias[e]


def convert_experts(model: nn.Module, allowed) -> dict[str, str]:
    """Sets ``ExpertsForward`` on every experts module of ``model`` whose fqn ``allowed``
    accepts; returns ``{fqn: what happened}`` for each one found."""
    record = {}
    for fqn, module in model.named_modules():
        if not is_experts(module):
            continue
        reason = why_not(module)
        if reason is None and not allowed(fqn):
            reason = "filter_fn said no"
        if reason is not None:
            record[fqn] = f"left alone: {reason}"
            continue
        module.forward = ExpertsForward(module)
        record[fqn] = "swapped: each expert's products on tvm_gemm.linear"
    return record


def unconvert_experts(module: nn.Module) -> None:
    """The module's own forward again."""
    if isinstance(module.__dict__.get("forward"), ExpertsForward):
        del module.forward
