"""Channels-last inside a converted CNN: a traced region whose convs run on TVM ops takes an
NCHW input as a channels_last copy, and its 4-D outputs come back contiguous.

The conv kernels over channels-last pixels read and write the layout as it lies (no
transposing write-back, the folded weights read in place), the 1x1 convs are one GEMM over
all pixels, and torch's pointwise ops, pools and concatenations keep the layout: the whole
graph then runs channels-last, as inductor's layout optimization runs a compiled CNN. The
values are the same; only the strides inside the graph change. So a graph that reads
strides (``view``, ``stride()``, ``data_ptr()``, ``as_strided``...) keeps the input's
layout. A region below the whole model (where ``convert`` could not trace the top: most
transformers models) copies its inputs and outputs at each call, which pays for at least
MIN_REGION_CONVS convs: measured (AMD EPYC, 2 threads, converted / eager, batch 1 / 8, NCHW
inside -> channels-last inside), transformers' ResNet-50, five regions of 1 to 19 convs,
1.12 -> 1.18 / 1.21 -> 1.23; its MobileNetV2, eighteen regions of 1 or 3 convs, 1.57 ->
1.63 / 1.70 -> 1.70; torchvision's ResNet-50 traced whole 1.19 -> 1.36 / 1.21 -> 1.36.
"""

from __future__ import annotations

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree

from .conv_module import CONV_OP, TVMConv2dBiasReLU
from .fold import TVMConv2dBN
from .fusion import writes_in_place

CL = torch.channels_last

# Tensor methods (and functions) that depend on the strides, not only the values (a view
# of a shape the strides cannot give raises): a graph calling one keeps the layout it is
# given. So does a graph calling code fx did not trace: a helper kept as one call (see
# model_convert), an ``nn.Unflatten``.
_STRIDE_BOUND = frozenset(
    {
        "view", "view_as", "unflatten", "stride", "data_ptr", "is_contiguous", "as_strided",
        "storage", "untyped_storage", "storage_offset", "numpy", "set_", "resize_",
    }
)  # fmt: skip
_KNOWN_FUNCTION_MODULES = ("torch", "torch_tvm_gemm", "_operator", "operator", "builtins", "math")


MIN_REGION_CONVS = 3  # TVM convs in a region below the whole model (see the module doc)

# Ops whose result may share an input's memory: an in-place op on one would write into the
# caller's tensor in eager, and into the channels_last copy here.
_ALIASING = frozenset(
    {
        "getitem", "narrow", "select", "permute", "transpose", "squeeze", "unsqueeze",
        "expand", "reshape", "flatten", "contiguous", "detach", "view", "view_as",
    }
)  # fmt: skip


def _writes_an_input(gm: fx.GraphModule) -> bool:
    """Whether the graph writes in place into one of its inputs (or a view of one)."""
    aliases = {node for node in gm.graph.nodes if node.op == "placeholder"}
    for node in gm.graph.nodes:  # (in graph order: a node's arguments come before it)
        if not node.args or not isinstance(node.args[0], fx.Node) or node.args[0] not in aliases:
            continue
        if writes_in_place(node):
            return True
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if name in _ALIASING:
            aliases.add(node)
    return False


def runs_channels_last(gm: fx.GraphModule, whole_model: bool) -> bool:
    """Whether the fused graph ``gm`` may run channels-last: it calls nothing that reads
    strides, writes into no input, and calls a TVM conv (MIN_REGION_CONVS of them for a
    region below the whole model)."""
    if _writes_an_input(gm):
        return False
    modules = dict(gm.named_modules())
    convs = 0
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = modules.get(node.target)
            convs += isinstance(module, TVMConv2dBN | TVMConv2dBiasReLU)
            if isinstance(module, nn.Unflatten):
                return False
        elif node.op == "call_function":
            convs += node.target is CONV_OP
            home = (getattr(node.target, "__module__", None) or "").split(".")[0]
            if home not in _KNOWN_FUNCTION_MODULES:
                return False
            if getattr(node.target, "__name__", None) in _STRIDE_BOUND:
                return False
        elif node.op == "call_method" and node.target in _STRIDE_BOUND:
            return False
    return convs >= (1 if whole_model else MIN_REGION_CONVS)


def _wants_channels_last(t) -> bool:
    if not (
        isinstance(t, Tensor)
        and t.dim() == 4
        and t.device.type == "cpu"
        and t.dtype in (torch.float32, torch.bfloat16)
    ):
        return False
    try:  # (one channel or one pixel: both layouts at once)
        return t.is_contiguous() and not t.is_contiguous(memory_format=CL)
    except RuntimeError:  # a tensor under vmap answers no memory-format query: left as it is
        return False


def to_channels_last(args: tuple) -> tuple | None:
    """``args`` with each NCHW image batch as a channels_last copy, or None if none is one."""
    if not any(_wants_channels_last(a) for a in args):
        return None
    return tuple(a.contiguous(memory_format=CL) if _wants_channels_last(a) else a for a in args)


def _contiguous(t):
    if isinstance(t, Tensor) and t.dim() == 4 and not t.is_contiguous():
        return t.contiguous()
    return t


def restore_contiguous(output):
    """``output`` (a tensor, or tuples, lists, dicts of them) with 4-D tensors contiguous, as
    the graph would have returned them for its NCHW input."""
    return _pytree.tree_map(_contiguous, output)
