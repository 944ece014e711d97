"""Conv2d + bias + activation as one TVM kernel: the module, the FX fusion pass, and ``convert``.

``TVMConv2dBiasReLU`` (in ``conv_module``) is an ``nn.Conv2d`` subclass (same parameters, same ``state_dict``
keys) computed by ``tvm_gemm.conv2d_bias_relu``, optionally with the activation that followed
it: ReLU, ReLU6, hardswish, SiLU, leaky ReLU, sigmoid or hardsigmoid (see
``fusion_activations``), "ReLU" below.

``fuse_conv_bias_relu(model)`` traces the model with ``torch.fx.symbolic_trace`` and rewrites
three patterns into the fused op, leaving everything else alone:

1. ``Conv2d`` -> ReLU (module, ``F.relu`` / ``torch.relu`` / ``.relu()``, in place or not);
2. ``conv2d(x, w, None)`` (functional, or a ``Conv2d(bias=False)``) -> ``+ b`` with ``b`` a
   per-channel bias of shape ``(1, C, 1, 1)`` or ``(C, 1, 1)`` (a parameter or buffer,
   reshaped / viewed / unsqueezed / indexed) -> ReLU;
3. ``Conv2d`` -> ``BatchNorm2d`` (eval mode, running stats; or a frozen BN, ``is_frozen_bn``)
   -> ReLU, by folding the BN into
   a copy of the conv's weight and bias first; with no ReLU after the BN, the folded conv
   runs without one. The BN may also be a BatchNorm2d subclass that the trace went into,
   seen as ``F.batch_norm`` on its own buffers followed by its own children (timm's
   ``BatchNormAct2d``: ``drop``, ``act``), folded with all of them or not at all; reads of
   the conv output's metadata (its ``_assert(x.ndim == 4)``) do not count as users.

``nn.Identity`` and eval-mode / ``p=0`` ``nn.Dropout`` modules between the pieces are
no-ops and do not block a match (timm's ``conv -> bn -> drop_block (Identity) -> act``).
A match is fused only if every intermediate value has exactly one user (the next node of
the pattern): a conv output that is also used elsewhere must stay un-activated.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from .conv_module import CONV_OP, TVMConv2dBiasReLU, conv_padding
from .fusion_activations import conv_activation_of
from .ops.checks import DTYPE_NAMES
from .schedules.cpu_conv2d import untuned_groups
from .trace_guard import unchanged_by_trace

log = logging.getLogger("torch_tvm_gemm")

# --- the FX pass ----------------------------------------------------------------------------


@dataclass
class FusionSummary:
    """What ``fuse_conv_bias_relu`` did: one line per fused and per skipped candidate."""

    fused: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} conv2d+bias+relu"]
        lines += [f"  fused: {f}" for f in self.fused]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


class FusionResult(NamedTuple):
    model: fx.GraphModule
    summary: FusionSummary


_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_VIEW_METHODS = {"reshape", "view", "unsqueeze"}
_VIEW_FUNCTIONS = {torch.reshape, torch.unsqueeze, operator.getitem}

_FROZEN_BN_BUFFERS = ("weight", "bias", "running_mean", "running_var")


def is_frozen_bn(module: nn.Module) -> bool:
    """A frozen BatchNorm2d: ``x * scale + shift`` from buffers (weight, bias, running_mean,
    running_var, eps), eval-mode BN whatever ``training`` says. torchvision's
    ``FrozenBatchNorm2d`` (its detection and segmentation backbones built for pretrained
    weights, timm's ``freeze_batch_norm_2d``) and detectron2's: recognised by that name and
    those buffers, nothing imported."""
    if type(module).__name__ != "FrozenBatchNorm2d" or module._parameters or module._modules:
        return False
    buffers = [module._buffers.get(name) for name in _FROZEN_BN_BUFFERS]
    if not all(isinstance(b, Tensor) and b.dim() == 1 for b in buffers):
        return False
    return len({b.numel() for b in buffers}) == 1 and isinstance(
        getattr(module, "eps", None), float
    )


def is_plain_conv2d(module: nn.Module) -> bool:
    """An ``nn.Conv2d`` or a subclass that computes what it does (its own ``__init__`` only,
    as transformers' ``EfficientNetDepthwiseConv2d``): fused like one. Traced through, such a
    subclass became a functional ``conv2d`` call that no pattern took (HF EfficientNet: none
    of its 16 depthwise convs fused)."""
    cls = type(module)
    return (
        isinstance(module, nn.Conv2d)
        and cls.forward is nn.Conv2d.forward
        and cls._conv_forward is nn.Conv2d._conv_forward
    )


class _Graph:
    """The traced model with the queries the matchers need."""

    def __init__(self, gm: fx.GraphModule, fold=None, root: nn.Module | None = None) -> None:
        self.gm = gm
        # The module traced: gm's hierarchy holds only what the graph calls or reads (a
        # module traced through, timm's BatchNormAct2d, is an empty container there).
        self.root = root
        # How a conv -> BN pair becomes one module: _fold_bn (a snapshot) by default.
        self.fold = fold or _fold_bn
        self.modules = dict(gm.named_modules())
        self.calls: dict[str, int] = {}
        self.erased: set[fx.Node] = set()
        for node in gm.graph.nodes:
            if node.op == "call_module":
                self.calls[node.target] = self.calls.get(node.target, 0) + 1

    def module(self, node: fx.Node, kind: type) -> nn.Module | None:
        """The module ``node`` calls if it is exactly of type ``kind``."""
        if node.op != "call_module":
            return None
        mod = self.modules.get(node.target)
        return mod if type(mod) is kind else None

    def bn(self, node: fx.Node) -> nn.Module | None:
        """The BatchNorm2d (or frozen BN, ``is_frozen_bn``) module ``node`` calls, or None."""
        mod = self.module(node, nn.BatchNorm2d)
        if mod is None and node.op == "call_module" and is_frozen_bn(self.modules.get(node.target)):
            mod = self.modules[node.target]
        return mod

    def activation(self, node: fx.Node | None) -> str | None:
        """The conv epilogue ``node`` is (``fusion_activations``), or None."""
        return None if node is None else conv_activation_of(node, self.modules)

    def attr(self, target: str) -> Tensor:
        value = self.gm
        for part in target.split("."):
            value = getattr(value, part)
        return value


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument: an in-place method or function
    (``mul_``), ``inplace=True``, or a module built with ``inplace=True``."""
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(node.target)
        return getattr(module, "inplace", False) is True
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place = isinstance(name, str) and name.endswith("_") and not name.startswith("_")
    return in_place or node.kwargs.get("inplace") is True


def is_impure(node: fx.Node) -> bool:
    """fx's purity, and an in-place op whose result nothing reads (``x[:, :1].mul_(2)``, an
    ``nn.ReLU(inplace=True)`` called for its write), which fx's dead-code pass would drop:
    eager's write into its argument must stay. (For ``eliminate_dead_code``; the passes
    erase the nodes they replace themselves.)"""
    return node.is_impure() or writes_in_place(node)


def _sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_transparent(g: _Graph, node: fx.Node) -> bool:
    """A module call that returns its input: nn.Identity, nn.Dropout in eval mode or p=0."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    mod = g.modules.get(node.target)
    if type(mod) is nn.Identity:
        return True
    return type(mod) is nn.Dropout and (not mod.training or mod.p == 0)


# Reads of a tensor's metadata only (timm's ``_assert(x.ndim == 4)`` in BatchNormAct2d).
_METADATA_ATTRS = {"ndim", "shape", "dtype", "device"}


def _reads_metadata(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _METADATA_ATTRS
    return node.op == "call_method" and node.target in ("dim", "size")


def _next(
    g: _Graph, node: fx.Node, passed: list[fx.Node], metadata_ok: bool = False
) -> fx.Node | None:
    """``node``'s sole user, looking through transparent modules (appended to ``passed``).
    ``metadata_ok``: users that read only ``node``'s metadata do not count (for a node the
    fusion keeps as the fused output, whose shape, dtype and device are the same)."""
    users = [u for u in node.users if not (metadata_ok and _reads_metadata(u))]
    user = users[0] if len(users) == 1 else None
    while user is not None and _is_transparent(g, user):
        passed.append(user)
        user = _sole_user(user)
    return user


@dataclass
class _Conv:
    """A conv node in the graph: its input, weight and bias nodes and its geometry."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node | None  # None: a module's own weight (read through get_attr on rewrite)
    bias: fx.Node | None
    has_bias: bool
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int
    module: nn.Conv2d | None = None


def _pair(v) -> list[int] | None:
    if isinstance(v, int):
        return [v, v]
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return list(v)
    return None


def _match_conv(g: _Graph, node: fx.Node) -> _Conv | str | None:
    """The conv at ``node``; a reason string if it is a conv we cannot fuse; else None."""
    conv = g.modules.get(node.target) if node.op == "call_module" else None
    if conv is not None and is_plain_conv2d(conv):
        padding = conv_padding(conv)
        if padding is None:
            return f"{node.name}: padding {conv.padding!r} / mode {conv.padding_mode!r}"
        if conv.weight.device.type != "cpu" or len(node.args) != 1 or node.kwargs:
            return f"{node.name}: not a plain call on a CPU Conv2d"
        c, k, groups = conv.in_channels, conv.out_channels, conv.groups
        if untuned_groups(c, k, groups, DTYPE_NAMES.get(conv.weight.dtype, "float32")):
            return (
                f"{node.name}: groups={groups} of {k // groups} output channels run an "
                "untuned kernel here (torch's conv is faster)"
            )
        return _Conv(
            node,
            node.args[0],
            None,
            None,
            conv.bias is not None,
            list(conv.stride),
            list(padding),
            list(conv.dilation),
            conv.groups,
            conv,
        )
    if node.op != "call_function" or node.target not in (F.conv2d, torch.conv2d):
        return None
    names = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
    defaults = [None, None, None, 1, 0, 1, 1]
    args = dict(zip(names, defaults, strict=True))
    args.update(zip(names, node.args, strict=False))
    args.update(node.kwargs)
    padding = [0, 0] if args["padding"] == "valid" else _pair(args["padding"])
    stride, dilation = _pair(args["stride"]), _pair(args["dilation"])
    if None in (padding, stride, dilation) or not isinstance(args["groups"], int):
        return f"{node.name}: non-constant or string geometry"
    return _Conv(
        node,
        args["input"],
        args["weight"],
        args["bias"],
        args["bias"] is not None,
        stride,
        padding,
        dilation,
        args["groups"],
    )


def _bias_value(g: _Graph, node: fx.Node) -> Tensor | None:
    """The value of ``node`` if it is a parameter / buffer put through views, else None."""
    if node.op == "get_attr":
        return g.attr(node.target)
    if not node.args or not isinstance(node.args[0], fx.Node) or node.kwargs:
        return None
    rest = node.args[1:]
    inputs: list[fx.Node] = []
    fx.node.map_arg(rest, inputs.append)
    if inputs:  # a view whose arguments are computed: not a constant bias
        return None
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        base = _bias_value(g, node.args[0])
        return None if base is None else getattr(base, node.target)(*rest)
    if node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
        base = _bias_value(g, node.args[0])
        return None if base is None else node.target(base, *rest)
    return None


def _is_channel_bias(value: Tensor | None, channels: int) -> bool:
    return value is not None and tuple(value.shape) in ((1, channels, 1, 1), (channels, 1, 1))


def _out_channels(g: _Graph, conv: _Conv) -> int | None:
    if conv.module is not None:
        return conv.module.out_channels
    w = conv.weight
    return g.attr(w.target).shape[0] if w is not None and w.op == "get_attr" else None


def _fold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d, activation: str = "relu") -> TVMConv2dBiasReLU:
    """A fused module whose weight and bias have the eval-mode BN folded in (in float64)."""
    with torch.no_grad():
        var, mean = bn.running_var.double(), bn.running_mean.double()
        gamma = bn.weight.double() if bn.weight is not None else torch.ones_like(var)
        beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(var)
        scale = gamma / torch.sqrt(var + bn.eps)
        bias = conv.bias.double() if conv.bias is not None else torch.zeros_like(mean)
        dtype = conv.weight.dtype
        weight = (conv.weight.double() * scale.view(-1, 1, 1, 1)).to(dtype)
        bias = ((bias - mean) * scale + beta).to(dtype)
    fused = TVMConv2dBiasReLU.from_conv(conv, activation=activation)
    fused.weight = nn.Parameter(weight, requires_grad=conv.weight.requires_grad)
    fused.bias = nn.Parameter(bias, requires_grad=conv.weight.requires_grad)
    return fused


def _replace(g: _Graph, last: fx.Node, new: fx.Node, dead: list[fx.Node]) -> None:
    """Route ``last``'s users to ``new`` and erase the replaced nodes (users first)."""
    last.replace_all_uses_with(new)
    for node in dead:
        g.gm.graph.erase_node(node)
        g.erased.add(node)


def _swap_module(g: _Graph, target: str, module: nn.Module) -> None:
    # Code that reads the conv module itself (a padding helper reading its stride and kernel
    # size) keeps reading the original, kept under a name of its own in the graph module.
    readers = [n for n in g.gm.graph.nodes if n.op == "get_attr" and n.target == target]
    if readers:
        kept = "_tvm_unfused_" + target.replace(".", "_")
        g.gm.add_submodule(kept, g.modules[target])
        for node in readers:
            node.target = kept
    parent, _, name = target.rpartition(".")
    setattr(g.gm.get_submodule(parent) if parent else g.gm, name, module)
    g.modules[target] = module


def _try_fuse(g: _Graph, conv: _Conv) -> str | None:
    """Fuse the pattern starting at ``conv`` if there is one; return a line describing it.

    Raises ``_Skip`` with the reason when a pattern is there but must not be fused.
    """
    passed: list[fx.Node] = []  # transparent modules between the pieces
    # (a conv module's node becomes the fused module's call: its metadata readers stay valid)
    user = _next(g, conv.node, passed, metadata_ok=conv.module is not None)
    if user is None:
        last = passed[-1] if passed else conv.node
        if any(g.activation(u) or g.bn(u) for u in last.users):
            raise _Skip(f"{conv.node.name}: conv output has {len(last.users)} users")
        return None
    # 1. conv -> relu
    act = g.activation(user)
    if act is not None:
        return _fuse_with_bias(g, conv, user, [user, *reversed(passed), conv.node], None, act, act)
    # 3. conv -> batchnorm [-> relu]
    bn, own = g.bn(user), None
    if bn is None:
        own, bn = _functional_bn(g, user, conv.node)
    if bn is not None:
        training = bn.training and not is_frozen_bn(bn)
        if conv.module is None or training or bn.running_mean is None:
            raise _Skip(f"{conv.node.name}: BN {user.name} in training mode or without stats")
        if g.calls[conv.node.target] != 1 or (own is None and g.calls[user.target] != 1):
            raise _Skip(f"{conv.node.name}: conv or BN module called more than once")
        after: list[fx.Node] = []
        relu = _next(g, user, after)
        act = g.activation(relu)
        if own is not None:
            _check_own_tail(g, conv, own, after, relu if act is not None else None)
        if act is None:
            # No activation: the folded conv runs without one; what follows stays as it was.
            note = "" if relu is None else _activation_note(g, relu)
            _swap_module(g, conv.node.target, g.fold(conv.module, bn, "none"))
            _replace(g, user, conv.node, [user])
            return f"{conv.node.name} -> {user.name} (folded){note}"
        _swap_module(g, conv.node.target, g.fold(conv.module, bn, act))
        _replace(g, relu, conv.node, [relu, *reversed(after), user, *reversed(passed)])
        return f"{conv.node.name} -> {user.name} (folded) -> {relu.name}"
    # 2. conv(bias=None) -> add(bias view) -> relu (a new node replaces the conv's: no
    # metadata readers of it)
    if len(conv.node.users) == 1 and (
        user.op in ("call_function", "call_method")
        and (user.target in _ADD_FUNCTIONS or user.target in ("add", "add_"))
    ):
        relu = _sole_user(user)
        act = g.activation(relu)
        if act is None or conv.has_bias or user.kwargs or passed:
            return None
        if len(user.args) != 2:
            return None
        other = user.args[1] if user.args[0] is conv.node else user.args[0]
        channels = _out_channels(g, conv)
        if not isinstance(other, fx.Node) or channels is None:
            return None
        if not _is_channel_bias(_bias_value(g, other), channels):
            raise _Skip(f"{conv.node.name}: added tensor {other.name} is not a (1, C, 1, 1) bias")
        with g.gm.graph.inserting_before(user):
            flat = g.gm.graph.call_method("reshape", (other, (-1,)))
        return _fuse_with_bias(g, conv, relu, [relu, user, conv.node], flat, f"add+{act}", act)
    return None


_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_BN_DEFAULTS = (None, None, None, None, None, False, 0.1, 1e-5)


def _functional_bn(
    g: _Graph, node: fx.Node, x: fx.Node
) -> tuple[str, nn.BatchNorm2d] | tuple[None, None]:
    """(path, module) of the eval-mode BatchNorm2d whose own parameters and statistics an
    ``F.batch_norm(x, ...)`` call at ``node`` uses: a BN subclass that computes its BN
    functionally and then runs children of its own (timm's ``BatchNormAct2d``: the BN, its
    ``drop``, its ``act``); else (None, None)."""
    if node.op != "call_function" or node.target is not F.batch_norm:
        return None, None
    args = dict(zip(_BN_ARGS, _BN_DEFAULTS, strict=True))
    args.update(zip(_BN_ARGS, node.args, strict=False))
    args.update(node.kwargs)
    mean = args["running_mean"]
    if args["input"] is not x or args["training"] is not False or not isinstance(mean, fx.Node):
        return None, None
    if mean.op != "get_attr" or not mean.target.endswith(".running_mean"):
        return None, None
    path = mean.target.rpartition(".")[0]
    try:
        bn = g.root.get_submodule(path) if g.root is not None and path else None
    except AttributeError:
        bn = None
    if not isinstance(bn, nn.BatchNorm2d) or bn.training or args["eps"] != bn.eps:
        return None, None
    for name in ("running_var", "weight", "bias"):
        value = args[name]
        if getattr(bn, name) is None:
            if value is not None:
                return None, None
        elif not (isinstance(value, fx.Node) and value.op == "get_attr"):
            return None, None
        elif value.target != f"{path}.{name}":
            return None, None
    return path, bn


def _check_own_tail(
    g: _Graph, conv: _Conv, own: str, passed: list[fx.Node], act: fx.Node | None
) -> None:
    """A BN module computed functionally is folded only with all of its own children's calls
    after its BN (its ``drop`` and ``act``) inside the fusion, and an activation fused only if
    it is one of them: the folded module, with the BN put back in training mode, then calls
    that BN module whole."""
    inside = {n.target for n in passed} | ({act.target} if act is not None else set())
    children = {
        n.target
        for n in g.gm.graph.nodes
        if n.op == "call_module" and n.target.startswith(own + ".")
    }
    if not children <= inside or (act is not None and act.target not in children):
        raise _Skip(
            f"{conv.node.name}: BN module {own} runs more after its BN than the fusion takes "
            "(an activation the conv op does not fuse?)"
        )


def _activation_note(g: _Graph, node: fx.Node) -> str:
    """Says that an activation after a folded conv stays a separate op (the conv op fuses
    relu, relu6, hardswish, silu, sigmoid, hardsigmoid and leaky_relu with a slope >= 0
    only)."""
    if node.op == "call_module":
        name = type(g.modules.get(node.target)).__name__
    elif node.op in ("call_function", "call_method"):
        name = getattr(node.target, "__name__", str(node.target))
    else:
        return ""
    if name.lower() in ("add", "add_", "iadd", "cat", "mul", "getitem"):
        return ""
    fused = "ReLU, ReLU6, hardswish, SiLU, sigmoid, hardsigmoid, LeakyReLU with a slope >= 0"
    return f"; {name} after it is not fused (the conv op fuses {fused})"


class _Skip(Exception):
    pass


def _fuse_with_bias(g, conv: _Conv, last, dead, bias_node, what: str, act: str) -> str:
    """Replace the nodes ``dead`` (ending in ``last``) by one call of the fused op with the
    epilogue ``act``."""
    if conv.module is not None and bias_node is None:
        # A conv module and its own bias: swap in the fused module (same parameters).
        if g.calls[conv.node.target] != 1:
            raise _Skip(f"{conv.node.name}: Conv2d module called more than once")
        _swap_module(g, conv.node.target, TVMConv2dBiasReLU.from_conv(conv.module, activation=act))
        _replace(g, last, conv.node, dead[:-1])
        return f"{conv.node.name} -> {last.name}"
    graph = g.gm.graph
    with graph.inserting_before(last):
        weight = conv.weight
        if weight is None:
            weight = graph.get_attr(f"{conv.node.target}.weight")
        bias = bias_node if bias_node is not None else conv.bias
        fused = graph.call_function(
            CONV_OP,
            (conv.x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
            + (True, None if act == "relu" else act),
        )
    _replace(g, last, fused, dead)
    return f"{conv.node.name} -> {what} ({last.name})"


def fuse_conv_bias_relu(model: nn.Module) -> FusionResult:
    """Trace ``model`` and fuse conv2d + bias + ReLU patterns into ``tvm_gemm.conv2d_bias_relu``.

    Returns ``(fused GraphModule, FusionSummary)`` and logs one line (logger
    ``torch_tvm_gemm``). ``model`` itself is not modified (the GraphModule shares its
    parameters; BN-folded convs get new ones). Folding BN uses its running statistics: fuse
    a model in eval mode, for inference.
    """
    gm = _trace(model, "fuse_conv_bias_relu")
    summary = fuse_convs_in_graph(gm, root=model)
    log.info(
        "fuse_conv_bias_relu: fused %d conv2d+bias+relu, skipped %d%s",
        len(summary.fused),
        len(summary.skipped),
        "".join(f"; {s}" for s in summary.skipped),
    )
    return FusionResult(gm, summary)


def fuse_convs_in_graph(
    gm: fx.GraphModule,
    fold=None,
    records: dict[str, str] | None = None,
    root: nn.Module | None = None,
) -> FusionSummary:
    """The conv fusions of ``fuse_conv_bias_relu`` on a traced ``gm`` (rewritten in place).

    ``fold(conv, bn, relu)`` makes the module for a conv -> BN pair (default: a snapshot,
    ``_fold_bn``). ``records`` gets, for each Conv2d module the graph calls, what happened.
    ``root``: the module ``gm`` was traced from (where a BN module that the trace went into,
    computing ``F.batch_norm`` on its own buffers, is found).
    """
    g = _Graph(gm, fold, root)
    summary = FusionSummary()
    records = {} if records is None else records
    for node in list(gm.graph.nodes):
        if node in g.erased:  # part of an earlier fusion
            continue
        conv = _match_conv(g, node)
        if conv is None:
            continue
        target = node.target if node.op == "call_module" else None
        if isinstance(conv, str):
            summary.skipped.append(conv)
            if target is not None:
                records[target] = f"left alone: {conv.split(': ', 1)[-1]}"
            continue
        try:
            line = _try_fuse(g, conv)
        except _Skip as skip:
            summary.skipped.append(str(skip))
            if target is not None:
                records[target] = f"left alone: {str(skip).split(': ', 1)[-1]}"
            continue
        if line is not None:
            summary.fused.append(line)
            if target is not None:
                records[target] = f"fused: {line}"
        elif target is not None:
            records[target] = "left alone: no BN or ReLU follows it (a plain conv stays on torch)"
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return summary


class FusionTracer(fx.Tracer):
    """torch.fx's tracer, with frozen BNs and Conv2d subclasses that only construct
    differently kept as calls (traced through, they are arithmetic on buffers and a
    functional conv, which no pattern matches)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if is_frozen_bn(m) or is_plain_conv2d(m):
            return True
        return super().is_leaf_module(m, qualname)


def _trace(model: nn.Module, caller: str) -> fx.GraphModule:
    try:
        with unchanged_by_trace(model):
            return fx.GraphModule(model, FusionTracer().trace(model))
    except Exception as err:
        raise RuntimeError(
            f"torch_tvm_gemm.{caller}: torch.fx.symbolic_trace cannot trace "
            f"{type(model).__name__} ({type(err).__name__}: {err}); swap modules by hand "
            "with TVMConv2dBiasReLU.from_conv / swap_linear instead"
        ) from err
