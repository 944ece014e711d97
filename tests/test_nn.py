"""TVMLinear and swap_linear: drop-in behaviour, state_dict, activation fusion, undo."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, randn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm import TVMLinear


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 8),
        nn.GELU("tanh"),
    )


def test_swap_matches_original_and_fuses_activations():
    model, x = mlp(), randn(5, 16)
    ref = model(x)
    tg.swap_linear(model)
    assert [type(m).__name__ for m in model] == [
        "TVMLinear",
        "_Fused",
        "TVMLinear",
        "_Fused",
        "TVMLinear",
        "_Fused",
    ]
    assert [model[i].activation for i in (0, 2, 4)] == ["relu", "gelu", "gelu_tanh"]
    assert_close(model(x), ref, 32)


def test_state_dict_round_trips_both_ways():
    model = mlp()
    swapped = tg.swap_linear(mlp())
    assert swapped.state_dict().keys() == model.state_dict().keys()
    swapped.load_state_dict(model.state_dict())
    x = randn(3, 16)
    assert_close(swapped(x), model(x), 32)
    fresh = mlp()
    fresh.load_state_dict(swapped.state_dict())
    assert_close(fresh(x), model(x), 32)


def test_unswap_restores_modules():
    model = mlp()
    ref_types = [type(m) for m in model]
    tg.unswap_linear(tg.swap_linear(model))
    assert [type(m) for m in model] == ref_types


def test_filter_fn_and_nested_modules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.head = nn.Sequential(nn.Linear(8, 4), nn.ReLU())

        def forward(self, x):
            return self.head(torch.relu(self.proj(x)))

    model = Block()
    x = randn(2, 8)
    ref = model(x)
    tg.swap_linear(model, filter_fn=lambda m, fqn: fqn != "proj")
    assert type(model.proj) is nn.Linear and isinstance(model.head[0], TVMLinear)
    assert_close(model(x), ref, 8)


def test_relu_outside_sequential_is_not_fused():
    # In a custom forward the linear's output may have other users: never fuse there.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            y = self.fc(x)
            return self.act(y) + y

    net = Net()
    x = randn(3, 8)
    ref = net(x)
    tg.swap_linear(net)
    assert net.fc.activation == "none" and isinstance(net.act, nn.ReLU)
    assert_close(net(x), ref, 8)


def test_tvmlinear_repr_and_training():
    layer = TVMLinear(8, 4, activation="gelu")
    assert "activation=gelu" in repr(layer)
    with pytest.raises(ValueError, match="activation"):
        TVMLinear(8, 4, activation="swish")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, target = randn(16, 8), randn(16, 4)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (layer(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


class _OpCalls:
    """Counts the calls of each tvm_gemm op while active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "tvm_gemm":
                    name = func.overloadpacket.__name__
                    calls[name] = calls.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self.calls

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
def test_training_keeps_the_pre_activation_instead_of_recomputing_it(kind, activation):
    """In training with gradients wanted, a GELU / SiLU linear runs its activation as a torch
    op after the product, which keeps the pre-activation for the backward: one product in the
    forward and none again in the backward (the fused kernel's backward recomputes it, as it
    still does in eval mode). Gradients as torch's either way; ReLU stays fused."""
    torch.manual_seed(0)
    reference = nn.Linear(12, 20)
    layer = TVMLinear.from_linear(reference, activation)
    weight = reference.weight
    if kind == "conv1d":  # (transformers' Conv1D layout: the weight stored (in, out))
        from torch_tvm_gemm import TVMConv1D

        layer = TVMConv1D(20, 12, activation)
        with torch.no_grad():
            layer.weight.copy_(reference.weight.t())
            layer.bias.copy_(reference.bias)
        weight = layer.weight
    act = tg.nn.activation_module(activation)
    x = randn(6, 12).requires_grad_()
    for training in (True, False):
        layer.train(training)
        with _OpCalls() as calls:
            y = layer(x)
            grads = torch.autograd.grad(y.square().sum(), [x, weight, layer.bias])
        # (the product in the forward, dX in the backward, and the product again where GELU
        # / SiLU was fused; dW a matmul)
        recomputed = not training and activation != "relu"
        assert calls == {"linear": 2 + recomputed, "matmul": 1}
        want_y = act(reference(x))
        wants = torch.autograd.grad(want_y.square().sum(), [x, reference.weight, reference.bias])
        assert_close(y, want_y, 12)
        grads = (grads[0], grads[1].t() if kind == "conv1d" else grads[1], grads[2])
        for got, want in zip(grads, wants, strict=True):
            assert_close(got, want, 64)


def test_conv1d_weight_gradient_in_the_weights_layout():
    """transformers' Conv1D stores its weight (in, out): the gradient is made in that layout
    (accumulating a transposed one into ``.grad`` walked it across the strides), equal to
    torch's."""
    from torch_tvm_gemm import TVMConv1D

    layer = TVMConv1D(24, 16)
    strides = []
    layer.weight.register_hook(lambda grad: strides.append(grad.stride()))
    x = randn(2, 5, 16)
    for _ in range(2):  # (the second accumulates into .grad)
        layer(x).square().sum().backward()
    want = torch.autograd.grad(2 * (x @ layer.weight + layer.bias).square().sum(), layer.weight)[0]
    assert strides[:2] == [layer.weight.stride()] * 2  # (as it reaches the parameter)
    assert_close(layer.weight.grad, want, 32)


@pytest.mark.parametrize("swap", ["swap_linear", "convert"])
def test_hooks_registered_before_the_swap_still_run(swap):
    """A swapped layer takes over the original's hooks (a pre-hook that changes the input,
    a forward hook that records), and their handles still remove them; a hooked linear
    and the activation after it are not fused into one call."""
    model, x = mlp(), randn(5, 16)
    seen = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    handle = model[2].register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    ref = model(x)
    getattr(tg, swap)(model)
    assert type(model[2]).__name__ == "TVMLinear" and model[2].activation == "none"
    seen.clear()
    assert_close(model(x), ref)
    assert seen == [torch.Size([5, 32])]
    handle.remove()
    assert not model[2]._forward_pre_hooks
