"""``nn.Linear`` subclasses whose own ``forward`` is still the plain linear.

Falcon's ``FalconLinear`` overrides ``forward`` with ``input @ self.weight.T`` and ``+
self.bias``: the same function as ``nn.Linear``'s, written out. Whether a subclass's forward
is that is read off its ``torch.fx`` graph, once per class (and bias or not), and only the
exact pattern counts: ``x @ W.T`` (``W.T``, ``W.t()``, ``W.transpose(0, 1)``), plus the
bias if the layer has one, or ``F.linear(x, W, b)``, and nothing else in the graph. A forward
that adds anything (a LoRA update, a quantized weight, a scale) stays on torch.

The classification traces, and fx must not trace while it traces: ``note_subclasses(model)``
classifies a model's layers up front (``convert`` and ``swap_linear`` call it first);
``plain_forward`` only reads what was noted.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from .trace_guard import unchanged_by_trace

_PLAIN: dict[tuple[type, bool], bool] = {}

_TRANSPOSES = {("t", ()), ("transpose", (0, 1)), ("transpose", (1, 0))}
_TRANSPOSES |= {("transpose", (-1, -2)), ("transpose", (-2, -1))}
_PRODUCTS = (operator.matmul, torch.matmul)
_ADDS = (operator.add, torch.add)


def note_subclasses(model: nn.Module) -> None:
    """Classify every ``nn.Linear`` subclass with its own forward in ``model``."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward:
            key = (type(module), module.bias is not None)
            if key not in _PLAIN:
                _PLAIN[key] = _is_plain_linear(module)


def plain_forward(module: nn.Linear) -> bool:
    """Whether ``module``'s class (noted before) computes exactly ``F.linear``."""
    return _PLAIN.get((type(module), module.bias is not None), False)


def _is_plain_linear(module: nn.Linear) -> bool:
    # A forward with a Python side effect on the module (``self.last = x``, a call counter)
    # leaves no node in the graph, so it would look plain: the guard refuses it.
    try:
        with unchanged_by_trace(module):
            graph = fx.symbolic_trace(module).graph
    except Exception:
        return False
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output").args[0]
    if len(inputs) != 1 or not isinstance(output, fx.Node):
        return False
    matched = _match(output, inputs[0], module.bias is not None)
    computed = {n for n in graph.nodes if n.op not in ("placeholder", "output")}
    return matched is not None and matched == computed


def _match(out: fx.Node, x: fx.Node, has_bias: bool) -> set[fx.Node] | None:
    """The nodes of ``x @ W.T (+ b)`` or ``F.linear(x, W[, b])`` ending at ``out``, or None."""
    if _calls(out, (F.linear,)) and out.args[0] is x and not out.kwargs:
        rest = out.args[1:]
        if len(rest) == 1 + has_bias and _attr(rest[0], "weight"):
            if not has_bias or _attr(rest[1], "bias"):
                return {out, *rest}
        return None
    if has_bias:
        if not (_calls(out, _ADDS) or _method(out, "add")) or out.kwargs or len(out.args) != 2:
            return None
        product, bias = out.args if _attr(out.args[1], "bias") else out.args[::-1]
        if not _attr(bias, "bias"):
            return None
        found = _match(product, x, False)
        return None if found is None else {out, bias, *found}
    if not (_calls(out, _PRODUCTS) or _method(out, "matmul")) or out.kwargs:
        return None
    if len(out.args) != 2 or out.args[0] is not x or not _weight_t(out.args[1]):
        return None
    return {out, out.args[1], out.args[1].args[0]}


def _weight_t(node) -> bool:
    if not isinstance(node, fx.Node) or node.kwargs or not node.args:
        return False
    if _calls(node, (getattr,)):
        return node.args[1] in ("T", "mT") and _attr(node.args[0], "weight")
    if _calls(node, (torch.t,)):
        return len(node.args) == 1 and _attr(node.args[0], "weight")
    if node.op == "call_method" and (node.target, tuple(node.args[1:])) in _TRANSPOSES:
        return _attr(node.args[0], "weight")
    return False


def _attr(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" and node.target == name


def _calls(node, functions: tuple) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in functions


def _method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name
