"""``ChannelsLastMaxPool2d`` (pooling.py) and ``convert``'s swap of ``nn.MaxPool2d``: the same
values and layout as ``nn.MaxPool2d`` for every input, gradients included."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from conftest import randn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm.pooling import ChannelsLastMaxPool2d

CL = torch.channels_last


def pools(**kwargs) -> tuple[nn.MaxPool2d, ChannelsLastMaxPool2d]:
    return nn.MaxPool2d(**kwargs), ChannelsLastMaxPool2d(**kwargs)


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        (dict(kernel_size=3, stride=2, padding=1), (2, 64, 23, 22)),  # ResNet's stem pool
        (dict(kernel_size=2), (1, 32, 8, 9)),
        (dict(kernel_size=3, stride=2, ceil_mode=True), (3, 16, 10, 11)),
        (dict(kernel_size=(3, 2), stride=1, padding=(1, 0), dilation=(2, 1)), (1, 24, 9, 7)),
        (dict(kernel_size=2), (1, 8, 6, 6)),  # few channels: torch's own pool
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_values_and_layout_as_max_pool2d(kwargs, shape, dtype):
    ours, reference = pools(**kwargs)[1], pools(**kwargs)[0]
    x = randn(*shape, dtype=dtype)
    for given in (x, x.to(memory_format=CL), x[:, :, :, : shape[3] - 1], x[0]):
        expected = reference(given)
        got = ours(given)
        assert torch.equal(got, expected)  # a max: exact
        assert got.stride() == expected.stride()


def test_gradients_as_max_pool2d():
    reference, ours = pools(kernel_size=3, stride=2, padding=1)
    x = randn(2, 32, 12, 12)
    grads = []
    for pool in (reference, ours):
        xg = x.clone().requires_grad_()
        pool(xg).square().sum().backward()
        grads.append(xg.grad)
    assert torch.equal(*grads)


def test_indices_wanted_runs_max_pool2d():
    reference, ours = pools(kernel_size=2, return_indices=True)
    x = randn(1, 32, 8, 8)
    (y0, i0), (y1, i1) = reference(x), ours(x)
    assert torch.equal(y0, y1) and torch.equal(i0, i1)


def test_compiles_fullgraph():
    ours = pools(kernel_size=3, stride=2, padding=1)[1]
    x = randn(1, 32, 12, 12)
    assert torch.equal(torch.compile(ours, fullgraph=True)(x), ours(x))


class PooledCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        y = self.body(self.pool(self.stem(x)))
        return self.head(y.mean((2, 3)))


def test_convert_puts_every_max_pool_channels_last():
    model = PooledCNN().eval()
    x = randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
        keys = list(model.state_dict())
        converted = tg.convert(model)
        got = converted(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    summary = converted.conversion_summary
    assert summary.pools == ["pool", "body.2"]
    assert "2 max pools channels-last" in summary.line()
    assert type(converted.pool) is ChannelsLastMaxPool2d
    assert list(converted.state_dict()) == keys
    copied = pickle.loads(pickle.dumps(converted))  # (the class is importable)
    assert type(copied.body[2]) is ChannelsLastMaxPool2d
    buffer = io.BytesIO()
    torch.save(converted.state_dict(), buffer)


def test_nan_and_inf_as_max_pool2d():
    reference, ours = pools(kernel_size=3, stride=2, padding=1)
    x = randn(2, 32, 12, 12)
    x[0, 3, 2, 2], x[1, 7, 5, 5], x[1, 8, 0, 0] = float("nan"), float("-inf"), float("inf")
    expected, got = reference(x), ours(x)
    assert torch.equal(got.isnan(), expected.isnan()) and got.isnan().any()
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
