"""Frozen BatchNorms (torchvision's ``FrozenBatchNorm2d``, in its detection and segmentation
backbones; detectron2's): folded into the conv before them like an eval-mode BN, in either
mode of the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm.fold import TVMConv2dBN
from torch_tvm_gemm.fusion import fuse_conv_bias_relu, is_frozen_bn


class FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.misc.FrozenBatchNorm2d, as written there (buffers, no parameters)."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x):
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        return x * scale + (b - rm * scale)


def _frozen(channels: int, seed: int) -> FrozenBatchNorm2d:
    bn = FrozenBatchNorm2d(channels)
    bn.weight.copy_(randn(channels, seed=seed))
    bn.bias.copy_(randn(channels, seed=seed + 1))
    bn.running_mean.copy_(randn(channels, seed=seed + 2))
    bn.running_var.uniform_(0.5, 2.0)
    return bn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = _frozen(16, 10)
        self.conv2 = nn.Conv2d(16, 8, 1, bias=False)
        self.bn2 = _frozen(8, 20)

    def forward(self, x):
        return self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))


def test_recognised_by_name_and_buffers():
    assert is_frozen_bn(FrozenBatchNorm2d(4))
    assert not is_frozen_bn(nn.BatchNorm2d(4))

    class FrozenBatchNorm2dWithParameters(FrozenBatchNorm2d):
        pass

    FrozenBatchNorm2dWithParameters.__name__ = "FrozenBatchNorm2d"
    bn = FrozenBatchNorm2dWithParameters(4)
    bn.extra = nn.Parameter(torch.ones(4))  # not a frozen BN any more
    assert not is_frozen_bn(bn)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_convert_folds_frozen_bns_in_either_mode(mode):
    model = Block().eval()
    x = randn(2, 3, 10, 10)
    with torch.no_grad():
        want = model(x)
    converted = tg.convert(Block().eval().requires_grad_(False), inplace=True)
    converted.load_state_dict(model.state_dict())
    summary = converted.conversion_summary
    assert summary.converted("conv2d") == 2, str(summary)
    assert all("(folded)" in what for what in summary.layers.values()), str(summary)
    getattr(converted, mode)()
    with torch.no_grad():
        assert_close(converted(x), want, k=144)


def test_folded_frozen_bn_sees_its_buffers_change():
    conv, bn = nn.Conv2d(3, 8, 3, padding=1), _frozen(8, 30)
    fused = TVMConv2dBN(conv, bn, "relu")
    x = randn(1, 3, 9, 9)
    with torch.no_grad():
        assert_close(fused(x), F.relu(bn(conv(x))), k=27)
        bn.running_var.mul_(4.0)  # counted by torch: refolded at the next call
        assert_close(fused(x), F.relu(bn(conv(x))), k=27)
        fused.train()  # a frozen BN stays folded in training mode
        bn.train()
        assert_close(fused(x), F.relu(bn(conv(x))), k=27)


def test_fuse_conv_bias_relu_folds_frozen_bns():
    model = Block().eval()
    gm, summary = fuse_conv_bias_relu(model)
    assert len(summary.fused) == 2, summary
    x = randn(2, 3, 10, 10)
    with torch.no_grad():
        assert_close(gm(x), model(x), k=144)


def test_torchvision_backbone_with_frozen_bns():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.ops.misc import FrozenBatchNorm2d as TorchvisionFrozen

    model = torchvision.models.resnet18(norm_layer=TorchvisionFrozen).eval()
    for m in model.modules():
        if isinstance(m, TorchvisionFrozen):
            m.running_var.uniform_(0.5, 2.0)
    x = randn(1, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
    tg.convert(model)
    assert model.conversion_summary.converted("conv2d") == 20, str(model.conversion_summary)
    with torch.no_grad():
        assert_close(model(x), want, k=4608)
