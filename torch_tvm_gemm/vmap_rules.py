"""``torch.vmap`` rules for the tvm_gemm ops: a batch over the input only is folded into the
op's own leading dims (one kernel call), and matmul folds any batching into its batch dim;
the other batchings (a batched weight or conv input and more) run once per sample. Without
rules, torch's fallback runs every vmap per sample (and warns about it)."""

from __future__ import annotations

import torch

from . import ops  # noqa: F401 (defines the ops first)
from .ops.checks import check_matmul
from .ops.matmul_ranks import matmul_any_rank

_OPS = torch.ops.tvm_gemm


def _dims(in_dims) -> list[int | None]:
    """The batch dim of each argument; None for unbatched ones and for non-tensor arguments
    (vmap gives an int[] argument a list of Nones)."""
    return [d if isinstance(d, int) else None for d in in_dims]


def _per_sample(op, info, in_dims, args):
    """``op`` on each sample of the batched arguments, stacked along dim 0."""
    outs = []
    for i in range(info.batch_size):
        sample = [
            a.select(d, i) if d is not None else a for a, d in zip(args, in_dims, strict=True)
        ]
        outs.append(op(*sample))
    return torch.stack(outs), 0


def _linear_vmap(info, in_dims, x, weight, bias=None, activation="none"):
    in_dims = _dims(in_dims)
    x_dim, *rest = in_dims
    if x_dim is not None and all(d is None for d in rest):
        return _OPS.linear(x.movedim(x_dim, 0), weight, bias, activation), 0  # (..., K) rows
    args, dims = (x, weight, bias, activation), (*in_dims, None)[:4]
    return _per_sample(_OPS.linear, info, dims, args)


def _matmul_vmap(info, in_dims, a, b):
    """One call for any batching: the vmap dim becomes a batch dim in front of the samples' own
    (each sample 2-D or 3-D, as the op takes), and ``matmul_any_rank`` flattens them into
    the op's one batch dim (views where it can)."""
    in_dims = _dims(in_dims)
    a_dim, b_dim = in_dims
    ranks = [t.dim() - (d is not None) for t, d in ((a, a_dim), (b, b_dim))]
    if not set(ranks) <= {2, 3}:  # the op's own error, from a sample
        return _per_sample(_OPS.matmul, info, in_dims, (a, b))
    if info.batch_size:  # (errors name a sample's shapes, as the op's own do)
        check_matmul(*(t if d is None else t.select(d, 0) for t, d in ((a, a_dim), (b, b_dim))))
    front = max(ranks) - 2  # the samples' batch dims (0 or 1), right of the vmap dim

    def batched(t, d, rank):
        if d is None:
            return t  # (broadcast: its batch dims align with the samples' from the right)
        t = t.movedim(d, 0)
        return t.unsqueeze(1) if rank - 2 < front else t

    return matmul_any_rank(batched(a, a_dim, ranks[0]), batched(b, b_dim, ranks[1]), _OPS.matmul), 0


def _conv_vmap(info, in_dims, x, weight, bias, *geometry):
    in_dims = _dims(in_dims)
    x_dim, *rest = in_dims
    if x_dim is not None and all(d is None for d in rest):
        xs = x.movedim(x_dim, 0)  # (B, N, C, H, W): the images of every sample in one call
        out = _OPS.conv2d_bias_relu(xs.flatten(0, 1), weight, bias, *geometry)
        return out.unflatten(0, xs.shape[:2]), 0
    args = (x, weight, bias, *geometry)
    return _per_sample(
        _OPS.conv2d_bias_relu, info, (*in_dims, *[None] * len(geometry))[: len(args)], args
    )


torch.library.register_vmap("tvm_gemm::linear", _linear_vmap)
torch.library.register_vmap("tvm_gemm::matmul", _matmul_vmap)
torch.library.register_vmap("tvm_gemm::conv2d_bias_relu", _conv_vmap)
