"""The conv op checks a call's geometry once (``conv_ops._checked_geometry``): later calls
with that geometry skip the checks, every other call is still checked, bad input never
stays."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

from torch_tvm_gemm.kernels.conv2d import torch_activation
from torch_tvm_gemm.ops import conv_ops, gemm_ops
from torch_tvm_gemm.schedules import cpu_conv2d

op = torch.ops.tvm_gemm.conv2d_bias_relu


def reference(x, w, b, activation):
    y = F.conv2d(x, w, b, padding=1)
    return {"relu": F.relu, "relu6": F.relu6, "none": lambda t: t}[activation](y)


def test_one_check_per_geometry_and_results_per_call(monkeypatch):
    calls = []
    check = conv_ops.check_conv2d
    monkeypatch.setattr(conv_ops, "check_conv2d", lambda *a: calls.append(1) or check(*a))
    conv_ops._GEOMETRIES.clear()
    w, b = randn(6, 4, 3, 3), randn(6)
    for seed in range(3):  # same geometry, new values: one check, each result right
        x = randn(2, 4, 7, 5, seed=seed)
        assert_close(op(x, w, b, [1, 1], [1, 1]), reference(x, w, b, "relu"), k=36)
    assert len(calls) == 1
    x = randn(2, 4, 7, 5)
    for activation in ("relu6", "none"):  # another activation: another geometry
        got = op(x, w, b, [1, 1], [1, 1], activation=activation)
        assert_close(got, reference(x, w, b, activation), k=36)
    x9 = randn(2, 4, 9, 5)  # another shape
    assert_close(op(x9, w, b, [1, 1], [1, 1]), reference(x9, w, b, "relu"), k=36)
    assert_close(op(x, w, None, [1, 1], [1, 1]), reference(x, w, None, "relu"), k=36)
    assert len(calls) == 5


def test_bad_input_is_checked_at_every_call():
    x, w, b = randn(2, 4, 7, 5), randn(6, 4, 3, 3), randn(6)
    op(x, w, b, [1, 1], [1, 1])  # a good geometry first
    for _ in range(2):  # never kept: the same bad call raises again
        with pytest.raises(ValueError, match=r"tvm_gemm\.conv2d_bias_relu: .*'bias'"):
            op(x, w, randn(5), [1, 1], [1, 1])
        with pytest.raises(
            ValueError, match=r"tvm_gemm\.conv2d_bias_relu: .*expects x to have 4 channels"
        ):
            op(randn(2, 5, 7, 5), w, b, [1, 1], [1, 1])
        with pytest.raises(TypeError, match=r"argument 'bias' has dtype torch.float64"):
            op(x, w, b.double(), [1, 1], [1, 1])
        with pytest.raises(ValueError, match=r"argument 'activation'"):
            op(x, w, b, [1, 1], [1, 1], activation="tanh")


def test_the_kept_geometries_are_bounded(monkeypatch):
    monkeypatch.setattr(conv_ops, "_MAX_GEOMETRIES", 2)
    conv_ops._GEOMETRIES.clear()
    w = randn(3, 2, 3, 3)
    for h in range(4, 8):
        x = randn(1, 2, h, 4)
        assert_close(op(x, w, None, [1, 1], [1, 1]), reference(x, w, None, "relu"), k=18)
    assert len(conv_ops._GEOMETRIES) == 2


@pytest.mark.parametrize(
    "c, k, h, w, stride, groups",
    [
        (8, 12, 9, 8, (2, 2), 1),  # odd height: the last row is read
        (8, 16, 10, 11, (2, 3), 1),
        (16, 32, 7, 7, (2, 2), 2),
        (64, 32, 33, 32, (2, 2), 1),  # at stride 1 this one is a GEMM per image
    ],
)
def test_strided_1x1_conv_runs_on_the_pixels_it_reads(monkeypatch, c, k, h, w, stride, groups):
    monkeypatch.setattr(conv_ops, "patches_as_gemm", lambda spec: False)  # (few pixels: below)
    monkeypatch.setattr(conv_ops, "_GEOMETRIES", {})
    got_specs = []
    get_kernel = conv_ops.get_kernel
    monkeypatch.setattr(conv_ops, "get_kernel", lambda s: got_specs.append(s) or get_kernel(s))
    x, wt, b = randn(2, c, h, w), randn(k, c // groups, 1, 1), randn(k)
    expected = F.relu(F.conv2d(x, wt, b, stride, groups=groups))
    for given in (x, x.to(memory_format=torch.channels_last), x[:, :, :, :]):
        got = op(given, wt, b, list(stride), [0, 0], [1, 1], groups, True, None)
        assert got.shape == expected.shape
        assert_close(got, expected, k=c // groups)
    # Every kernel asked for is a stride-1 conv of the subsampled size (or a GEMM).
    convs = [s for s in got_specs if hasattr(s, "r")]
    assert convs and all(s.stride == (1, 1) and s.h == expected.shape[2] for s in convs)
    # Gradients go through the op's own formulas, on the strided geometry.
    xg, wg = x.clone().requires_grad_(), wt.clone().requires_grad_()
    op(xg, wg, b, list(stride), [0, 0], [1, 1], groups, True, None).square().sum().backward()
    xr, wr = x.clone().requires_grad_(), wt.clone().requires_grad_()
    F.relu(F.conv2d(xr, wr, b, stride, groups=groups)).square().sum().backward()
    assert_close(xg.grad, xr.grad, k=4 * k)
    assert_close(wg.grad, wr.grad, k=4 * h * w)


def test_strided_1x1_conv_in_bfloat16():
    """The bf16 route of the stride-1 conv (a GEMM per image, on AMX tiles where the CPU
    has them) on the subsampled pixels, against torch's float32 conv of the same values."""
    x, w, b = (t.to(torch.bfloat16) for t in (randn(2, 32, 15, 14), randn(48, 32, 1, 1), randn(48)))
    got = op(x, w, b, [2, 2], [0, 0], [1, 1], 1, False, "silu")
    expected = F.silu(F.conv2d(x.float(), w.float(), b.float(), 2))
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert_close(got, expected, k=32)


@pytest.mark.parametrize(
    "n, c, k, h, w, r, s, stride, padding, dilation",
    [
        (1, 64, 40, 7, 7, 1, 1, (1, 1), (0, 0), (1, 1)),  # ResNet's last stage, 1x1
        (2, 24, 40, 7, 7, 3, 3, (1, 1), (1, 1), (1, 1)),  # its 3x3
        (1, 16, 24, 14, 13, 3, 3, (2, 2), (1, 1), (1, 1)),  # stride 2 into 7x7
        (3, 16, 8, 15, 14, 1, 1, (2, 2), (0, 0), (1, 1)),  # a strided 1x1 shortcut
        (1, 20, 8, 7, 8, 3, 2, (1, 1), (1, 0), (2, 1)),  # uneven kernel, padding, dilation
    ],
)
def test_few_pixels_run_as_one_gemm_over_channels_last_patches(
    monkeypatch, n, c, k, h, w, r, s, stride, padding, dilation
):
    """An fp32 conv with at most 64 output pixels an image and a 1x1 or channels_last
    weight is one GEMM over the patches of all images: right for any x layout, output
    channels_last for a channels_last x (else contiguous), every activation, no conv kernel
    asked for; a module keeping a weight for it is told to keep it channels_last. (Small
    convs here: the route's least work is lowered.)"""
    monkeypatch.setattr(cpu_conv2d, "PATCHES_GEMM_MIN_WORK", 0)
    monkeypatch.setattr(conv_ops, "_GEOMETRIES", {})
    got_specs = []
    for module in (conv_ops, gemm_ops):  # (the conv kernels, the GEMM kernels)
        get_kernel = module.get_kernel
        monkeypatch.setattr(
            module, "get_kernel", lambda s, f=get_kernel: got_specs.append(s) or f(s)
        )
    x = randn(n, c, h, w)
    wt = randn(k, c, r, s).contiguous(memory_format=torch.channels_last)
    b = randn(k)
    args = (list(stride), list(padding), list(dilation), 1)
    strided = randn(n, c, h, 2 * w)[..., ::2]  # (non-contiguous either way)
    for given in (x, x.to(memory_format=torch.channels_last), strided):
        for activation, bias in (("relu", b), ("none", None), ("relu6", b), ("silu", b),
                                 ("hardswish", None), ("leaky_relu_0.1", b)):  # fmt: skip
            expected = reference_conv(given, wt, bias, stride, padding, dilation, activation)
            got = op(given, wt, bias, *args, activation == "relu", activation)
            assert got.shape == expected.shape
            layout = torch.channels_last if conv_ops.channels_last_output(given) else None
            assert got.is_contiguous(memory_format=layout or torch.contiguous_format)
            assert_close(got, expected, k=c * r * s)
    assert got_specs and not [spec for spec in got_specs if hasattr(spec, "r")]
    assert conv_ops.weight_layout(x, wt.contiguous(), stride, padding, dilation, 1) == (
        torch.channels_last
    )


def reference_conv(x, w, b, stride, padding, dilation, activation):
    return torch_activation(activation)(F.conv2d(x, w, b, stride, padding, dilation))


def test_contiguous_3x3_weight_or_more_pixels_stay_on_the_conv_kernel(monkeypatch):
    """The patches of a contiguous 3x3 weight would be (C, R, S) runs of 3 values, whose copy
    costs what the GEMM gains: that conv keeps the conv kernel, as does one of 10x10 pixels."""
    monkeypatch.setattr(cpu_conv2d, "PATCHES_GEMM_MIN_WORK", 0)
    monkeypatch.setattr(conv_ops, "_GEOMETRIES", {})
    w = randn(8, 16, 3, 3)
    for x, weight in (
        (randn(1, 16, 7, 7), w),
        (randn(1, 16, 10, 10), w.to(memory_format=torch.channels_last)),
    ):
        assert (
            conv_ops._checked_geometry(x, weight, None, [1, 1], [1, 1], [1, 1], 1, True, None)[2]
            == "conv"
        )
        assert_close(
            op(x, weight, None, [1, 1], [1, 1]),
            F.relu(F.conv2d(x, weight, None, padding=1)),
            k=16 * 9,
        )
    assert (
        conv_ops.weight_layout(randn(1, 16, 10, 10), w, [1, 1], [1, 1], [1, 1], 1)
        == torch.contiguous_format
    )


@pytest.mark.parametrize(
    "c, k, size, r, stride, expected",
    [
        (2048, 512, 7, 1, 1, True),  # ResNet-50's last stage
        (512, 512, 7, 3, 1, True),
        (512, 512, 14, 3, 2, True),  # 14x14 -> 7x7
        (512, 512, 14, 3, 1, False),  # 196 pixels
        (160, 960, 7, 1, 1, False),  # MobileNetV2's: too little work an image
    ],
)
def test_the_patches_rule_takes_resnets_last_stage(c, k, size, r, stride, expected):
    x, w = torch.empty(1, c, size, size, device="meta"), torch.empty(k, c, r, r, device="meta")
    spec = conv_ops.conv2d_spec(x, w, None, stride, r // 2, 1, 1, True, device="cpu")
    assert cpu_conv2d.patches_as_gemm(spec) == expected
    assert not cpu_conv2d.patches_as_gemm(dataclasses.replace(spec, dtype="bfloat16"))


def test_patches_of_a_large_batch_a_chunk_of_images_at_a_time(monkeypatch):
    """Past PATCHES_MAX_BYTES of patches the GEMM runs a chunk of images at a time (here 2
    images of 7x7 x 3x3 x 8 channels a chunk, 5 images): the same result."""
    monkeypatch.setattr(cpu_conv2d, "PATCHES_GEMM_MIN_WORK", 0)
    monkeypatch.setattr(conv_ops, "_GEOMETRIES", {})
    monkeypatch.setattr(conv_ops, "PATCHES_MAX_BYTES", 2 * 49 * 72 * 4 + 100)
    rows = []
    gemm_activated = conv_ops._gemm_activated
    monkeypatch.setattr(
        conv_ops,
        "_gemm_activated",
        lambda a, *rest: rows.append(a.shape[0]) or gemm_activated(a, *rest),
    )
    x, w, b = randn(5, 8, 7, 7), randn(16, 8, 3, 3).to(memory_format=torch.channels_last), randn(16)
    got = op(x, w, b, [1, 1], [1, 1])
    assert rows == [98, 98, 49]
    assert_close(got, F.relu(F.conv2d(x, w, b, padding=1)), k=72)


def test_opcheck_on_the_patches_route(monkeypatch):
    monkeypatch.setattr(cpu_conv2d, "PATCHES_GEMM_MIN_WORK", 0)
    monkeypatch.setattr(conv_ops, "_GEOMETRIES", {})
    x = randn(2, 8, 7, 7).requires_grad_()
    w = randn(16, 8, 3, 3).to(memory_format=torch.channels_last).requires_grad_()
    args = (x, w, randn(16), [2, 2], [1, 1], [1, 1], 1, True, None)
    spec = conv_ops.conv2d_spec(*args[:8])
    assert conv_ops.reads_patches(spec, w)
    torch.library.opcheck(op, args)
