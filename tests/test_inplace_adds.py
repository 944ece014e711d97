"""Residual adds and gating products written into a TVM layer's fresh output
(``inplace_adds``): same results as eager, and the plain op wherever writing in place would
change anything."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn
from test_convert import bn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm.inplace_adds import _broadcasts_to, add_into, mul_into


class Bottleneck(nn.Module):
    """ResNet's block as transformers writes it: conv -> bn -> Identity, ``+=`` the
    shortcut (a conv or the input), then ReLU."""

    def __init__(self, c_in: int = 4, c_out: int = 8, relu: bool = True):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), bn(c_out)
        self.act1 = nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 1, bias=False), bn(c_out)
        self.drop = nn.Identity()
        self.short = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, bias=False), bn(c_out))
            if c_in != c_out
            else nn.Identity()
        )
        self.act = nn.ReLU() if relu else nn.Identity()

    def forward(self, x):
        residual = self.short(x)
        h = self.drop(self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x))))))
        h += residual
        return self.act(h)


class ResidualFirst(nn.Module):
    """MobileNetV2's spelling: ``residual + conv(x)`` (the TVM output second), no ReLU."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 1, bias=False), bn(8)

    def forward(self, x):
        return x + self.bn(self.conv(x))


class GatedMLP(nn.Module):
    """LLaMA's MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int = 16, h: int = 24):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _nodes(model: nn.Module) -> list:
    """The nodes of every fused graph that ``convert`` set on ``model`` and its children."""
    traced = [m.__dict__["_tvm_traced"] for m in model.modules() if "_tvm_traced" in m.__dict__]
    return [n for t in traced for n in t.gm.graph.nodes]


def _adds(model: nn.Module, target) -> int:
    return sum(1 for n in _nodes(model) if n.op == "call_function" and n.target is target)


def _convert_matches_eager(model: nn.Module, x, run=lambda m, x: m(x)) -> nn.Module:
    """Converts ``model`` in place, checking that ``run(model, x)`` gives eager's result."""
    with torch.no_grad():
        expected = run(model, x)
        tg.convert(model)
        got = run(model, x)
    assert_close(got, expected, k=200)
    return model


@pytest.mark.parametrize("relu", [True, False])
def test_residual_block_adds_in_place_and_matches_eager(relu):
    model = nn.Sequential(Bottleneck(relu=relu), Bottleneck(8, 8, relu=relu)).eval()
    x = randn(2, 4, 9, 10)
    _convert_matches_eager(model, x)
    assert _adds(model, add_into) == 2 and _adds(model, operator.add) == 0
    # each block's final ReLU went into add_into (its first one is fused into conv1)
    relus = [n for n in _nodes(model) if n.op == "call_module" and n.target.endswith("act")]
    assert len(relus) == (0 if relu else 2)  # (without ReLU: the Identity stays)


def test_residual_first_operand_and_no_relu():
    model = ResidualFirst().eval()
    x = randn(2, 8, 5, 6)
    _convert_matches_eager(model, x)
    assert _adds(model, add_into) == 1


def test_training_step_with_in_place_adds_matches_eager():
    """With gradients wanted the add stays out of place: grads as eager's."""
    torch.manual_seed(1)
    eager = nn.Sequential(Bottleneck(), Bottleneck(8, 8)).eval()
    converted = tg.convert(copy.deepcopy(eager))
    x = randn(2, 4, 7, 6)
    for model in (eager, converted):
        model(x).square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), converted.parameters(), strict=True):
        assert q.grad is not None, name
        assert_close(q.grad, p.grad, k=400)


def test_vmap_over_converted_block_matches_eager():
    model = Bottleneck(8, 8).eval()
    x = randn(3, 2, 8, 5, 5)
    _convert_matches_eager(model, x, lambda m, x: torch.func.vmap(m)(x))
    assert _adds(model, add_into) == 1


def test_torch_compile_fullgraph_over_in_place_adds():
    model = nn.Sequential(Bottleneck(), Bottleneck(8, 8)).eval()
    x = randn(2, 4, 6, 5)
    _convert_matches_eager(model, x, lambda m, x: torch.compile(m, fullgraph=True)(x))
    assert _adds(model, add_into) == 2


def test_a_fresh_output_read_twice_is_not_written():
    class TwoUsers(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 1, bias=False), bn(4)

        def forward(self, x):
            y = self.bn(self.conv(x))
            return F.relu(y + x) * y  # y is needed after the add

    model = TwoUsers().eval()
    x = randn(2, 4, 5, 5)
    _convert_matches_eager(model, x)
    assert _adds(model, add_into) == 0


def test_add_into_writes_only_when_the_result_is_the_same():
    with torch.no_grad():
        fresh = randn(2, 3, 4)
        other = randn(3, 4)
        want = torch.relu(fresh + other)
        out = add_into(fresh, other, relu=True)
        assert out.data_ptr() == fresh.data_ptr()  # written into fresh
        torch.testing.assert_close(out, want)

        # the other operand broadcasts the sum past fresh's shape: a new tensor
        small, big = randn(1, 4), randn(3, 4)
        out = add_into(small, big)
        assert out.shape == (3, 4) and out.data_ptr() != small.data_ptr()
        torch.testing.assert_close(out, small + big)

        # type promotion (fp32 + fp64 is fp64) and a Python number: a new tensor
        f32, f64 = randn(3), randn(3, dtype=torch.float64)
        out = add_into(f32, f64)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, f32 + f64)
        out = add_into(f32, 2.0)
        torch.testing.assert_close(out, f32 + 2.0)
        assert out.data_ptr() != f32.data_ptr()

    # gradients wanted: never in place
    leaf = randn(3).requires_grad_()
    fresh = leaf * 2
    out = add_into(fresh, randn(3), relu=True)
    assert out.data_ptr() != fresh.data_ptr()
    out.sum().backward()
    assert leaf.grad is not None


def test_gated_mlp_product_in_place_and_matches_eager():
    model = GatedMLP().eval()
    x = randn(3, 5, 16)
    _convert_matches_eager(model, x)
    assert _adds(model, mul_into) == 1 and _adds(model, operator.mul) == 0


def test_training_step_with_in_place_product_matches_eager():
    """With gradients wanted the product stays out of place: grads as eager's."""
    torch.manual_seed(2)
    eager = GatedMLP()
    converted = tg.convert(copy.deepcopy(eager))
    assert _adds(converted, mul_into) == 1
    x = randn(4, 16)
    for model in (eager, converted):
        model(x).square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), converted.parameters(), strict=True):
        assert q.grad is not None, name
        assert_close(q.grad, p.grad, k=400)


def test_mul_into_writes_only_when_the_result_is_the_same():
    with torch.no_grad():
        fresh, other = randn(2, 3, 4), randn(3, 4)
        want = fresh * other
        out = mul_into(fresh, other)
        assert out.data_ptr() == fresh.data_ptr()
        torch.testing.assert_close(out, want)
        small, big = randn(1, 4), randn(3, 4)
        out = mul_into(small, big)
        assert out.shape == (3, 4) and out.data_ptr() != small.data_ptr()
        torch.testing.assert_close(out, small * big)
        f32, f64 = randn(3), randn(3, dtype=torch.float64)
        out = mul_into(f32, f64)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, f32 * f64)
    leaf = randn(3).requires_grad_()
    fresh = leaf * 2
    out = mul_into(fresh, randn(3))
    assert out.data_ptr() != fresh.data_ptr()
    out.sum().backward()
    assert leaf.grad is not None


@pytest.mark.parametrize(
    "shape, target",
    [
        ((3, 4), (2, 3, 4)),
        ((2, 3, 4), (2, 3, 4)),
        ((1, 4), (3, 4)),
        ((4,), (3, 4)),
        ((), (3,)),
        ((3, 1), (3, 4)),
        ((1,), (0,)),
        ((0,), (1,)),
        ((3, 4), (4,)),
        ((2, 4), (3, 4)),
        ((1, 1, 4), (3, 4)),
        ((3, 4), (3, 1)),
    ],
)
def test_broadcasts_to_agrees_with_torch(shape, target):
    """The in-place check's shape rule: ``other`` may go into ``fresh`` exactly when torch
    broadcasts the two to ``fresh``'s shape."""
    try:
        want = torch.broadcast_shapes(shape, target) == target
    except RuntimeError:  # not broadcastable at all
        want = False
    assert _broadcasts_to(torch.Size(shape), torch.Size(target)) == want
