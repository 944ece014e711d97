"""The conv op checks a call's geometry once (``conv_ops._checked_geometry``): later calls
with that geometry skip the checks, every other call is still checked, bad input never
stays."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

from torch_tvm_gemm.ops import conv_ops

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
