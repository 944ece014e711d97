"""convert() on models torch.fx cannot trace whole, and what its summary says (torch only)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn
from torch import nn

import torch_tvm_gemm as tg


def bn(channels: int) -> nn.BatchNorm2d:
    """A BatchNorm with non-trivial running statistics."""
    m = nn.BatchNorm2d(channels)
    with torch.no_grad():
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 2)
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
    return m


class Block(nn.Module):
    """Traceable: conv -> bn -> relu, then a linear + SiLU MLP on the pooled features."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), bn(8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        return self.fc2(F.silu(self.fc1(y.mean((2, 3)))))


class DataDependent(nn.Module):
    """Untraceable top level (a branch on a tensor value) around traceable children."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Sequential(nn.Linear(4, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 2))

    def forward(self, x, scale: float = 1.0):
        y = self.block(x)
        if y.sum() > 0:  # data-dependent control flow: fx cannot trace this
            y = y * scale
        return self.head(y)


def test_untraceable_top_level_converts_its_children(caplog):
    model = DataDependent().eval()
    x = randn(2, 3, 10, 9)
    expected = model(x)
    keys = model.state_dict().keys()
    with caplog.at_level(logging.INFO, logger="torch_tvm_gemm"):
        assert tg.convert(model) is model
    summary = model.conversion_summary
    assert "" in summary.untraced and "control flow" in summary.untraced[""]
    assert sorted(summary.regions) == ["block", "head"]
    assert (
        summary.layers["block.conv"].startswith("fused")
        and "folded" in summary.layers["block.conv"]
    )
    assert summary.layers["block.fc1"].endswith("(silu)")
    assert summary.layers["head.0"].endswith("(gelu_tanh)")
    assert summary.layers["block.fc2"] == summary.layers["head.2"] == "swapped"
    assert summary.converted() == summary.found() == 5
    assert "convert(DataDependent): 4/4 linear, 1/1 conv2d on TVM ops" in caplog.text
    assert_close(model(x), expected, k=200)
    assert_close(model(x, 2.0), DataDependent.forward(model, x, 2.0), k=200)  # kwargs work
    assert model.state_dict().keys() == keys  # BN stays in the model: same keys
    clone = copy.deepcopy(model)
    assert clone.block.conv.weight is not model.block.conv.weight
    assert_close(clone(x), expected, k=200)


def test_converted_model_pickles(tmp_path):
    model = tg.convert(DataDependent().eval())
    x = randn(2, 3, 10, 9)
    expected = model(x)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded.conversion_summary.regions == ["block", "head"]
    assert_close(loaded(x), expected, k=200)


def test_state_dict_round_trip_and_refold():
    reference = DataDependent().eval()
    model = tg.convert(copy.deepcopy(reference))
    x = randn(2, 3, 10, 9)
    other = DataDependent().eval()  # new weights and BN statistics
    with torch.no_grad():
        other.block.bn.running_mean.uniform_(-1, 1)
    model.load_state_dict(other.state_dict())
    assert_close(model(x), other(x), k=200)  # the folded conv picked up the new tensors
    reference.load_state_dict(model.state_dict())
    assert_close(reference(x), other(x), k=200)


def test_training_step_matches_eager():
    torch.manual_seed(3)
    eager = DataDependent().eval()
    converted = tg.convert(copy.deepcopy(eager))
    x = randn(4, 3, 10, 9)
    for model in (eager, converted):
        model(x).square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), converted.parameters(), strict=True):
        assert q.grad is not None, name
        assert_close(q.grad, p.grad, k=200)


def test_region_traced_in_eval_runs_its_own_forward_in_training():
    # The fusion drops the eval-mode Dropout between the linear and its ReLU: in training
    # mode the module's own forward (dropout included) must run instead of the fused graph.
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    tg.convert(model.eval())
    assert "(relu)" in model.conversion_summary.layers["0"], model.conversion_summary.layers
    x = randn(8, 16)
    for mode in ("train", "eval", "train"):
        for m in (model, reference):
            getattr(m, mode)()
        torch.manual_seed(5)
        got = model(x)
        torch.manual_seed(5)
        assert_close(got, reference(x), k=16)


def test_call_outside_the_trace_runs_the_module_forward():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, mask=None):
            y = F.relu(self.fc(x))
            return y if mask is None else y * mask

    model, x, mask = Gate(), randn(3, 8), randn(3, 8)
    expected, expected_masked = model(x), model(x, mask)
    tg.convert(model)
    assert model.conversion_summary.regions == ["<top>"]
    assert_close(model(x), expected, k=8)  # traced with mask=None: the fused graph
    assert_close(model(x, mask), expected_masked, k=8)  # not covered: the module's forward
    assert_close(model(x, mask=mask), expected_masked, k=8)


class Recorder(nn.Module):
    """Traceable tensor math with Python side effects on itself that a graph would skip."""

    def __init__(self, effect: str):
        super().__init__()
        self.fc, self.effect, self.calls, self.inputs = nn.Linear(8, 8), effect, 0, []
        self.state = {"seen": [], "caches": [{}]}  # containers in containers

    def forward(self, x):
        if self.effect == "assign":
            self.last_input = x
        elif self.effect == "count":
            self.calls += 1
        elif self.effect == "append":
            self.inputs.append(x)
        elif self.effect == "buffer":
            self.register_buffer("seen", x)
        elif self.effect == "nested-append":
            self.state["seen"].append(x)
        elif self.effect == "nested-assign":
            self.state["caches"][0]["last"] = x
        return F.relu(self.fc(x))


@pytest.mark.parametrize(
    "effect", ["assign", "count", "append", "buffer", "nested-append", "nested-assign"]
)
def test_side_effects_on_modules_are_kept(effect):
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rec, self.mlp = Recorder(effect), nn.Sequential(nn.Linear(8, 8), nn.ReLU())

        def forward(self, x):
            return self.mlp(self.rec(x))

    model, x = Outer(), randn(3, 8)
    expected = model(x)
    model.rec.__dict__.pop("last_input", None)
    model.rec.calls, model.rec.inputs = 0, []
    model.rec._buffers.pop("seen", None)
    model.rec.state = {"seen": [], "caches": [{}]}
    before = dict(model.rec.__dict__)
    tg.convert(model)
    summary = model.conversion_summary
    # The modules whose trace would skip the side effect run their own forward; the trace
    # left nothing on them (no Proxy, no count, no appended input).
    assert {"", "rec"} <= summary.untraced.keys() and "side effect" in summary.untraced["rec"]
    assert summary.regions == ["mlp"] and summary.layers["rec.fc"] == "swapped"
    assert model.rec.calls == 0 and model.rec.inputs == [] and "seen" not in model.rec._buffers
    assert model.rec.state == {"seen": [], "caches": [{}]}
    assert {k: v for k, v in model.rec.__dict__.items() if k != "_modules"} == {
        k: v for k, v in before.items() if k != "_modules"
    }
    assert_close(model(x), expected, k=8)
    assert_close(model(x), expected, k=8)
    if effect == "assign":
        assert model.rec.last_input is x
    elif effect == "count":
        assert model.rec.calls == 2
    elif effect == "append":
        assert len(model.rec.inputs) == 2 and model.rec.inputs[1] is x
    elif effect == "buffer":
        assert model.rec.seen is x
    elif effect == "nested-append":
        assert len(model.rec.state["seen"]) == 2 and model.rec.state["seen"][1] is x
    else:
        assert model.rec.state["caches"][0]["last"] is x


def test_many_nested_containers_still_leave_the_module_dicts_watched():
    model, x = Recorder("buffer"), randn(3, 8)
    model.tables = [[i] for i in range(3000)]  # more than the snapshot copies of nested ones
    tg.convert(model)
    assert "side effect" in model.conversion_summary.untraced[""]
    assert "seen" not in model._buffers
    model(x)
    assert model.seen is x


def test_constants_fx_stores_are_not_a_side_effect():
    class WithConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return F.relu(self.fc(x)) + torch.arange(8.0)  # computed at trace time: a constant

    model, x = WithConstant(), randn(3, 8)
    expected = model(x)
    tg.convert(model)
    assert model.conversion_summary.regions == ["<top>"], model.conversion_summary.untraced
    assert not [k for k in vars(model) if "constant" in k]  # fx's copy went to the graph only
    assert_close(model(x), expected, k=8)


def test_a_failed_trace_leaves_no_proxy_behind():
    class AssignsThenBranches(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            self.last_input = x
            if x.sum() > 0:  # fx fails here, after the assignment
                x = -x
            return F.relu(self.fc(x))

    model, x = AssignsThenBranches(), randn(2, 8)
    tg.convert(model)
    assert not hasattr(model, "last_input")
    assert model(x) is not None and model.last_input is x


def test_fuse_conv_bias_relu_refuses_a_side_effect():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.calls = nn.Conv2d(3, 4, 3), 0

        def forward(self, x):
            self.calls += 1
            return F.relu(self.conv(x))

    model = Counts()
    with pytest.raises(RuntimeError, match=r"fuse_conv_bias_relu.*changes calls.*side effect"):
        tg.fuse_conv_bias_relu(model)
    assert model.calls == 0


class TimmBlock(nn.Module):
    """timm's ConvNormAct: conv -> bn -> drop (Identity) -> act."""

    def __init__(self, channels: int = 3):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, 8, 3, padding=1, bias=False), bn(8)
        self.drop, self.act = nn.Identity(), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.drop(self.bn(self.conv(x))))


def test_timm_style_conv_bn_identity_act_fuses():
    model = nn.Sequential(TimmBlock(), nn.Dropout(0.1), TimmBlock(8)).eval()
    x = randn(2, 3, 10, 9)
    expected = model(x)
    tg.convert(model)
    layers = model.conversion_summary.layers
    assert layers["0.conv"].endswith("(folded) -> _0_act"), layers
    assert layers["2.conv"].endswith("(folded) -> _2_act"), layers
    assert_close(model(x), expected, k=200)


def same_padding(x, conv):
    """TensorFlow's "SAME" padding for ``conv``: it branches on the input's size, so fx
    cannot trace it (as transformers' MobileNet ``apply_tf_padding``)."""
    size, stride, kernel = x.shape[-1], conv.stride[0], conv.kernel_size[0]
    if size % stride == 0:
        pad = max(kernel - stride, 0)
    else:
        pad = max(kernel - size % stride, 0)
    return F.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))


class SamePaddedConv(nn.Module):
    def __init__(self, channels: int = 3, stride: int = 2):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, 8, 3, stride, bias=False), bn(8)
        self.act = nn.ReLU6()

    def forward(self, x):
        return self.act(self.bn(self.conv(same_padding(x, self.conv))))


def test_shape_dependent_helper_runs_as_one_call_and_the_conv_fuses():
    model = nn.Sequential(SamePaddedConv(), SamePaddedConv(8, 1)).eval()
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    tg.convert(model)
    summary = model.conversion_summary
    assert summary.converted() == summary.found() == 2, summary
    assert all("(folded)" in what for what in summary.layers.values()), summary.layers
    assert list(model.state_dict()) == keys
    # the helper runs at every call on the real input: even and odd sizes pad differently
    for size in (10, 11):
        x = randn(2, 3, size, size)
        assert_close(model(x), reference(x), k=100)


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d: a BatchNorm2d subclass that computes its BN with F.batch_norm
    (after a check of the input's rank), then its own ``drop`` and ``act``."""

    def __init__(self, channels: int, act: nn.Module):
        super().__init__(channels)
        self.drop, self.act = nn.Identity(), act
        with torch.no_grad():
            self.running_mean.uniform_(-1, 1)
            self.running_var.uniform_(0.5, 2)
            self.weight.uniform_(0.5, 1.5)
            self.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        training = self.training
        x = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, training, 0.1, self.eps
        )
        return self.act(self.drop(x))


class NormActBlock(nn.Module):
    """timm's ConvNormAct twice, the second without activation, then a residual add."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), BatchNormAct(8, act)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 1, bias=False), BatchNormAct(8, nn.Identity())
        self.drop_path = nn.Identity()

    def forward(self, x):
        return x + self.drop_path(self.bn2(self.conv2(self.bn1(self.conv1(x)))))


@pytest.mark.parametrize("act", [nn.SiLU(), nn.ReLU(inplace=True)], ids=["silu", "relu"])
def test_timm_batchnormact_folds_with_its_activation(act):
    model = NormActBlock(act).eval()
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    tg.convert(model)
    layers = model.conversion_summary.layers
    assert layers["conv1"].endswith("(folded) -> bn1_act"), layers
    assert layers["conv2"].endswith("(folded)"), layers
    assert list(model.state_dict()) == keys
    x = randn(2, 8, 9, 10)
    assert_close(model(x), reference(x), k=100)
    # One BN put back in training mode (the region still in eval): batch statistics, the BN
    # module's own activation once
    for m in (model, reference):
        m.bn1.train()
    assert_close(model(x), reference(x), k=100)


def test_timm_batchnormact_with_an_activation_not_fused_stays():
    model = NormActBlock(nn.ELU()).eval()
    reference = copy.deepcopy(model)
    tg.convert(model)
    layers = model.conversion_summary.layers
    assert layers["conv1"].startswith("left alone: BN module bn1 runs more"), layers
    assert "(folded)" in layers["conv2"], layers
    x = randn(2, 8, 9, 10)
    assert_close(model(x), reference(x), k=100)


def test_grouped_conv_on_the_untuned_kernel_is_left_to_torch():
    from torch_tvm_gemm.schedules.cpu_conv2d import untuned_groups

    # groups of 30 channels (the direct kernel, slower than torch's there), of 2 (the direct
    # kernel, faster) and RegNet's of 8 (the blocked kernel on vectors of 8 lanes)
    wide = nn.Conv2d(60, 60, 3, padding=1, groups=2, bias=False)
    narrow = nn.Conv2d(60, 32, 1, bias=False)
    pairs = nn.Conv2d(32, 32, 3, padding=1, groups=16, bias=False)
    regnet = nn.Conv2d(32, 32, 3, padding=1, groups=4, bias=False)
    model = nn.Sequential(
        wide, bn(60), nn.ReLU(), narrow, bn(32), nn.ReLU(),
        pairs, bn(32), nn.ReLU(), regnet, bn(32), nn.ReLU(),
    ).eval()  # fmt: skip
    reference = copy.deepcopy(model)
    tg.convert(model)
    layers = model.conversion_summary.layers
    assert untuned_groups(60, 60, 2, "float32")
    assert layers["0"].startswith("left alone: groups=2 of 30 output channels"), layers
    for name, c, groups in (("6", 32, 16), ("9", 32, 4)):
        assert not untuned_groups(c, c, groups, "float32")
        assert "(folded)" in layers[name], layers
    x = randn(2, 60, 7, 9)
    assert_close(model(x), reference(x), k=600)


def test_second_user_is_not_fused_and_says_why():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.conv(x)
            z = self.fc(y.mean((2, 3)))
            return F.relu(y) + y, F.relu(z) + z  # both outputs needed without the relu

    model, x = M().eval(), randn(2, 3, 10, 9)
    expected = model(x)
    tg.convert(model)
    layers = model.conversion_summary.layers
    assert layers["conv"] == "left alone: conv output has 3 users"  # relu, add, mean
    assert layers["fc"] == "swapped"
    for got, want in zip(model(x), expected, strict=True):
        assert_close(got, want, k=27)


def test_conv_bn_without_activation_folds():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), bn(8)).eval()
    x = randn(2, 3, 10, 9)
    expected = model(x)
    tg.convert(model)
    assert model.conversion_summary.layers["0"].endswith("(folded)")
    assert_close(model(x), expected, k=27)
    model.train()  # a BN back in training mode: batch statistics, as eager
    assert_close(
        model(x),
        F.batch_norm(
            F.conv2d(x, model[0].weight, model[0].bias, padding=1),
            None,
            None,
            model[1].weight,
            model[1].bias,
            True,
        ),
        k=27,
    )


def test_training_mode_bn_is_not_folded():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), bn(8), nn.ReLU()).train()
    tg.convert(model)
    assert "training" in model.conversion_summary.layers["0"]


def test_multihead_attention_out_proj_is_reported_not_swapped():
    model = nn.Sequential(nn.Linear(8, 8), nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0))
    model.eval()
    x = randn(3, 5, 8)
    expected = model(x)
    tg.convert(model)
    layers = model.conversion_summary.layers
    assert "reads this projection's weight directly" in layers["1.self_attn.out_proj"]
    assert type(model[1].self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert layers["1.linear1"] == layers["1.linear2"] == "swapped"
    assert_close(model(x), expected, k=16)


def test_linear_subclasses():
    class Plain(nn.Linear):
        pass

    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class WrittenOut(nn.Linear):  # Falcon's FalconLinear: the plain linear, written out
        def forward(self, x):
            y = x @ self.weight.T
            return y if self.bias is None else y + self.bias

    class Functional(nn.Linear):
        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    class KeepsInput(nn.Linear):  # the plain linear in the graph, plus a side effect
        def forward(self, x):
            self.last_input = x
            return F.linear(x, self.weight, self.bias)

    class LoRA(nn.Linear):  # the plain linear plus an update: not the op's function
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.a = nn.Parameter(randn(2, self.in_features))
            self.b = nn.Parameter(randn(self.out_features, 2))

        def forward(self, x):
            return x @ self.weight.t() + self.bias + x @ self.a.t() @ self.b.t()

    model = nn.Sequential(
        Plain(8, 8),
        nn.ReLU(),
        Custom(8, 8),
        WrittenOut(8, 8),
        nn.GELU(),
        WrittenOut(8, 8, bias=False),
        Functional(8, 8),
        LoRA(8, 4),
    )
    x = randn(3, 8)
    expected = model(x)
    tg.convert(model)
    layers = model.conversion_summary.layers
    assert layers["0"].endswith("(relu)")
    assert layers["2"] == "left alone: Custom overrides nn.Linear.forward"
    assert layers["3"].endswith("(gelu)"), layers
    assert layers["5"] == layers["6"] == "swapped", layers
    assert layers["7"] == "left alone: LoRA overrides nn.Linear.forward"
    assert_close(model(x), expected, k=8)
    # A forward with a side effect on the module is not the plain linear, and the trace that
    # tells leaves nothing on the module itself
    keeps = nn.Sequential(KeepsInput(8, 8))
    tg.swap_linear(keeps)
    assert type(keeps[0]) is KeepsInput and not hasattr(keeps[0], "last_input")
    keeps(x)
    assert keeps[0].last_input is x


def test_tied_weights_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    model, ids = Tied(), torch.randint(0, 20, (2, 5))
    expected = model(ids)
    tg.convert(model)
    assert model.head.weight is model.embed.weight
    assert_close(model(ids), expected, k=8)
    assert list(model.state_dict()) == ["embed.weight", "head.weight"]


def test_linear_filter_and_its_errors():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    tg.convert(model, linear_filter=lambda m, fqn: fqn != "2")
    assert model.conversion_summary.layers["2"] == "left alone: filter_fn said no"
    assert type(model[2]) is nn.Linear

    def broken(module, fqn):
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="linear_filter raised on '0'.*boom"):
        tg.convert(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), linear_filter=broken)


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch_tvm_gemm.convert: expected an nn.Module"):
        tg.convert(lambda x: x)
    with pytest.raises(ValueError, match="activation must be one of"):
        tg.TVMLinear(4, 4, activation="tanh")


def test_meta_device_model():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))
    tg.convert(model)
    out = model(torch.empty(3, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 4)


def test_inplace_false_leaves_the_model_alone():
    model = DataDependent().eval()
    converted = tg.convert(model, inplace=False)
    assert converted is not model and type(model.head[0]) is nn.Linear
    assert not hasattr(model, "conversion_summary")


@pytest.mark.parametrize("rows", [1, 6])  # 1: the small-M (gemv) kernel
def test_tvm_conv1d_reads_the_transposed_weight_in_place(rows):
    layer = tg.TVMConv1D(nf=64, nx=128, activation="gelu_tanh")
    with torch.no_grad():
        layer.bias.uniform_(-1, 1)
    assert list(layer.state_dict()) == ["weight", "bias"] and layer.weight.shape == (128, 64)
    x = randn(rows, 2, 128).requires_grad_()
    out = layer(x)
    ref_x = x.detach().requires_grad_()
    flat = torch.addmm(layer.bias, ref_x.view(-1, 128), layer.weight).view(rows, 2, 64)
    expected = F.gelu(flat, approximate="tanh")
    assert_close(out, expected, k=128)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, layer.weight), grad)
    want = torch.autograd.grad(expected, (ref_x, layer.weight), grad)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, k=128)


class _DepthwiseConv(nn.Conv2d):
    """A Conv2d subclass that only constructs differently (transformers'
    EfficientNetDepthwiseConv2d)."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__(channels, channels, kernel_size, padding="same", groups=channels)


class _ScaledConv(nn.Conv2d):
    """A Conv2d subclass with a forward of its own: not a plain conv."""

    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("conv_cls", [_DepthwiseConv, _ScaledConv])
def test_conv2d_subclasses_fuse_only_with_the_plain_forward(conv_cls):
    def conv():
        return _DepthwiseConv(16, 3) if conv_cls is _DepthwiseConv else _ScaledConv(16, 16, 3)

    model = nn.Sequential(nn.Conv2d(3, 16, 1), conv(), bn(16), nn.ReLU()).eval()
    x = randn(2, 3, 10, 10)
    with torch.no_grad():
        want = model(x)
    tg.convert(model)
    what = model.conversion_summary.layers["1"]
    assert what.startswith("fused") == (conv_cls is _DepthwiseConv), what
    with torch.no_grad():
        assert_close(model(x), want, k=144)
