"""The fp32 depthwise conv of a channels_last input: run by the kernel over channels-last
pixels (``schedules/cpu_depthwise_nhwc.py``), no copy to NCHW and back, same answers as
``F.conv2d``, output channels_last."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

from torch_tvm_gemm import ops
from torch_tvm_gemm.kernels.conv2d import Conv2dSpec, torch_activation

conv = torch.ops.tvm_gemm.conv2d_bias_relu
CL = torch.channels_last


def _depthwise(n, c, h, w, k, stride, padding, dilation, bias, act, seed=0):
    x = randn(n, c, h, w, seed=seed).contiguous(memory_format=CL)
    weight = randn(c, 1, k, k, seed=seed + 1)
    b = randn(c, seed=seed + 2) if bias else None
    return (x, weight, b, [stride] * 2, [padding] * 2, [dilation] * 2, c, True, act)


GEOMETRIES = {
    "3x3": (2, 32, 9, 11, 3, 1, 1, 1, True, "relu6"),
    "3x3 stride 2": (1, 48, 10, 13, 3, 2, 1, 1, False, "none"),
    "5x5": (1, 16, 12, 12, 5, 1, 2, 1, True, "silu"),
    "5x5 stride 2": (2, 16, 11, 11, 5, 2, 2, 1, True, "hardswish"),
    "dilated": (1, 16, 9, 9, 3, 1, 2, 2, True, "leaky_relu"),
    "no padding": (1, 32, 6, 6, 3, 1, 0, 1, True, "relu"),
    "a row of 7": (3, 32, 7, 7, 3, 1, 1, 1, True, "relu6"),
    "3x3 on 1x1": (2, 16, 1, 1, 3, 1, 1, 1, True, "relu"),
    "5x5, one output row a task": (1, 384, 56, 56, 5, 1, 2, 1, True, "relu"),
    "5x5, conditions": (1, 1024, 56, 56, 5, 2, 2, 1, True, "relu"),
    # channels a multiple of half a vector (MobileNetV3's 72, 120, 184, 200 on AVX-512)
    "half vectors": (2, 72, 9, 9, 3, 1, 1, 1, True, "hardswish"),
    "half vectors, 5x5 stride 2": (2, 40, 11, 11, 5, 2, 2, 1, True, "silu"),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_channels_last_depthwise_matches_torch(name):
    _check(_depthwise(*GEOMETRIES[name]))


@pytest.mark.parametrize(
    "name", ["3x3", "5x5 stride 2", "no padding", "a row of 7", "half vectors"]
)
def test_channels_last_depthwise_in_bfloat16(name):
    """bf16 reads a float32 copy of each task's rows, whatever the taps."""
    _check(
        [a.bfloat16() if isinstance(a, torch.Tensor) else a for a in _depthwise(*GEOMETRIES[name])]
    )


def _check(args):
    x, w, b, stride, padding, dilation, groups, _, act = args
    with torch.no_grad():
        got = conv(*args)
        want = torch_activation(act)(F.conv2d(x, w, b, stride, padding, dilation, groups))
    assert got.shape == want.shape
    assert got.is_contiguous(memory_format=CL)
    assert_close(got, want, k=w[0].numel())


def test_the_channels_last_kernel_is_the_one_asked_for():
    """Planning records the kernel a call needs: the "nhwc" one for a channels_last x, the
    NCHW one otherwise; channels that are not whole vectors or half vectors stay on the NCHW
    kernel."""
    cl_args = _depthwise(*GEOMETRIES["3x3"])
    nchw_args = (cl_args[0].contiguous(),) + cl_args[1:]
    odd = _depthwise(1, 6, 8, 8, 3, 1, 1, 1, True, "relu")  # 6: no vector of channels
    for args, layout in ((cl_args, "nhwc"), (nchw_args, "nchw"), (odd, "nchw")):
        with ops.planning() as plan:
            conv(*args)
        assert [s.layout for s in plan.specs if isinstance(s, Conv2dSpec)] == [layout]
    x, w, b, stride, padding, dilation, groups, _, act = odd
    want = torch_activation(act)(F.conv2d(x, w, b, stride, padding, dilation, groups))
    assert_close(conv(*odd), want, k=9)


def test_spec_keys_of_the_nchw_kernels_are_unchanged():
    spec = Conv2dSpec(dtype="float32", c=16, k=16, r=3, s=3, h=8, w=8, groups=16)
    assert "layout" not in spec.key()
    nhwc = dataclasses.replace(spec, layout="nhwc")
    assert nhwc.key()["layout"] == "nhwc" and nhwc.name() == spec.name() + "_nhwc"
    with pytest.raises(ValueError):
        dataclasses.replace(spec, layout="chwn")


def test_gradients_and_opcheck_on_a_channels_last_depthwise():
    x, w, b, stride, padding, dilation, groups, relu, act = _depthwise(*GEOMETRIES["3x3"])
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    got = torch.autograd.grad(
        conv(x, w, b, stride, padding, dilation, groups, relu, act).sum(), (x, w, b)
    )
    want = torch.autograd.grad(
        torch_activation(act)(F.conv2d(x, w, b, stride, padding, dilation, groups)).sum(),
        (x, w, b),
    )
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, k=99)
    torch.library.opcheck(conv, (x, w, b, stride, padding, dilation, groups, relu, act))


def test_padded_rows_for_taps_beyond_a_3x3_within_the_local_buffer():
    """A 5x5 reads a padded copy of each task's rows (4 output rows, else 1 where 4 outgrow
    the local buffer, else conditions per tap); a float32 3x3 or unpadded conv never copies."""
    from torch_tvm_gemm.schedules import cpu_depthwise_nhwc as nhwc

    def spec(c, size, k, padding, stride=1):
        return Conv2dSpec(dtype="float32", c=c, k=c, r=k, s=k, h=size, w=size,
                          stride=(stride, stride), padding=(padding, padding), groups=c)  # fmt: skip

    assert nhwc._row_block(spec(240, 28, 5, 2)) == 4
    assert nhwc._row_block(spec(64, 3, 5, 2)) == 3  # (all 3 output rows)
    assert nhwc._row_block(spec(384, 56, 5, 2)) == 1  # 8 rows of 60 x 384 floats: too many
    assert nhwc._row_block(spec(1024, 56, 5, 2)) is None  # even 5 rows
    assert nhwc._row_block(spec(240, 28, 3, 1)) is None
    assert nhwc._row_block(spec(240, 28, 5, 0)) is None
    bf16 = dataclasses.replace(spec(240, 28, 3, 0), dtype="bfloat16")
    assert nhwc._row_block(bf16) == 4


def test_channel_lanes_rule():
    from torch_tvm_gemm.schedules.cpu_depthwise_nhwc import channel_lanes
    from torch_tvm_gemm.target import CpuInfo

    avx512 = CpuInfo("x86_64", "", frozenset({"avx512f"}))  # 16 floats a vector

    def lanes(c):
        return channel_lanes(
            Conv2dSpec(dtype="float32", c=c, k=c, r=3, s=3, h=8, w=8, groups=c), avx512
        )

    assert [lanes(c) for c in (64, 72, 120, 200, 24, 12, 6)] == [16, 8, 8, 8, 8, None, None]
