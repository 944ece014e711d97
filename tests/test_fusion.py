"""The FX fusion pass, TVMConv2dBiasReLU and convert(): what is fused, what is left alone."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm import TVMConv2dBiasReLU

OP = torch.ops.tvm_gemm.conv2d_bias_relu


def fused_ops(gm) -> int:
    """How many conv2d+bias+relu the traced module runs (functional or module)."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is OP:
            count += 1
        elif node.op == "call_module" and isinstance(
            gm.get_submodule(node.target), TVMConv2dBiasReLU
        ):
            count += 1
    return count


def check(model, x, fused: int, skipped: int = 0):
    """Fuse ``model``; check the counts and that the outputs match the original."""
    model.eval()
    expected = model(x)
    gm, summary = tg.fuse_conv_bias_relu(model)
    assert len(summary.fused) == fused, summary
    assert len(summary.skipped) == skipped, summary
    assert fused_ops(gm) == fused
    assert_close(gm(x), expected, k=200)
    return gm, summary


class ConvAct(nn.Module):
    def __init__(self, act, bias=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=bias)
        self.act = act

    def forward(self, x):
        return self.act(self.conv(x))


RELUS = {
    "module": nn.ReLU(),
    "module-inplace": nn.ReLU(inplace=True),
    "F.relu": F.relu,
    "F.relu-inplace": lambda t: F.relu(t, inplace=True),
    "torch.relu": torch.relu,
    "method": lambda t: t.relu(),
    "method-inplace": lambda t: t.relu_(),
}


@pytest.mark.parametrize("relu", list(RELUS.values()), ids=list(RELUS))
@pytest.mark.parametrize("bias", [True, False])
def test_conv_relu(relu, bias):
    model = ConvAct(relu, bias)
    gm, summary = check(model, randn(2, 3, 10, 9), fused=1)
    assert isinstance(gm.conv, TVMConv2dBiasReLU)
    assert gm.conv.weight is model.conv.weight  # shares the parameters
    assert type(model.conv) is nn.Conv2d  # the original model is untouched


class FunctionalBias(nn.Module):
    """conv2d(x, w, None) + bias put through some view, then relu."""

    def __init__(self, view, module_conv=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3)
        self.b = nn.Parameter(torch.randn(8))
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False) if module_conv else None
        self.view = view

    def forward(self, x):
        y = self.conv(x) if self.conv is not None else F.conv2d(x, self.w, None, 1, 1)
        return F.relu(y + self.view(self.b))


VIEWS = {
    "view": lambda b: b.view(1, -1, 1, 1),
    "reshape": lambda b: b.reshape(1, 8, 1, 1),
    "unsqueeze": lambda b: b.unsqueeze(0).unsqueeze(-1).unsqueeze(-1),
    "index": lambda b: b[None, :, None, None],
    "3d": lambda b: b.view(-1, 1, 1),
}


@pytest.mark.parametrize("view", list(VIEWS.values()), ids=list(VIEWS))
def test_conv_add_bias_relu(view):
    check(FunctionalBias(view), randn(2, 3, 10, 9), fused=1)


def test_conv_module_add_bias_relu():
    gm, _ = check(FunctionalBias(VIEWS["view"], module_conv=True), randn(2, 3, 10, 9), fused=1)
    assert "conv.weight" in gm.state_dict()  # the weight stays where it was


def test_add_of_a_non_bias_is_left_alone():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.t = nn.Parameter(torch.randn(1, 8, 10, 9))  # not per-channel

        def forward(self, x):
            return F.relu(self.conv(x) + self.t)

    check(M(), randn(2, 3, 10, 9), fused=0, skipped=1)


def bn(channels: int) -> nn.BatchNorm2d:
    """A BatchNorm with non-trivial running statistics."""
    m = nn.BatchNorm2d(channels)
    with torch.no_grad():
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 2)
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
    return m


def test_conv_bn_relu_folds_in_eval_mode():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), bn(8), nn.ReLU())
    gm, summary = check(model, randn(2, 3, 10, 9), fused=1)
    assert "folded" in summary.fused[0]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())


def test_folded_conv_bn_compiles_whole_and_sees_new_weights():
    # Under torch.compile the fold is part of the graph: no graph break at the folded conv
    # (fullgraph=True), and the graph folds the tensors as they are at each call, also after
    # a write that torch does not count in the version (through .data).
    conv, norm = nn.Conv2d(3, 8, 3, padding=1), bn(8).eval()
    x = randn(2, 3, 10, 9)
    converted = tg.convert(nn.Sequential(conv, norm, nn.ReLU()).eval())
    compiled = torch.compile(converted, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_close(compiled(x), F.relu(norm(conv(x))), k=27)
        conv.weight.data.mul_(-0.5)  # (the folded conv reads the model's own conv and BN)
        norm.running_var.data.add_(1.0)
        assert_close(compiled(x), F.relu(norm(conv(x))), k=27)


@pytest.mark.parametrize("size, folded", [((10, 9), True), ((2, 2), False)])
def test_compiled_conv_bn_folds_only_a_weight_smaller_than_the_output(monkeypatch, size, folded):
    """Traced, the fold is a pass over the weight at every call: where the weight has more
    values than the conv's output (8 x 3 x 3 x 3 = 216 against 2 x 8 x 2 x 2 = 64) the BN
    is applied to the output instead, with the activation; both give the eager answer."""
    from torch_tvm_gemm import fold

    decisions = []
    real = fold._fold_when_traced
    monkeypatch.setattr(
        fold, "_fold_when_traced", lambda *a: decisions.append(real(*a)) or real(*a)
    )
    conv, norm = nn.Conv2d(3, 8, 3, padding=1), bn(8).eval()
    x = randn(2, 3, *size)
    converted = tg.convert(nn.Sequential(conv, norm, nn.SiLU()).eval())
    compiled = torch.compile(converted, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_close(compiled(x), F.silu(norm(conv(x))), k=27)
        norm.running_mean.data.add_(0.5)  # (read at each call either way)
        assert_close(compiled(x), F.silu(norm(conv(x))), k=27)
    assert decisions and set(decisions) == {folded}


def test_conv_bn_relu_in_training_mode_is_skipped():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), bn(8), nn.ReLU()).train()
    gm, summary = tg.fuse_conv_bias_relu(model)
    assert not summary.fused and "training" in summary.skipped[0]


def test_second_user_is_not_fused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return F.relu(y) + y  # y is needed without the relu

    gm, summary = check(M(), randn(2, 3, 10, 9), fused=0, skipped=1)
    assert "2 users" in summary.skipped[0]


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-bn-relu, conv-bn, + identity, relu."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), bn(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), bn(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + x)


def test_resnet_block():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), BasicBlock(8))
    # conv-relu and conv1-bn1-relu fuse; conv2-bn2 folds, its add + relu (a residual) stay.
    _, summary = check(model, randn(2, 3, 10, 9), fused=3)
    assert summary.fused[-1].endswith("(folded)")


def test_summary_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="torch_tvm_gemm"):
        tg.fuse_conv_bias_relu(ConvAct(nn.ReLU()))
    assert "fuse_conv_bias_relu: fused 1" in caplog.text


def test_state_dict_compatible_with_conv2d():
    conv = nn.Conv2d(3, 8, 3, padding=1)
    fused = TVMConv2dBiasReLU(3, 8, 3, padding=1)
    fused.load_state_dict(conv.state_dict())
    conv.load_state_dict(fused.state_dict())
    x = randn(2, 3, 10, 9)
    assert_close(fused(x), F.relu(conv(x)), k=27)
    assert_close(fused(x[0]), F.relu(conv(x[0])), k=27)  # unbatched, as nn.Conv2d


def test_unsupported_padding_mode():
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        TVMConv2dBiasReLU.from_conv(nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"))


def test_convert_fuses_convs_and_swaps_linears():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
    ).eval()
    x = randn(2, 3, 10, 9)
    expected = model(x)
    converted = tg.convert(model, inplace=False)
    layers = converted.conversion_summary.layers
    assert layers["0"].startswith("fused") and layers["4"].startswith("fused")  # +relu each
    assert layers["6"] == "swapped"
    assert [type(m).__name__ for m in converted.modules()].count("TVMLinear") == 2
    assert_close(converted(x), expected, k=200)
    assert type(model[4]) is nn.Linear  # inplace=False: the original model is untouched
    assert tg.convert(model) is model  # in place: the user's model object


def test_example_runs():
    path = Path(__file__).resolve().parent.parent / "examples" / "cnn_fusion.py"
    spec = importlib.util.spec_from_file_location("cnn_fusion", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(timing=False) == 0


def test_fused_graph_under_torch_compile():
    model = ConvAct(nn.ReLU()).eval()
    x = randn(2, 3, 10, 9)
    gm, _ = tg.fuse_conv_bias_relu(model)
    compiled = torch.compile(gm, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x), model(x), k=27)


def test_bench_conv_cli_runs(tmp_path):
    """The benchmark's command line works (a smoke test: one shape, one call, no timing)."""
    from torch_tvm_gemm.__main__ import main

    out = tmp_path / "bench.json"
    args = ["bench-conv", "--quick", "--batch", "1", "--reps", "1", "--rounds", "1"]
    assert main([*args, "--no-cnn", "--json", str(out)]) == 0
    assert out.exists()
