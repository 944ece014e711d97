"""The ops as PyTorch sees them: opcheck, gradcheck, torch.compile, torch.export."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_close, randn

import torch_tvm_gemm as tg

MATMUL_CASES = [
    ((7, 33), (33, 5)),
    ((3, 7, 33), (33, 5)),
    ((2, 5, 9), (2, 9, 4)),
    ((1, 5, 9), (3, 9, 4)),
]
LINEAR_CASES = [
    ((7, 33), (5, 33), True, "relu"),
    ((2, 3, 9), (4, 9), False, "gelu"),
    ((17, 9), (4, 9), True, "none"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sa,sb", MATMUL_CASES)
def test_opcheck_matmul(sa, sb, dtype):
    a = randn(*sa, dtype=dtype).requires_grad_(dtype != torch.float16)
    b = randn(*sb, dtype=dtype)
    torch.library.opcheck(torch.ops.tvm_gemm.matmul, (a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sx,sw,has_bias,act", LINEAR_CASES)
def test_opcheck_linear(sx, sw, has_bias, act, dtype):
    x = randn(*sx, dtype=dtype).requires_grad_()
    w = randn(*sw, dtype=dtype).requires_grad_()
    b = randn(sw[0], dtype=dtype) if has_bias else None
    torch.library.opcheck(torch.ops.tvm_gemm.linear, (x, w, b, act))


@pytest.mark.parametrize("sa,sb", MATMUL_CASES)
def test_gradcheck_matmul(sa, sb):
    a = randn(*sa, dtype=torch.float64).requires_grad_()
    b = randn(*sb, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(tg.matmul, (a, b))


@pytest.mark.parametrize("sx,sw,has_bias,act", LINEAR_CASES)
def test_gradcheck_linear(sx, sw, has_bias, act):
    x = randn(*sx, dtype=torch.float64).requires_grad_()
    w = randn(*sw, dtype=torch.float64).requires_grad_()
    b = randn(sw[0], dtype=torch.float64).requires_grad_() if has_bias else None
    assert torch.autograd.gradcheck(lambda x, w, b: tg.linear(x, w, b, act), (x, w, b))


def test_grads_match_torch_float32():
    x = randn(20, 33).requires_grad_()
    w, b = randn(17, 33).requires_grad_(), randn(17).requires_grad_()
    tg.linear(x, w, b, "gelu").square().sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.gelu(F.linear(x, w, b)).square().sum().backward()
    for got, t in zip(grads, (x, w, b), strict=True):
        assert_close(got, t.grad, 33)


_LINEAR_OPS = {
    "linear": lambda x, w, b: tg.linear(x, w, b),
    "ops.linear": lambda x, w, b: torch.ops.tvm_gemm.linear(x, w, b, "none"),
}
_MATMUL_OPS = {
    "matmul": lambda x, w: tg.matmul(x, w.t()),
    "ops.matmul": lambda x, w: torch.ops.tvm_gemm.matmul(x, w.t()),
}


@pytest.mark.parametrize("name", [*_LINEAR_OPS, *_MATMUL_OPS])
@pytest.mark.parametrize("path", ["cpp", "python"])
def test_inplace_write_into_nd_output_under_autograd(name, path):
    # wav2vec2 writes into a Linear's 3-D output in training (hidden[mask] = embedding): an
    # output returned as a view of the op's 2-D result made autograd refuse the write.
    if path == "cpp" and tg._ext.load() is None:
        pytest.skip("C++ extension not built")
    if name in _LINEAR_OPS:
        op, ref = _LINEAR_OPS[name], F.linear
    else:  # the bias added after the write
        op, ref = _MATMUL_OPS[name], lambda x, w: x @ w.t()
    previous = tg.ops.use_impl(path)
    try:
        _check_inplace_write(op, ref)
    finally:
        tg.ops.use_impl(previous)


def _check_inplace_write(op, ref) -> None:
    x = randn(2, 5, 24).requires_grad_()
    w, b = randn(16, 24).requires_grad_(), randn(16).requires_grad_()
    mask = torch.tensor([[True, False, True, False, False], [False, True, False, False, True]])
    fill = randn(16).requires_grad_()
    with_bias = ref is F.linear

    def loss(fn):
        y = fn(x, w, b) if with_bias else fn(x, w)
        y[mask] = fill
        return ((y if with_bias else y + b) * torch.arange(16.0)).square().sum()

    loss(op).backward()
    grads = [t.grad.clone() for t in (x, w, b, fill)]
    for t in (x, w, b, fill):
        t.grad = None
    loss(ref).backward()
    for got, t in zip(grads, (x, w, b, fill), strict=True):
        assert_close(got, t.grad, 24)


def test_torch_compile_fullgraph_forward_backward():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.b1 = torch.nn.Parameter(randn(32, 16)), torch.nn.Parameter(randn(32))
            self.w2 = torch.nn.Parameter(randn(32, 8))

        def forward(self, x):
            h = torch.ops.tvm_gemm.linear(x, self.w1, self.b1, "relu")
            return torch.ops.tvm_gemm.matmul(h, self.w2)

    net = Net()
    x = randn(5, 16)
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    ref = F.relu(F.linear(x, net.w1, net.b1)) @ net.w2
    assert_close(out, ref, 32)
    out.sum().backward()
    got = net.w1.grad.clone()
    net.zero_grad()
    ref.sum().backward()
    assert_close(got, net.w1.grad, 32)


def test_torch_compile_inductor():
    fn = torch.compile(lambda x, w, b: tg.linear(x, w, b, "gelu") * 2, fullgraph=True)
    x, w, b = randn(9, 16), randn(8, 16), randn(8)
    assert_close(fn(x, w, b), F.gelu(F.linear(x, w, b)) * 2, 16)


def test_inductor_passes_one_buffer_to_every_consumer():
    """An input computed in the graph (a normalization before q, k and v) is written once for
    all the ops that read it: the ops take any layout (``flexible_layout``), so Inductor does
    not copy their inputs into a buffer of fixed strides per call (it wrote three)."""
    from torch._inductor.utils import run_and_get_code

    def f(x, w1, w2, w3):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        a = torch.relu(tg.linear(h, w1))  # (work between the consumers, as RoPE in a model)
        return a + tg.linear(h, w2) + tg.matmul(h, w3.t())

    x, w1, w2, w3 = randn(4, 16, 32), randn(8, 32), randn(8, 32), randn(8, 32)
    with torch._inductor.config.patch(force_disable_caches=True):  # (code from before a change)
        out, (code, *_) = run_and_get_code(torch.compile(f), x, w1, w2, w3)
    assert_close(out, f(x, w1, w2, w3), k=32)
    inputs = re.findall(
        r"tvm_gemm\.(?:linear|matmul)\.default\((?:reinterpret_tensor\()?(\w+)", code
    )
    assert len(inputs) == 3 and len(set(inputs)) == 1, inputs


def test_torch_export():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = randn(3, 16)
    ref = model(x)
    tg.swap_linear(model)
    exported = torch.export.export(model, (x,))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "tvm_gemm.linear.default" in targets
    assert_close(exported.module()(x), ref, 16)
