"""Channels-last inside a converted CNN: a traced model whose convs run on TVM ops takes an
NCHW input as a channels_last copy, and its 4-D outputs come back contiguous.

The conv kernels over channels-last pixels read and write the layout as it lies (no
transposing write-back, the folded weights read in place), the 1x1 convs are one GEMM over
all pixels, and torch's pointwise ops, pools and concatenations keep the layout: the whole
graph then runs channels-last, as inductor's layout optimization runs a compiled CNN. The
values are the same; only the strides inside the graph change. So a graph that reads
strides (``view``, ``stride()``, ``data_ptr()``, ``as_strided``...) keeps the input's
layout, as does any region but the whole model (each region's outputs would be copied back
at its end, and its inputs copied again at the next).
"""

from __future__ import annotations

import torch
from torch import Tensor, fx
from torch.utils import _pytree

from .conv_module import CONV_OP, TVMConv2dBiasReLU
from .fold import TVMConv2dBN

CL = torch.channels_last

# Tensor methods (and functions) whose result depends on the strides, not only the values:
# a graph calling one keeps the layout it is given.
_STRIDE_BOUND = frozenset(
    {
        "view", "view_as", "stride", "data_ptr", "is_contiguous", "as_strided", "storage",
        "untyped_storage", "storage_offset", "numpy", "set_", "resize_", "unfold",
    }
)  # fmt: skip


def runs_channels_last(gm: fx.GraphModule) -> bool:
    """Whether the fused graph ``gm`` of a whole model may run channels-last: it calls a TVM
    conv and nothing that reads strides."""
    modules = dict(gm.named_modules())
    has_conv = False
    for node in gm.graph.nodes:
        if node.op == "call_module":
            has_conv |= isinstance(modules.get(node.target), TVMConv2dBN | TVMConv2dBiasReLU)
        elif node.op == "call_function":
            has_conv |= node.target is CONV_OP
            if getattr(node.target, "__name__", None) in _STRIDE_BOUND:
                return False
        elif node.op == "call_method" and node.target in _STRIDE_BOUND:
            return False
    return has_conv


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
