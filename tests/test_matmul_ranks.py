"""torch_tvm_gemm.matmul on the ranks torch.matmul takes beyond the op's 2-D / 3-D: vectors and
any number of broadcast batch dims, reshaped onto the op (ops/matmul_ranks.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm import _ext
from torch_tvm_gemm.ops.matmul_ranks import matmul_any_rank

EXT = _ext.load()

PAIRS = [
    ((5,), (5,)),  # a dot product: 0-D
    ((5,), (5, 3)),
    ((4, 5), (5,)),
    ((5,), (2, 5, 3)),
    ((2, 4, 5), (5,)),
    ((2, 3, 4, 5), (2, 3, 5, 6)),
    ((2, 3, 4, 5), (5, 6)),
    ((4, 5), (2, 3, 5, 6)),
    ((2, 3, 4, 5), (3, 5, 6)),
    ((2, 1, 4, 5), (1, 3, 5, 6)),  # both broadcast
    ((1, 1, 4, 5), (1, 5, 6)),
    ((2, 1, 2, 7, 5), (3, 1, 5, 2)),
    ((2, 0, 4, 5), (5, 6)),  # empty batch
    ((0, 3, 4, 5), (1, 3, 5, 6)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("a_shape,b_shape", PAIRS, ids=str)
def test_matches_torch_matmul(a_shape, b_shape, dtype):
    a, b = randn(*a_shape, dtype=dtype), randn(*b_shape, dtype=dtype)
    out, ref = tg.matmul(a, b), torch.matmul(a.double(), b.double())
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close(out, ref, a_shape[-1])


@pytest.mark.skipif(EXT is None, reason="C++ extension not built")
@pytest.mark.parametrize("a_shape,b_shape", PAIRS, ids=str)
def test_cpp_entry_reshapes_as_python(a_shape, b_shape):
    """The C++ entry's copy of the reshapes (the package function's plain calls) gives the
    same result as ops/matmul_ranks.py, bit for bit, and gradients through its views."""
    a = randn(*a_shape).requires_grad_()
    b = randn(*b_shape).requires_grad_()
    ours = EXT.matmul_entry(a, b)
    python = matmul_any_rank(a, b, torch.ops.tvm_gemm.matmul)
    assert ours.shape == python.shape and torch.equal(ours, python)
    if ours.numel():
        grads = torch.autograd.grad(ours.sum(), (a, b))
        want = torch.autograd.grad(python.sum(), (a, b))
        assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))


@pytest.mark.skipif(EXT is None, reason="C++ extension not built")
def test_cpp_entry_leaves_bad_ranks_to_python():
    """What the C++ entry declines, Python raises for (test_matmul.py, test_matmul_bad_input)."""
    for a, b in [((), (3,)), ((2, 3, 4), (5,)), ((2, 2, 3, 4), (3, 4, 2))]:
        assert EXT.matmul_entry(torch.ones(a), torch.ones(b)) is None


def _recording_op(seen: list):
    def op(a, b):
        seen.append((a, b))
        return torch.ops.tvm_gemm.matmul(a, b)

    return op


def test_attention_scores_reach_the_op_as_views():
    """q @ k^T on (B, H, S, D): one batched call, K^T a transposed view of k (read in place by
    the "nk" kernel), not a copy; a side whose batch dims are all 1 goes as one matrix."""
    q, k = randn(2, 3, 8, 16), randn(2, 3, 8, 16)
    seen = []
    out = matmul_any_rank(q, k.transpose(-2, -1), _recording_op(seen))
    assert_close(out, q @ k.transpose(-2, -1), 16)
    ((a, b),) = seen
    assert a.shape == (6, 8, 16) and b.shape == (6, 16, 8)
    assert b.data_ptr() == k.data_ptr() and b.transpose(1, 2).is_contiguous()
    seen.clear()
    w = randn(1, 1, 16, 4)
    matmul_any_rank(q, w, _recording_op(seen))
    assert seen[0][1].shape == (16, 4) and seen[0][1].data_ptr() == w.data_ptr()


@pytest.mark.parametrize(
    "a_shape,b_shape", [((2, 1, 3, 4), (3, 4, 2)), ((4,), (2, 4, 3)), ((2, 2, 3, 4), (4,))]
)
def test_gradients(a_shape, b_shape):
    a = randn(*a_shape, dtype=torch.float64).requires_grad_()
    b = randn(*b_shape, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(tg.matmul, (a, b))


def test_compiles_fullgraph():
    q, k = randn(2, 3, 8, 16), randn(2, 3, 8, 16)
    fn = torch.compile(lambda q, k: tg.matmul(q, k.transpose(-2, -1)).softmax(-1), fullgraph=True)
    assert_close(fn(q, k), (q @ k.transpose(-2, -1)).softmax(-1), 16)


@pytest.mark.parametrize(
    "a,b,words", [((4,), (4, 2), ["'a'", "1-D"]), ((2, 2, 3, 4), (4, 2), ["'a'", "4-D"])]
)
def test_the_op_keeps_its_ranks(a, b, words):
    with pytest.raises(ValueError) as info:
        torch.ops.tvm_gemm.matmul(torch.ones(*a), torch.ones(*b))
    for w in words:
        assert w in str(info.value)
