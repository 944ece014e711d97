"""The conv op's C++ impl (csrc/tvm_gemm_ops.cpp conv2d_impl) against the Python one: the
same bits on every route (those it runs itself and those it hands to Python), the same
errors, a route table that clears, and no weight kept between calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn, run_on

from torch_tvm_gemm import _ext
from torch_tvm_gemm.kernels.conv2d import torch_activation
from torch_tvm_gemm.runtime import table

EXT = _ext.load()
pytestmark = pytest.mark.skipif(EXT is None, reason=f"C++ extension not built ({_ext.load_error})")

conv = torch.ops.tvm_gemm.conv2d_bias_relu
CL = torch.channels_last


def _case(x, w, bias=True, stride=1, padding=0, groups=1, act="relu"):
    b = randn(w.shape[0], seed=3) if bias else None
    return x, w, b, [stride] * 2, [padding] * 2, [1, 1], groups, True, act


# (x, weight, bias, stride, padding, dilation, groups, relu, activation) for each route
CASES = {
    "conv kernel": lambda: _case(randn(2, 8, 9, 9), randn(16, 8, 3, 3), padding=1),
    "conv kernel, hardswish, no bias": lambda: _case(
        randn(1, 8, 9, 9), randn(16, 8, 3, 3), bias=False, act="hardswish"
    ),
    "one pixel: linear": lambda: _case(randn(2, 24, 1, 1), randn(12, 24, 1, 1), act="silu"),
    "one pixel: linear, no activation": lambda: _case(
        randn(1, 24, 1, 1), randn(12, 24, 1, 1), act="none"
    ),
    "one pixel, relu6": lambda: _case(randn(2, 24, 1, 1), randn(12, 24, 1, 1), act="relu6"),
    "one pixel, sigmoid": lambda: _case(randn(2, 24, 1, 1), randn(12, 24, 1, 1), act="sigmoid"),
    "one pixel, another leaky slope (Python)": lambda: _case(
        randn(2, 24, 1, 1), randn(12, 24, 1, 1), act="leaky_relu_0.1"
    ),
    "one pixel of a strided 2x2": lambda: _case(randn(3, 8, 2, 2), randn(12, 8, 1, 1), stride=2),
    "channels_last x": lambda: _case(
        randn(1, 8, 6, 6).contiguous(memory_format=CL), randn(16, 8, 3, 3), padding=1
    ),
    "channels_last x and weight, silu": lambda: _case(
        randn(2, 8, 6, 6).contiguous(memory_format=CL),
        randn(16, 8, 3, 3).contiguous(memory_format=CL),
        padding=1,
        act="silu",
    ),
    "channels_last depthwise": lambda: _case(
        randn(2, 16, 7, 7).contiguous(memory_format=CL), randn(16, 1, 3, 3), padding=1, groups=16
    ),
    "channels_last 1x1: pixels": lambda: _case(
        randn(2, 24, 5, 5).contiguous(memory_format=CL), randn(12, 24, 1, 1), act="hardswish"
    ),
    "channels_last 1x1, another leaky slope (Python)": lambda: _case(
        randn(2, 24, 5, 5).contiguous(memory_format=CL), randn(12, 24, 1, 1), act="leaky_relu_0.1"
    ),
    "channels_last x, 20 channels (Python)": lambda: _case(
        randn(1, 8, 6, 6).contiguous(memory_format=CL), randn(20, 8, 3, 3), padding=1
    ),
    "strided x": lambda: _case(randn(1, 8, 6, 12)[..., ::2], randn(16, 8, 3, 3), padding=1),
    "strided 1x1 (Python)": lambda: _case(randn(1, 8, 8, 8), randn(16, 8, 1, 1), stride=2),
    "depthwise": lambda: _case(randn(1, 16, 8, 8), randn(16, 1, 3, 3), padding=1, groups=16),
    "empty batch (Python)": lambda: _case(randn(0, 8, 6, 6), randn(16, 8, 3, 3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_both_paths_agree_bitwise(name):
    args = CASES[name]()
    with torch.no_grad():
        cpp = run_on("cpp", lambda: conv(*args))
        py = run_on("python", lambda: conv(*args))
    assert torch.equal(cpp, py)
    assert cpp.stride() == py.stride()
    x, w, b, stride, padding, dilation, groups, _, act = args
    want = torch_activation(act)(F.conv2d(x, w, b, stride, padding, dilation, groups))
    assert_close(cpp, want, k=w[0].numel())


def test_repeated_calls_read_the_weight_each_time():
    """The table keeps a route and a kernel per geometry, never a weight: writes torch does not
    count (through ``.data``) are seen by the next call, on both C++ routes."""
    pairs = ((randn(1, 8, 9, 9), randn(16, 8, 3, 3)), (randn(2, 24, 1, 1), randn(12, 24, 1, 1)))
    for x, w in pairs:
        args = (x, w, None, [1, 1], [0, 0], [1, 1], 1, True, "none")
        first = run_on("cpp", lambda args=args: conv(*args))
        w.data.mul_(-2)
        second = run_on("cpp", lambda args=args: conv(*args))
        assert_close(second, F.conv2d(x, w), k=w[0].numel())
        assert_close(second, first * -2, k=w[0].numel())


BAD_CALLS = {
    "3-D x": lambda: conv(randn(8, 9, 9), randn(16, 8, 3, 3), None),
    "channels mismatch": lambda: conv(randn(1, 7, 9, 9), randn(16, 8, 3, 3), None),
    "bias size": lambda: conv(randn(1, 8, 9, 9), randn(16, 8, 3, 3), randn(15)),
    "dtypes": lambda: conv(randn(1, 8, 9, 9), randn(16, 8, 3, 3, dtype=torch.float64), None),
    "activation": lambda: conv(randn(1, 8, 9, 9), randn(16, 8, 3, 3), None, activation="tanh"),
    "groups": lambda: conv(randn(1, 8, 9, 9), randn(16, 3, 3, 3), None, groups=3),
    "stride 0": lambda: conv(randn(1, 8, 9, 9), randn(16, 8, 3, 3), None, [0, 1]),
    "kernel larger than x": lambda: conv(randn(1, 8, 2, 2), randn(16, 8, 3, 3), None),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_same_errors(name):
    def error_on(path):
        def run():
            with pytest.raises(Exception) as info:
                BAD_CALLS[name]()
            return info.type, str(info.value)

        return run_on(path, run)

    cpp, py = error_on("cpp"), error_on("python")
    assert cpp == py
    assert "conv2d_bias_relu" in py[1], py


def test_a_bad_call_is_not_planned():
    """A geometry the checks reject leaves no entry: the next call raises again."""
    table.clear_table()
    for _ in range(2):
        with pytest.raises(ValueError):
            run_on("cpp", BAD_CALLS["bias size"])
    assert EXT.conv_table_size() == 0


def test_clear_table_clears_the_conv_routes():
    x, w = randn(1, 8, 9, 9), randn(16, 8, 3, 3)
    run_on("cpp", lambda: conv(x, w, None))
    assert EXT.conv_table_size() > 0
    table.clear_table()
    assert EXT.conv_table_size() == 0
    assert_close(run_on("cpp", lambda: conv(x, w, None)), F.relu(F.conv2d(x, w)), k=72)


def test_gradients_through_the_cpp_path():
    x = randn(2, 8, 6, 6).requires_grad_()
    w = randn(16, 8, 3, 3).requires_grad_()
    b = randn(16).requires_grad_()
    got = run_on("cpp", lambda: torch.autograd.grad(conv(x, w, b, [1, 1], [1, 1]).sum(), (x, w, b)))
    want = torch.autograd.grad(F.relu(F.conv2d(x, w, b, 1, 1)).sum(), (x, w, b))
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, k=144)


@pytest.mark.parametrize(
    "name,in_cpp",
    [
        ("conv kernel", True),
        ("one pixel: linear", True),
        ("one pixel, sigmoid", True),
        ("one pixel, another leaky slope (Python)", False),
        ("channels_last x", True),
        ("channels_last depthwise", True),
        ("channels_last 1x1: pixels", True),
        ("channels_last 1x1, another leaky slope (Python)", False),
        ("channels_last x, 20 channels (Python)", False),
    ],
)
def test_which_routes_stay_in_cpp(monkeypatch, name, in_cpp):
    """Once planned, the conv kernel, one-pixel and channels_last kernel / pixel-GEMM routes
    never enter the Python impl; the others call it every time."""
    from torch_tvm_gemm.ops import conv_ops

    args = CASES[name]()
    run_on("cpp", lambda: conv(*args))  # plans the geometry

    def python_impl(*_args):
        raise RuntimeError("the Python impl was called")

    monkeypatch.setattr(conv_ops, "_conv2d_impl", python_impl)
    if in_cpp:
        run_on("cpp", lambda: conv(*args))
    else:
        with pytest.raises(RuntimeError, match="Python impl was called"):
            run_on("cpp", lambda: conv(*args))


@pytest.mark.parametrize("path", ["cpp", "python"])
def test_one_pixel_output_takes_in_place_writes_in_training(path):
    """The one-pixel route writes into an output of its own (not a view of another result):
    autograd lets a model write into it in place, as into F.conv2d's."""
    x = randn(2, 24, 1, 1).requires_grad_()
    w = randn(12, 24, 1, 1).requires_grad_()

    def run():
        y = conv(x, w, None, [1, 1], [0, 0], [1, 1], 1, True, "none")
        assert y._base is None
        y[0] = 0.0
        y.sum().backward()
        return x.grad.clone()

    grad = run_on(path, run)
    x.grad = None
    assert_close(grad[1], w.sum(0).detach(), k=12)
    assert torch.equal(grad[0], torch.zeros_like(grad[0]))
