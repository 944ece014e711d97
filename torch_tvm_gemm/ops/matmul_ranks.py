"""``torch_tvm_gemm.matmul`` on every rank ``torch.matmul`` takes, the op's own 2-D and 3-D aside.

The op ``torch.ops.tvm_gemm.matmul`` keeps its schema: ``(M, K)`` or ``(B, M, K)`` on each
side, one batch dimension. The other ranks are reshaped onto it, as ``torch.matmul`` itself
reshapes onto ``bmm``: a 1-D operand gains a dimension for the product and loses it again
(a vector), and batch dimensions are broadcast and flattened into the op's single one. An
operand whose batch dimensions are all 1 is passed as a single matrix, which the op
broadcasts (a single b: one GEMM over all of a's rows); the others are views where the
strides allow, so attention's
``q @ k.transpose(-2, -1)`` on ``(B, H, S, D)`` reaches the op as ``(B*H, S, D)`` against a
transposed ``(B*H, D, S)`` view, which the kernel reads in place. All of it is torch's own
reshapes: autograd, ``torch.compile`` and autocast go through the op as for 2-D and 3-D.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def matmul_any_rank(a: Tensor, b: Tensor, op: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``torch.matmul(a, b)`` for any ranks, through ``op`` (2-D / 3-D operands only)."""
    for name, t in (("a", a), ("b", b)):
        if t.dim() == 0:
            raise ValueError(
                f"tvm_gemm.matmul: argument '{name}' must have at least 1 dimension, got a 0-D "
                "tensor"
            )
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        which = "only" if b.dim() == 1 else "second to last"
        raise ValueError(
            f"tvm_gemm.matmul: inner dims differ: a is {tuple(a.shape)}, b is "
            f"{tuple(b.shape)} (a's last dim must equal b's {which} dim)"
        )
    batch = _broadcast(a2.shape[:-2], b2.shape[:-2])
    if batch is None:
        raise ValueError(
            f"tvm_gemm.matmul: batch dims of a {tuple(a.shape)} and b {tuple(b.shape)} "
            "cannot be broadcast"
        )
    out = op(_flat(a2, batch), _flat(b2, batch))
    out = out.reshape(*batch, a2.shape[-2], b2.shape[-1])
    if a.dim() == 1:
        out = out.squeeze(-2)
    if b.dim() == 1:
        out = out.squeeze(-1)
    return out


def _broadcast(x: torch.Size, y: torch.Size) -> tuple[int, ...] | None:
    """The broadcast of two batch shapes, or None where they do not broadcast (plain Python:
    ``torch.broadcast_shapes`` costs ~12 us a call, most of a small product's time)."""
    if x == y:
        return tuple(x)
    x, y = (1,) * (len(y) - len(x)) + tuple(x), (1,) * (len(x) - len(y)) + tuple(y)
    if any(i != j and 1 not in (i, j) for i, j in zip(x, y, strict=True)):
        return None
    return tuple(j if i == 1 else i for i, j in zip(x, y, strict=True))


def _flat(t: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``t`` (``(..., rows, cols)``) as the op takes it for the broadcast ``batch``: a single
    matrix where its own batch dims are all 1 (or none), else ``(prod(batch), rows, cols)``
    (a view where the strides allow; broadcast dims are copied, as torch.matmul does)."""
    own, matrix = t.shape[:-2], t.shape[-2:]
    if own == batch:  # (the usual case: no broadcast)
        return t.flatten(0, -3) if t.dim() > 3 else t
    count = math.prod(batch)
    if math.prod(own) == 1 and count != 0:
        return t.reshape(matrix)
    return t.expand(*batch, *matrix).reshape(count, *matrix)
