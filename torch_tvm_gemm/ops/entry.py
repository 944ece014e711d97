"""The package's Python functions' way into the ops: ``torch_tvm_gemm.matmul`` / ``linear`` and
the TVM modules' ``forward``.

The op is the same either way; only the way in differs. ``torch.ops.tvm_gemm.matmul(a, b)``
resolves the overload and parses the arguments against the schema in Python, ~1 us per call
(a 16x16 matmul: 2.2 us against torch.matmul's 1.3 us). The C++ extension's entry
(csrc/python_entry.cpp) makes the same dispatcher call directly (1.6 us). It takes only plain
calls, every tensor an exact ``torch.Tensor`` / ``nn.Parameter`` and no torch-function mode
active, and returns None for the rest (tensor subclasses, modes, FX proxies, bad arguments),
which go through ``torch.ops`` as before. While ``torch.compile`` traces, ``torch.ops`` is
called, so that the graph holds the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _ext
from .matmul_ranks import matmul_any_rank

# False when run, True while dynamo traces (it is one constant-returning call, where
# torch.compiler.is_compiling is two: measurable at 1.7 us per call)
_is_compiling = torch.compiler.is_dynamo_compiling


def _entries():
    ext = _ext.load()
    if ext is None or not hasattr(ext, "matmul_entry"):  # not built, or built before it existed
        return None, None, None
    return ext.matmul_entry, ext.linear_entry, getattr(ext, "grouped_linear_entry", None)


_matmul_entry, _linear_entry, _grouped_linear_entry = _entries()


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)`` computed by a TVM kernel: the op ``torch.ops.tvm_gemm.matmul``.

    The op takes ``a`` 2-D ``(M, K)`` or 3-D ``(B, M, K)`` and ``b`` ``(K, N)`` or
    ``(B, K, N)``, batch dims broadcast as in torch (a batch of 1 against B). Here the other
    ranks ``torch.matmul`` takes are reshaped onto it (``ops/matmul_ranks.py``): 1-D vectors,
    and any number of batch dims, broadcast (e.g. attention's ``(B, H, S, D)``). Dtypes
    float32, float64, bfloat16, float16 (the narrow ones accumulate in float32); both tensors
    of one dtype and device. Differentiable; works under ``torch.compile``.
    """
    if _matmul_entry is not None and not _is_compiling():
        out = _matmul_entry(a, b)
        if out is not None:
            return out
    # (checked after the fast entry, which takes 2-D / 3-D only: no cost to those calls)
    if isinstance(a, Tensor) and isinstance(b, Tensor) and {a.dim(), b.dim()} - {2, 3}:
        return matmul_any_rank(a, b, torch.ops.tvm_gemm.matmul)
    return torch.ops.tvm_gemm.matmul(a, b)


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "none"
) -> Tensor:
    """``act(x @ weight.T + bias)`` in one TVM kernel, like ``F.linear`` plus an activation:
    the op ``torch.ops.tvm_gemm.linear``.

    ``x`` is ``(..., K)``, ``weight`` ``(N, K)`` (or the transpose of a contiguous ``(K, N)``
    matrix, read in place), ``bias`` ``(N,)`` or None, ``activation`` one of ``"none"``,
    ``"relu"``, ``"gelu"`` (exact erf form, as ``F.gelu``), ``"gelu_tanh"``
    (``approximate="tanh"``), ``"silu"``. The activation is applied once to the final sum.
    Differentiable; works under ``torch.compile``.
    """
    if _linear_entry is not None and not _is_compiling():
        out = _linear_entry(x, weight, bias, activation)
        if out is not None:
            return out
    return torch.ops.tvm_gemm.linear(x, weight, bias, activation)


def grouped_linear(
    x: Tensor, counts: list[int], weight: Tensor, bias: Tensor | None, transposed: bool
) -> Tensor:
    """The products of a mixture-of-experts layer (``moe_experts.py``): ``x``'s rows taken in
    groups of ``counts[e]`` rows (in order), group e times expert e's weight ``weight[e]``
    (``(N, K)``, or ``(K, N)`` when ``transposed``) plus ``bias[e]``, each on the linear op,
    the results concatenated ``(sum(counts), N)``. One call into the C++ entry for every
    expert when the call is plain."""
    if _grouped_linear_entry is not None and not _is_compiling():
        out = _grouped_linear_entry(x, counts, weight, bias, transposed)
        if out is not None:
            return out
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            w = weight[e].T if transposed else weight[e]
            outs.append(linear(x[start : start + n], w, None if bias is None else bias[e]))
        start += n
    return torch.cat(outs) if outs else x.new_empty(0, weight.shape[2 if transposed else 1])
