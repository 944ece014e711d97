"""The fp32 conv of a channels_last input on the blocked kernel over channels-last pixels
(``cpu_conv2d.channels_last_blocked``): x read as it lies, the weight as (K, R, S, C),
the output written channels_last; no copy to NCHW and back. Same answers as ``F.conv2d``."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn, run_on

from torch_tvm_gemm import ops
from torch_tvm_gemm.kernels.conv2d import Conv2dSpec, torch_activation
from torch_tvm_gemm.ops import conv_ops
from torch_tvm_gemm.schedules import cpu_conv2d
from torch_tvm_gemm.target import CpuInfo

conv = torch.ops.tvm_gemm.conv2d_bias_relu
CL = torch.channels_last

# (n, c, k, h, w, r, stride, padding, dilation, groups, bias, activation)
GEOMETRIES = {
    "3x3": (2, 16, 32, 9, 11, 3, 1, 1, 1, 1, True, "relu"),
    "3x3 stride 2, odd size": (1, 24, 48, 13, 10, 3, 2, 1, 1, 1, True, "silu"),
    "7x7 stem on 3 channels": (2, 3, 16, 20, 19, 7, 2, 3, 1, 1, False, "relu"),
    "5x5 unpadded": (1, 8, 16, 9, 9, 5, 1, 0, 1, 1, True, "hardswish"),
    "dilated": (1, 16, 16, 10, 10, 3, 1, 2, 2, 1, True, "leaky_relu"),
    "no activation": (3, 32, 16, 6, 6, 3, 1, 1, 1, 1, True, "none"),
    "a row of 7, 2 blocks": (2, 16, 64, 7, 7, 3, 1, 1, 1, 1, True, "relu6"),
    "groups of 16 channels": (2, 64, 64, 8, 8, 3, 1, 1, 1, 4, True, "relu"),
    "groups of 8 (half vectors)": (1, 32, 32, 9, 9, 3, 2, 1, 1, 4, True, "sigmoid"),
    "1x1 padded": (2, 16, 16, 5, 5, 1, 1, 1, 1, 1, True, "relu"),
}


def _args(n, c, k, h, w, r, stride, padding, dilation, groups, bias, act, weight_format=CL):
    x = randn(n, c, h, w, seed=1).contiguous(memory_format=CL)
    weight = randn(k, c // groups, r, r, seed=2).contiguous(memory_format=weight_format)
    b = randn(k, seed=3) if bias else None
    return (x, weight, b, [stride] * 2, [padding] * 2, [dilation] * 2, groups, True, act)


def _want(args):
    x, w, b, stride, padding, dilation, groups, _, act = args
    return torch_activation(act)(F.conv2d(x, w, b, stride, padding, dilation, groups))


def _planned_layouts(args) -> list[str]:
    with ops.planning() as plan:
        conv(*args)
    return [s.layout for s in plan.specs if isinstance(s, Conv2dSpec)]


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_channels_last_conv_matches_torch(name):
    args = _args(*GEOMETRIES[name])
    assert _planned_layouts(args) == ["nhwc"]
    with torch.no_grad():
        got, want = conv(*args), _want(args)
    assert got.shape == want.shape and got.is_contiguous(memory_format=CL)
    assert_close(got, want, k=args[1][0].numel())


def test_a_contiguous_weight_and_other_batch_sizes():
    """A contiguous weight is read through a (K, R, S, C) copy; the batch is symbolic: one
    kernel for batches of 1 and 5."""
    for n, weight_format in ((1, torch.contiguous_format), (5, CL)):
        args = _args(n, *GEOMETRIES["3x3"][1:], weight_format=weight_format)
        assert_close(conv(*args), _want(args), k=16 * 9)


def test_other_convs_keep_their_routes():
    """Output channels that are no whole vector (20), bf16 (the NCHW kernel, or the bf16
    implicit GEMM over NHWC pixels) and NCHW inputs do not run this kernel."""
    odd = _args(1, 16, 20, 8, 8, 3, 1, 1, 1, 1, True, "relu")
    assert _planned_layouts(odd) == ["nchw"]
    assert_close(conv(*odd), _want(odd), k=16 * 9)
    bf16 = [a.bfloat16() if isinstance(a, torch.Tensor) else a for a in _args(*GEOMETRIES["3x3"])]
    assert "nhwc" not in _planned_layouts(bf16)
    want = _want([a.float() if isinstance(a, torch.Tensor) else a for a in bf16])
    assert_close(conv(*bf16), want, k=16 * 9)
    nchw = _args(*GEOMETRIES["3x3"])
    nchw = (nchw[0].contiguous(),) + nchw[1:]
    assert _planned_layouts(nchw) == ["nchw"]


def _plan_specs(args):
    with ops.planning() as plan:
        conv(*args)
    return plan.specs


def test_tile_keeps_whole_blocks_of_output_channels():
    """The output tile is stored as vectors along the channels: a block of 2 vectors only
    where K is a multiple of it (48 = 3 vectors of 16: blocks of one vector)."""
    avx512 = CpuInfo("x86_64", "", frozenset({"avx512f"}))

    def tile(k, layout):
        spec = Conv2dSpec(dtype="float32", c=16, k=k, r=3, s=3, h=14, w=14, layout=layout)
        return cpu_conv2d.blocked_tile(spec, avx512)

    assert tile(48, "nchw")[1] == 2  # (the NCHW kernel pads K to 64)
    assert tile(48, "nhwc")[1] == 1 and tile(64, "nhwc")[1] == 2
    spec = Conv2dSpec(dtype="float32", c=16, k=20, r=3, s=3, h=14, w=14)
    assert not cpu_conv2d.channels_last_blocked(spec, avx512)
    depthwise = Conv2dSpec(dtype="float32", c=16, k=16, r=3, s=3, h=14, w=14, groups=16)
    assert not cpu_conv2d.channels_last_blocked(depthwise, avx512)


def test_weight_pack_per_call_when_a_block_has_several_tasks():
    """At batch 8 the blocks of a 14x14 conv have a task per image: the weight is packed once
    a call, in this layout too (``weight_pack``)."""
    args = _args(8, 64, 64, 14, 14, 3, 1, 1, 1, 1, True, "relu")
    (spec,) = [s for s in _plan_specs(args) if isinstance(s, Conv2dSpec)]
    assert spec.layout == "nhwc" and spec.weight_pack == "call"
    assert_close(conv(*args), _want(args), k=64 * 9)
    one = _args(1, 64, 64, 14, 14, 3, 1, 1, 1, 1, True, "relu")
    assert [s.weight_pack for s in _plan_specs(one) if isinstance(s, Conv2dSpec)] == ["task"]


def test_a_module_keeps_its_folded_weight_channels_last():
    """``weight_layout`` tells a module that keeps a derived weight (conv + BN) to keep it
    channels_last for this kernel, which then reads it in place."""
    x, w = _args(*GEOMETRIES["3x3"])[:2]
    layout = conv_ops.weight_layout(x, w, [1, 1], [1, 1], [1, 1], 1)
    assert layout == CL
    assert conv_ops.weight_layout(x.contiguous(), w, [1, 1], [1, 1], [1, 1], 1) != CL


def test_gradients_and_opcheck():
    x, w, b, *rest = _args(*GEOMETRIES["3x3 stride 2, odd size"])
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    got = torch.autograd.grad(conv(x, w, b, *rest).sum(), (x, w, b))
    want = torch.autograd.grad(_want((x, w, b, *rest)).sum(), (x, w, b))
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, k=99)
    torch.library.opcheck(conv, (x, w, b, *rest))


def test_spec_name_and_key_say_the_layout():
    spec = Conv2dSpec(dtype="float32", c=16, k=32, r=3, s=3, h=8, w=8)
    nhwc = dataclasses.replace(spec, layout="nhwc")
    assert nhwc.key()["layout"] == "nhwc" and nhwc.name() == spec.name() + "_nhwc"
    assert "layout" not in spec.key()


def test_converted_channels_last_model(monkeypatch):
    """A Conv2d + BN + ReLU model in channels_last, converted: the BN folded into a
    channels_last weight, which the kernel reads in place (no per-call copy); the same
    answers as eager, output channels_last."""
    import torch_tvm_gemm as tg

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
    )
    for p in model.parameters():
        p.requires_grad_(False)
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    model = model.eval().to(memory_format=CL)
    converted = tg.convert(copy.deepcopy(model))
    x = randn(2, 16, 12, 12).contiguous(memory_format=CL)
    with torch.no_grad(), ops.planning() as plan:
        converted(x)
    assert [s.layout for s in plan.specs if isinstance(s, Conv2dSpec)] == ["nhwc", "nhwc"]
    weights = []
    run = conv_ops._conv_nhwc
    monkeypatch.setattr(conv_ops, "_conv_nhwc", lambda x, w, *a: weights.append(w) or run(x, w, *a))
    with torch.no_grad():  # (the Python impl: the C++ one runs the same kernel, test_csrc_conv)
        got, want = run_on("python", lambda: converted(x)), model(x)
    assert got.is_contiguous(memory_format=CL)
    assert_close(got, want, k=32 * 9)
    assert len(weights) == 2 and all(w.is_contiguous(memory_format=CL) for w in weights)
