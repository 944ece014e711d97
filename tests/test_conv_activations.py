"""The conv op's epilogues (``activation=``: relu6, hardswish, silu, leaky_relu and
leaky_relu_<slope>, sigmoid, hardsigmoid, relu, none) against torch: values with NaN and inf, every kernel variant, autograd, opcheck, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm.kernels.conv2d import ACTIVATIONS, torch_activation
from torch_tvm_gemm.measure import tolerance

op = torch.ops.tvm_gemm.conv2d_bias_relu
NEW = ["relu6", "hardswish", "silu", "leaky_relu", "leaky_relu_0.1", "sigmoid", "hardsigmoid"]


def reference(x, w, b, activation, padding=0, groups=1):
    """torch's result in float64 from the same (rounded) inputs."""
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), 1, padding, 1, groups)
    return torch_activation(activation)(y)


# (C, K, H, W, kernel, groups): the blocked kernel, the direct one (depthwise), 1x1 convs
# that run as GEMMs with the epilogue in the GEMM kernel: per image (C <= 64, >= 1024
# pixels), over a channels_last x's pixels, over one pixel a image.
VARIANTS = {
    "blocked": (6, 20, 9, 8, 3, 1),
    "depthwise": (8, 8, 9, 8, 3, 8),
    "pointwise": (8, 12, 32, 33, 1, 1),
    "pointwise-channels_last": (8, 12, 5, 6, 1, 1),
    "one-pixel": (8, 12, 1, 1, 1, 1),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("activation", [*ACTIVATIONS, "leaky_relu_0.2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_values_with_nan_and_inf(activation, dtype, variant):
    """Bias values NaN, +-inf, the kinks (-3, 0, 3, 6) and ordinary values: each output
    channel's pre-activation runs over them."""
    c, k, h, w, r, groups = VARIANTS[variant]
    special = [float("nan"), float("inf"), -float("inf"), -3.0, 0.0, 3.0, 6.0, -0.0]
    b = torch.cat([torch.tensor(special), 4 * torch.randn(k - len(special))]).to(dtype)
    x, wt = randn(2, c, h, w, dtype=dtype), randn(k, c // groups, r, r, dtype=dtype)
    if variant.endswith("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    y = op(x, wt, b, [1, 1], [r // 2] * 2, [1, 1], groups, True, activation)
    expected = reference(x, wt, b, activation, r // 2, groups).to(dtype)
    assert y[:, 0].isnan().all()  # NaN stays NaN through every epilogue
    torch.testing.assert_close(y, expected, equal_nan=True, **tolerance(dtype, c // groups * r * r))


def test_relu_flag_still_decides_without_activation():
    x, w, b = randn(2, 5, 9, 8), randn(6, 5, 3, 3), randn(6)
    assert torch.equal(
        op(x, w, b, [1, 1], [1, 1]), op(x, w, b, [1, 1], [1, 1], [1, 1], 1, True, "relu")
    )
    plain = op(x, w, b, [1, 1], [1, 1], [1, 1], 1, False)
    assert (plain < 0).any()
    assert torch.equal(plain, op(x, w, b, [1, 1], [1, 1], [1, 1], 1, True, "none"))
    assert torch.equal(
        tg.conv2d_bias_relu(x, w, b, padding=1, activation="relu6"),
        op(x, w, b, [1, 1], [1, 1], [1, 1], 1, False, "relu6"),
    )


def test_bad_activation():
    x, w = randn(1, 3, 5, 5), randn(4, 3, 3, 3)
    with pytest.raises(ValueError, match=r"conv2d_bias_relu: argument 'activation' must be one"):
        tg.conv2d_bias_relu(x, w, activation="gelu6")
    with pytest.raises(ValueError, match="argument 'activation'"):  # also with nothing to compute
        tg.conv2d_bias_relu(x[:0], w, activation="tanh")
    # a leaky ReLU's slope: >= 0, finite, spelled as Python prints the float (one kernel each)
    for name in (
        "leaky_relu_-0.1",
        "leaky_relu_nan",
        "leaky_relu_inf",
        "leaky_relu_0.10",
        "leaky_relu_0.01",
        "leaky_relu_",
    ):
        with pytest.raises(ValueError, match="leaky_relu_<slope>"):
            tg.conv2d_bias_relu(x, w, activation=name)


@pytest.mark.parametrize("activation", NEW)
def test_gradcheck(activation):
    def make(*shape):
        return randn(*shape, dtype=torch.float64).requires_grad_()

    x, w, b = make(2, 4, 6, 5), make(6, 2, 3, 3), 2 * make(6)
    assert torch.autograd.gradcheck(
        lambda x, w, b: op(x, w, b, [2, 1], [1, 1], [1, 2], 2, False, activation),
        (x, w, b),
        fast_mode=True,
    )
    assert torch.autograd.gradcheck(  # forward mode
        lambda x, w: op(x, w, None, [1, 1], [1, 1], [1, 1], 1, False, activation),
        (x, make(5, 4, 3, 3)),
        fast_mode=True,
        check_forward_ad=True,
        check_backward_ad=False,
    )


@pytest.mark.parametrize("activation", NEW)
def test_gradients_match_torch(activation):
    """Against torch's own derivatives, relu6's kinks included (torch passes no gradient at
    exactly 0 and 6)."""
    x, w = randn(2, 3, 6, 6).requires_grad_(), randn(5, 3, 3, 3).requires_grad_()
    b = torch.tensor([0.0, 6.0, 2.0, -1.0, 7.0]).requires_grad_()
    y = op(x, torch.zeros_like(w) + w, b, [1, 1], [1, 1], [1, 1], 1, True, activation)
    grad = randn(*y.shape)
    y.backward(grad)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    torch_activation(activation)(F.conv2d(xr, wr, br, 1, 1)).backward(grad)
    assert_close(x.grad, xr.grad, k=45)
    assert_close(w.grad, wr.grad, k=72)
    assert_close(b.grad, br.grad, k=72)


def test_inference_tensors():
    with torch.inference_mode():
        x, w = randn(1, 3, 5, 5), randn(4, 3, 3, 3)
    b = torch.zeros(4, requires_grad=True)
    y = op(x, w, b, [1, 1], [1, 1], [1, 1], 1, True, "silu")
    y.sum().backward()
    assert b.grad is not None


@pytest.mark.parametrize("activation", NEW)
def test_opcheck(activation):
    args = (randn(2, 3, 7, 6), randn(4, 3, 3, 3), randn(4), [2, 1], [1, 1], [1, 1], 1)
    torch.library.opcheck(op, (*args, False, activation))


@pytest.mark.parametrize("activation", NEW)
def test_torch_compile(activation):
    x, w, b = randn(2, 3, 9, 9), randn(8, 3, 3, 3).requires_grad_(), randn(8)

    def f(x, w, b):
        return tg.conv2d_bias_relu(x, w, b, padding=1, activation=activation).sum()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b)
    loss.backward()
    w_ref = w.detach().clone().requires_grad_()
    ref = torch_activation(activation)(F.conv2d(x, w_ref, b, 1, 1)).sum()
    ref.backward()
    assert_close(loss.detach(), ref.detach(), k=27 * 162)
    assert_close(w.grad, w_ref.grad, k=162)


@pytest.mark.parametrize("activation", NEW)
def test_cuda_math_on_cpu(monkeypatch, activation):
    """The CUDA impl's implicit-GEMM math with each epilogue, compiled for LLVM and run on
    the CPU (unscheduled; the CUDA build tests compile the scheduled kernels)."""
    import contextlib

    import tvm

    from torch_tvm_gemm.kernels.conv2d_cuda import conv2d_gemm_compute
    from torch_tvm_gemm.ops import conv_ops

    def cpu_kernel(spec):
        assert spec.device == "cuda" and spec.activation == activation
        func = conv2d_gemm_compute(spec, 32, 16, 16, granule=1)
        return tvm.compile(tvm.IRModule({"main": func}), target={"kind": "llvm"})["main"]

    monkeypatch.setattr(conv_ops, "get_kernel", cpu_kernel)
    monkeypatch.setattr(conv_ops, "check_cuda_arch", lambda x: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    x, w = randn(2, 6, 9, 7), randn(10, 6, 3, 3)
    b = torch.tensor([float("nan"), float("inf"), -float("inf"), -3, 0, 3, 6, 1, -1, 2])
    y = conv_ops._conv2d_cuda_impl(x, w, b, 1, 1, 1, 1, True, activation)
    torch.testing.assert_close(
        y, reference(x, w, b, activation, 1).float(), equal_nan=True, **tolerance(y.dtype, 54)
    )


@pytest.mark.slow
@pytest.mark.parametrize("activation", NEW)
def test_cuda_kernel_source_compiles(activation):
    """The scheduled CUDA kernel with each epilogue goes through nvcc (cross-compiled)."""
    from torch_tvm_gemm.compiler import build, cuda_pack
    from torch_tvm_gemm.compiler.cuda_pack import NvccNotFoundError
    from torch_tvm_gemm.kernels.conv2d import Conv2dSpec

    spec = Conv2dSpec(
        "float16", 32, 64, 3, 3, 14, 14, padding=(1, 1), device="cuda", activation=activation
    )
    executable, _ = build.compile_spec(spec, arch="sm_80", arches=["sm_80"])
    try:
        info = cuda_pack.ptxas_info(executable.source, "sm_80")
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    assert info["spill_stores"] == info["spill_loads"] == 0, info


def test_compile_cli_parses_activations():
    from torch_tvm_gemm.cli.compile import parse_conv_op

    for name in NEW:
        spec = parse_conv_op(f"conv2d:float16:8:16:3x3:9x9:p1:{name}")
        assert spec.activation == name and not spec.relu and spec.stride == (1, 1)
    assert parse_conv_op("conv2d:float16:8:16:3x3:9x9:norelu").activation == "none"
    assert parse_conv_op("conv2d:float16:8:16:3x3:9x9").activation == "relu"


@pytest.mark.parametrize("activation", ["relu6", "hardswish", "leaky_relu_0.1", "sigmoid"])
@pytest.mark.parametrize("variant", ["pointwise", "pointwise-channels_last", "one-pixel"])
def test_a_gemm_route_runs_the_epilogue_in_the_gemm_kernel(activation, variant):
    """Not as a second pass over the output: the GEMM kernel asked for carries it."""
    from torch_tvm_gemm import ops

    c, k, h, w, _, _ = VARIANTS[variant]
    x, wt, b = randn(2, c, h, w), randn(k, c, 1, 1), randn(k)
    if variant.endswith("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    with ops.planning() as planned:
        op(x, wt, b, [1, 1], [0, 0], [1, 1], 1, True, activation)
    gemms = [s for s in planned.specs if s.family == "gemm"]
    assert [s.activation for s in gemms] == [activation], planned.specs
