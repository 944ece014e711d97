"""Which FX nodes are an activation the conv op can fuse, and which one.

ReLU (``nn.ReLU``, ``F.relu``, ``torch.relu``, ``.relu()``), ReLU6 (``nn.ReLU6``,
``F.relu6``, ``nn.Hardtanh(0, 6)``, ``F.hardtanh(x, 0, 6)``: MobileNetV2), hardswish
(``nn.Hardswish``, ``F.hardswish``: MobileNetV3), SiLU (``nn.SiLU``, ``F.silu``:
EfficientNet; transformers' ``SiLUActivation``: MobileViT), the sigmoid and hardsigmoid gates
of squeeze-and-excitation blocks (``nn.Sigmoid``, ``torch.sigmoid``, ``.sigmoid()``,
``nn.Hardsigmoid``, ``F.hardsigmoid``) and leaky ReLU with a slope >= 0
(``nn.LeakyReLU``, ``F.leaky_relu``: CSPNet, DarkNet with torch's default 0.01, YOLO with
0.1; a negative slope is not fused), in place or not: the fused op writes a new tensor, and
the in-place variant's input had no other user (the fusion checks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from .kernels.conv2d import ACTIVATIONS, leaky_relu_name, leaky_relu_slope
from .nn import activation_name

# (ReLU, SiLU and transformers' activation modules: ``nn.activation_name``, as for linears)
_MODULES = {
    nn.ReLU6: "relu6",
    nn.Hardswish: "hardswish",
    nn.Sigmoid: "sigmoid",
    nn.Hardsigmoid: "hardsigmoid",
}
_FUNCTIONS = {
    F.relu: "relu",
    torch.relu: "relu",
    torch.relu_: "relu",
    F.relu_: "relu",
    F.relu6: "relu6",
    F.hardswish: "hardswish",
    F.silu: "silu",
    torch.sigmoid: "sigmoid",
    torch.sigmoid_: "sigmoid",
    F.sigmoid: "sigmoid",
    F.hardsigmoid: "hardsigmoid",
}
_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid"}
_HARDTANH = {F.hardtanh, F.hardtanh_}
_LEAKY_RELU = {F.leaky_relu, F.leaky_relu_}


def conv_activation_of(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """The conv epilogue ``node`` computes on its first argument, or None."""
    if node.op == "call_module":
        mod = modules.get(node.target)
        if type(mod) is nn.Hardtanh:
            return "relu6" if (mod.min_val, mod.max_val) == (0.0, 6.0) else None
        if type(mod) is nn.LeakyReLU:
            return _leaky_relu(mod.negative_slope)
        if len(node.args) != 1 or node.kwargs:
            return None
        # (activation_name: the tracer keeps transformers' activation modules as leaves; the
        # conv takes those of them it computes)
        name = _MODULES.get(type(mod)) or activation_name(mod)
        return name if name in ACTIVATIONS else None
    if node.op == "call_function":
        if node.target in _HARDTANH:
            return "relu6" if _hardtanh_bounds(node) == (0.0, 6.0) else None
        if node.target in _LEAKY_RELU:
            return _leaky_relu(_leaky_slope(node))
        name = _FUNCTIONS.get(node.target)
        extra = set(node.kwargs) - {"inplace"}
        return name if name and len(node.args) in (1, 2) and not extra else None  # (x, inplace)
    if node.op == "call_method" and len(node.args) == 1 and not node.kwargs:
        return _METHODS.get(node.target)
    return None


def _hardtanh_bounds(node: fx.Node) -> tuple[float, float] | None:
    names = ["input", "min_val", "max_val", "inplace"]
    args = {"min_val": -1.0, "max_val": 1.0} | dict(zip(names, node.args, strict=False))
    args |= node.kwargs
    bounds = (args["min_val"], args["max_val"])
    return tuple(map(float, bounds)) if all(isinstance(b, (int, float)) for b in bounds) else None


def _leaky_relu(slope) -> str | None:
    """The epilogue name of a leaky ReLU with ``slope``, or None (not a number >= 0)."""
    if not isinstance(slope, (int, float)) or isinstance(slope, bool):
        return None
    name = leaky_relu_name(slope)
    return name if leaky_relu_slope(name) is not None else None


def _leaky_slope(node: fx.Node):
    names = ["input", "negative_slope", "inplace"]
    args = {"negative_slope": 0.01} | dict(zip(names, node.args, strict=False)) | node.kwargs
    return args["negative_slope"]
