"""A converted CNN runs channels-last inside (``region_layout``): an NCHW input is taken as a
channels_last copy, the convs run their kernels over channels-last pixels, and the outputs
come back as eager gives them; graphs that read strides, and regions below the whole model
with fewer than three TVM convs, keep the input's layout."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from conftest import assert_close, randn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm import ops
from torch_tvm_gemm.kernels.conv2d import Conv2dSpec

CL = torch.channels_last


class Net(nn.Module):
    """Conv + BN + ReLU, a max pool, a residual block, a global pool and a linear head; with
    ``features`` it also returns its last feature map, in a dict."""

    def __init__(self, features: bool = False, view: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 1)
        self.head = nn.Linear(32, 10)
        self.features, self.view = features, view

    def forward(self, x):
        y = self.pool(F.relu(self.stem(x)))
        y = F.relu(self.conv1(y) + y)
        f = F.relu(self.conv2(y))
        flat = f.view(f.shape[0], -1) if self.view else None  # (reads the strides)
        logits = self.head(f.mean((2, 3)))
        if self.features:
            return {"logits": logits, "features": f}
        return logits if flat is None else (logits, flat)


def _converted(model):
    for p in model.parameters():
        p.requires_grad_(False)
    (bn,) = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    model.eval()
    return model, tg.convert(copy.deepcopy(model))


def _layouts(model, x) -> set[str]:
    with torch.no_grad(), ops.planning() as plan:
        model(x)
    return {s.layout for s in plan.specs if isinstance(s, Conv2dSpec)}


def test_nchw_input_runs_channels_last_inside():
    torch.manual_seed(0)
    model, converted = _converted(Net(features=True))
    assert converted.__dict__["_tvm_traced"].channels_last
    x = randn(2, 3, 12, 12)
    assert _layouts(converted, x) == {"nhwc"}
    with torch.no_grad():
        got, want = converted(x), model(x)
    assert got["features"].is_contiguous()  # (as eager returns it)
    assert_close(got["features"], want["features"], k=16 * 9)
    assert_close(got["logits"], want["logits"], k=16 * 9 * 4)


def test_channels_last_input_keeps_its_layout():
    torch.manual_seed(0)
    model, converted = _converted(Net(features=True))
    x = randn(2, 3, 12, 12).contiguous(memory_format=CL)
    with torch.no_grad():
        got, want = converted(x), model(x)
    assert got["features"].is_contiguous(memory_format=CL)
    assert want["features"].is_contiguous(memory_format=CL)
    assert_close(got["features"], want["features"], k=16 * 9)


def test_a_graph_that_reads_strides_keeps_the_input_layout():
    """``view`` on a 4-D map of more than one pixel would fail on a channels_last tensor."""
    torch.manual_seed(0)
    model, converted = _converted(Net(view=True))
    assert not converted.__dict__["_tvm_traced"].channels_last
    x = randn(2, 3, 12, 12)
    assert _layouts(converted, x) == {"nchw"}
    with torch.no_grad():
        (got, flat), (want, want_flat) = converted(x), model(x)
    assert_close(got, want, k=16 * 9 * 4)
    assert_close(flat, want_flat, k=16 * 9)


def _doubled_if_positive(x):  # (a branch on a value: fx cannot trace it)
    return x * 2 if x.sum() > 0 else x


torch.fx.wrap("_doubled_if_positive")  # (kept as one call in traced graphs, as users do)


def test_a_graph_calling_untraced_code_keeps_the_input_layout():
    """A helper fx keeps as one call is code nothing checked, which may read strides."""

    class Helped(Net):
        def forward(self, x):
            return super().forward(_doubled_if_positive(x))

    torch.manual_seed(0)
    model, converted = _converted(Helped())
    traced = converted.__dict__["_tvm_traced"]
    assert _doubled_if_positive in [n.target for n in traced.gm.graph.nodes]
    assert not traced.channels_last
    x = randn(2, 3, 12, 12)
    with torch.no_grad():
        assert_close(converted(x), model(x), k=16 * 9 * 4)


def test_a_graph_writing_into_its_input_keeps_the_input_layout():
    """Eager writes into the caller's tensor; a channels_last copy would take the write."""

    class Normalizing(Net):
        def forward(self, x):
            x[:, :1].mul_(2.0)
            return super().forward(x)

    torch.manual_seed(0)
    model, converted = _converted(Normalizing())
    assert not converted.__dict__["_tvm_traced"].channels_last
    x = randn(2, 3, 12, 12)
    x_eager = x.clone()
    with torch.no_grad():
        got, want = converted(x), model(x_eager)
    assert torch.equal(x, x_eager)  # (written into, as eager writes)
    assert_close(got, want, k=16 * 9 * 4)


def test_regions_below_the_whole_model_need_three_convs():
    """A region below the whole model copies its inputs and outputs at each call: it runs
    channels-last with MIN_REGION_CONVS (3) TVM convs, not with one."""

    class Untraceable(nn.Module):  # a branch on a value: fx cannot trace the top
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(  # 3 convs + ReLU
                *(m for c in (3, 8, 8) for m in (nn.Conv2d(c, 8, 3, padding=1), nn.ReLU())),
                nn.BatchNorm2d(8),
            )
            self.tail = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())  # 1 conv

        def forward(self, x):
            return self.tail(self.body(x) if x.sum() > -1e9 else x)

    torch.manual_seed(0)
    model, converted = _converted(Untraceable())
    assert converted.conversion_summary.regions == ["body", "tail"]
    assert converted.body.__dict__["_tvm_traced"].channels_last
    assert not converted.tail.__dict__["_tvm_traced"].channels_last
    x = randn(2, 3, 12, 12)
    with torch.no_grad():
        got = converted(x)
        assert got.is_contiguous()
        assert_close(got, model(x), k=4 * 8 * 9)


def test_gradients_and_compile_through_the_channels_last_graph():
    torch.manual_seed(0)
    model, converted = _converted(Net(features=True))
    x = randn(2, 3, 12, 12).requires_grad_()
    converted(x)["features"].square().sum().backward()
    got = x.grad
    want = torch.autograd.grad(model(x)["features"].square().sum(), x)[0]
    assert got.is_contiguous()  # (a leaf's .grad takes the leaf's strides)
    assert_close(got, want, k=16 * 9 * 16)
    compiled = torch.compile(converted, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(x.detach())
        assert out["features"].is_contiguous()
        assert_close(out["logits"], model(x.detach())["logits"], k=16 * 9 * 4)
