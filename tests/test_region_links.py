"""A converted region computes with the model's current objects: parameters and buffers
replaced on the model after ``convert`` (not only written in place) are followed, and a
replaced layer makes the region run its own forward."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import assert_close
from torch import nn

import torch_tvm_gemm as tg


class MLP(nn.Module):
    """linear -> ReLU (fused), a parameter and a buffer read by the graph (``get_attr``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.randn(16))
        self.register_buffer("shift", torch.randn(16))

    def forward(self, x):
        return self.out(self.act(self.fc(x))) * self.scale + self.shift


class CNN(nn.Module):
    """conv -> BN -> ReLU (folded and fused), conv -> ReLU (fused)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.act2 = nn.Conv2d(8, 8, 1), nn.ReLU()

    def forward(self, x):
        return self.act2(self.conv2(self.relu(self.bn(self.conv(x)))))


def _model(cls, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = cls().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
                module.weight.uniform_(0.5, 1.5)
    return model


INPUTS = {MLP: (4, 16), CNN: (2, 3, 8, 8)}


def _pair(cls):
    """(eager model, converted copy, input), the converted one called once already."""
    eager = _model(cls, 0)
    converted = tg.convert(copy.deepcopy(eager))
    x = torch.randn(*INPUTS[cls])
    with torch.no_grad():
        assert_close(converted(x), eager(x))
    return eager, converted, x


def _runs_graph(converted: nn.Module) -> bool:
    return converted.__dict__["_tvm_traced"].linked(converted)


def _check(eager, converted, x, graph: bool) -> None:
    with torch.no_grad():
        x = x.to(next(eager.parameters()).dtype)
        assert_close(converted(x), eager(x))
    assert _runs_graph(converted) == graph


@pytest.mark.parametrize("cls", [MLP, CNN])
@pytest.mark.parametrize("copier", ["none", "deepcopy", "pickle"])
def test_load_state_dict_assign(cls, copier):
    eager, converted, x = _pair(cls)
    if copier == "deepcopy":
        converted = copy.deepcopy(converted)
    elif copier == "pickle":
        converted = pickle.loads(pickle.dumps(converted))
    state = _model(cls, 1).state_dict()
    for model in (eager, converted):
        model.load_state_dict(state, assign=True)
    _check(eager, converted, x, graph=True)


@pytest.mark.parametrize("cls", [MLP, CNN])
def test_to_empty_then_load(cls):
    """The meta-device recipe: parameters and buffers replaced by ``to_empty``, then loaded."""
    eager, converted, x = _pair(cls)
    state = _model(cls, 1).state_dict()
    for model in (eager, converted):
        model.to("meta").to_empty(device="cpu").load_state_dict(state)
    _check(eager, converted, x, graph=True)


def test_parameters_and_buffers_replaced():
    eager, converted, x = _pair(MLP)
    weight, scale, shift = torch.randn(32, 16), torch.randn(16), torch.randn(16)
    for model in (eager, converted):
        model.fc.weight = nn.Parameter(weight.clone())  # a fused linear's
        model.scale = nn.Parameter(scale.clone())  # read by the graph itself
        model.shift = shift.clone()  # a buffer
    _check(eager, converted, x, graph=True)


def test_buffers_replaced_by_double():
    """``.double()`` replaces every buffer with a converted copy (parameters keep theirs)."""
    eager, converted, x = _pair(MLP)
    for model in (eager, converted):
        model.double()
    _check(eager, converted, x, graph=True)
    assert converted(x.double()).dtype == torch.float64


@pytest.mark.parametrize(
    "cls, name, make",
    [
        (MLP, "fc", lambda: nn.Linear(16, 32)),  # the fused linear itself
        (MLP, "act", lambda: nn.GELU()),  # the activation fused into it
        (CNN, "bn", lambda: _model(CNN, 1).bn),  # the BN folded into the conv
        (CNN, "relu", lambda: nn.ReLU6()),
        (CNN, "conv2", lambda: nn.Conv2d(8, 8, 1)),
        (MLP, "out", lambda: nn.Linear(32, 16)),  # a layer the graph calls as it is
    ],
)
def test_layer_replaced_runs_own_forward(cls, name, make):
    eager, converted, x = _pair(cls)
    new = make()
    setattr(eager, name, new)
    setattr(converted, name, copy.deepcopy(new))
    _check(eager, converted, x, graph=False)


def test_compiled_model_follows_replaced_parameters():
    eager, converted, x = _pair(MLP)
    compiled = torch.compile(converted, fullgraph=True)
    with torch.no_grad():
        assert_close(compiled(x), eager(x))
        state = _model(MLP, 1).state_dict()
        for model in (eager, converted):
            model.load_state_dict(state, assign=True)
        assert_close(compiled(x), eager(x))


def test_many_converted_models_compile():
    """Each region compiles on its own: past torch.compile's 8 versions of one code object
    (``recompile_limit``), fullgraph=True would raise for the ninth converted model."""
    x = torch.randn(*INPUTS[MLP])
    for seed in range(10):
        eager = _model(MLP, seed)
        compiled = torch.compile(tg.convert(copy.deepcopy(eager)), fullgraph=True)
        with torch.no_grad():
            assert_close(compiled(x), eager(x))


@pytest.mark.parametrize("cls, name", [(MLP, "fc"), (MLP, "act"), (CNN, "conv"), (CNN, "bn")])
def test_hook_on_fused_layer_runs(cls, name):
    """A hook on a layer that a fusion computes (the graph never calls it) still runs: the
    region runs its own forward while the hook is there."""
    eager, converted, x = _pair(cls)
    handles = [
        getattr(model, name).register_forward_hook(lambda mod, args, out: out * 2)
        for model in (eager, converted)
    ]
    _check(eager, converted, x, graph=False)
    for handle in handles:
        handle.remove()
    _check(eager, converted, x, graph=True)


@pytest.mark.parametrize("cls", [MLP, CNN])
def test_functional_call_and_grad_over_parameters(cls):
    """torch.func.functional_call swaps the model's tensors for the call: the graph follows
    (before, it computed with the model's own parameters), and so does torch.func.grad
    over them."""
    eager, converted, x = _pair(cls)
    other = _model(cls, 1)
    tensors = dict(other.named_parameters()) | dict(other.named_buffers())
    with torch.no_grad():
        want = torch.func.functional_call(eager, tensors, (x,))
        assert_close(torch.func.functional_call(converted, tensors, (x,)), want)
    params = {name: p.detach() for name, p in other.named_parameters()}

    def loss(params, model):
        return torch.func.functional_call(model, params, (x,)).square().sum()

    want, got = torch.func.grad(loss)(params, eager), torch.func.grad(loss)(params, converted)
    for name in params:
        assert_close(got[name], want[name], k=64)


class Residual(nn.Module):
    """Already a TVM layer (the graph calls it as it is) whose output takes a residual add."""

    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(16, 16), nn.ReLU()
        self.tvm = tg.TVMLinear(16, 16)

    def forward(self, x):
        h = self.act(self.fc(x))
        return self.tvm(h) + h  # (written into tvm's output, in place, when nothing else reads it)


def test_hook_sees_the_output_the_layer_returned():
    torch.manual_seed(0)
    eager, x = Residual().eval(), torch.randn(4, 16)
    converted = tg.convert(copy.deepcopy(eager))
    seen = {}
    for key, model in (("eager", eager), ("converted", converted)):
        model.tvm.register_forward_hook(lambda mod, args, out, key=key: seen.update({key: out}))
        with torch.no_grad():
            model(x)
    assert_close(seen["converted"], seen["eager"])
