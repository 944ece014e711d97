"""The ops on a GPU: numerics vs PyTorch, opcheck, autograd, torch.compile, streams, CUDA
graphs, bad input. Skipped when torch.cuda.is_available() is false.

Kernels come from a pack (``TVM_GEMM_PACK``, built elsewhere with ``python -m torch_tvm_gemm
compile --preset test``) or are built here when apache-tvm and nvcc are installed. The
workloads are the table of ``torch_tvm_gemm.tools.cuda_cases``, which is also what ``--preset
test`` builds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_tvm_gemm.tools.cuda_cases import (
    CONV_GRAD_CASES,
    CONV_TEST_CASES,
    GRAD_CASES,
    TEST_CASES,
    TF32_CASES,
    Case,
    ConvCase,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_tf32 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="TF32 tensor cores need sm_80+",
)


def _tol(case: Case) -> dict:
    if case.dtype == torch.float32:  # fp32 SIMT kernels accumulate in a different order
        return {"rtol": 1e-4, "atol": 1e-4 * case.k**0.5}
    eps = 2**-7 if case.dtype == torch.bfloat16 else 2**-10
    return {"rtol": 2 * eps, "atol": 2 * eps * case.k**0.5 / 4}


def _check(case: Case, out, args) -> None:
    expected = case.reference(*args)
    assert out.dtype == case.dtype and out.device == args[0].device
    torch.testing.assert_close(out.float(), expected.float(), **_tol(case))


@pytest.mark.parametrize("case", TEST_CASES, ids=lambda c: f"{c.op}-{c.dtype}-{c.m}x{c.n}x{c.k}")
def test_numerics_vs_torch(case):
    args = case.inputs("cuda")
    _check(case, case.run(*args), args)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: f"{c.op}-{c.dtype}")
def test_autograd_matches_torch(case):
    args = case.inputs("cuda", requires_grad=True)
    ref_args = [a.detach().clone().requires_grad_(True) if torch.is_tensor(a) else a for a in args]
    case.run(*args).float().sum().backward()
    case.reference(*ref_args).float().sum().backward()
    for got, want in zip(args, ref_args, strict=True):
        if torch.is_tensor(got):
            torch.testing.assert_close(got.grad.float(), want.grad.float(), **_tol(case))


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: f"{c.op}-{c.dtype}")
def test_opcheck(case):
    args = case.inputs("cuda", requires_grad=True)
    op = torch.ops.tvm_gemm.matmul if case.op == "matmul" else torch.ops.tvm_gemm.linear
    torch.library.opcheck(op.default, args)


def test_torch_compile_fullgraph():
    case = GRAD_CASES[1]
    args = case.inputs("cuda")
    compiled = torch.compile(case.run, fullgraph=True)
    _check(case, compiled(*args), args)


def test_runs_on_the_current_stream():
    case = TEST_CASES[1]
    args = case.inputs("cuda")
    case.run(*args)  # load the kernel first
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # A long op queued first on the side stream: a kernel launched on another stream
        # would race it and read the inputs before they are written.
        a = args[0] * 0 + args[0]
        out = case.run(a, *args[1:])
    side.synchronize()
    _check(case, out, args)


def test_cuda_graph_capture():
    case = GRAD_CASES[1]
    args = case.inputs("cuda")
    case.run(*args)  # load outside the capture
    static_x = args[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = case.run(static_x, *args[1:])
    new_x = case.inputs("cuda", seed=1)[0]
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    _check(case, out, (new_x, *args[1:]))


@pytest.fixture
def allow_tf32():
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = True
    yield
    matmul.allow_tf32 = saved


def _exact(case: Case, args) -> torch.Tensor:
    """The reference in float64 (torch's own fp32 matmul would use TF32 too, when allowed)."""
    wide = [a.double() if torch.is_tensor(a) else a for a in args]
    return dataclasses.replace(case, dtype=torch.float64).reference(*wide)


def _tf32_tol(case: Case) -> dict:
    # TF32 keeps 10 mantissa bits and the tensor core truncates the rest: each product is
    # off by up to ~2**-9 relative; the fp32 sums add errors of random sign (~sqrt(K)).
    eps = 2**-10
    return {"rtol": 4 * eps, "atol": eps * case.k**0.5}


@needs_tf32
@pytest.mark.parametrize("case", TF32_CASES, ids=lambda c: f"{c.op}-{c.m}x{c.n}x{c.k}")
def test_tf32_numerics(case, allow_tf32):
    args = case.inputs("cuda")
    out = case.run(*args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _exact(case, args), **_tf32_tol(case))


@needs_tf32
def test_allow_tf32_switches_kernels(monkeypatch):
    """The flag is read at every call: off -> the exact fp32 kernel, on -> the TF32 one."""
    from torch_tvm_gemm.ops import gemm_ops

    case = TF32_CASES[3]  # linear 129x200x136, bias + relu
    args = case.inputs("cuda")
    specs = []
    real = gemm_ops.get_kernel
    monkeypatch.setattr(gemm_ops, "get_kernel", lambda spec: specs.append(spec) or real(spec))
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    try:
        outs = []
        for flag in (False, True, False):
            matmul.allow_tf32 = flag
            outs.append(case.run(*args))
    finally:
        matmul.allow_tf32 = saved
    assert [s.tf32 for s in specs] == [False, True, False]
    exact = _exact(case, args)
    err = [(out.double() - exact).abs().max().item() for out in outs]
    assert err[0] < 1e-4 and torch.equal(outs[0], outs[2]), err
    assert err[1] > 10 * err[0], err  # the TF32 kernel really rounds its inputs
    torch.testing.assert_close(outs[1].double(), exact, **_tf32_tol(case))


def test_cpu_cuda_mix_is_rejected():
    a = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="all tensors must be on one device"):
        torch.ops.tvm_gemm.matmul(a, torch.randn(8, 4))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_are_rejected():
    a = torch.randn(4, 8, device="cuda:0")
    with pytest.raises(RuntimeError, match="all tensors must be on one device"):
        torch.ops.tvm_gemm.matmul(a, torch.randn(8, 4, device="cuda:1"))


def test_unsupported_dtype_is_rejected():
    a = torch.ones(4, 8, device="cuda", dtype=torch.int32)
    with pytest.raises(TypeError, match="must be float32, float64, bfloat16 or float16"):
        torch.ops.tvm_gemm.matmul(a, a.t())


def test_old_arch_is_rejected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (6, 0))
    a = torch.randn(4, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="sm_60.*sm_70"):
        torch.ops.tvm_gemm.matmul(a, a.t().contiguous())


# --- conv2d + bias + relu ----------------------------------------------------------------------


def _conv_tol(case: ConvCase) -> dict:
    if case.dtype == torch.float64:
        return {"rtol": 1e-10, "atol": 1e-10 * case.reduction**0.5}
    if case.dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4 * case.reduction**0.5}
    eps = 2**-7 if case.dtype == torch.bfloat16 else 2**-10
    return {"rtol": 2 * eps, "atol": 2 * eps * case.reduction**0.5 / 4}


def _check_conv(case: ConvCase, out, args) -> None:
    expected = case.reference(*args)
    assert out.dtype == case.dtype and out.device == args[0].device
    assert out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), **_conv_tol(case))


def _conv_id(case: ConvCase) -> str:
    cl = "-cl" if case.channels_last else ""
    return f"{case.dtype}-n{case.n}c{case.c}{case.h}x{case.w}k{case.k}r{case.r}s{case.stride}{cl}"


@pytest.mark.parametrize("case", CONV_TEST_CASES, ids=_conv_id)
def test_conv_numerics_vs_torch(case):
    args = case.inputs("cuda")
    out = case.run(*args)
    _check_conv(case, out, args)
    # Memory format as F.conv2d's: channels_last in, channels_last out; else contiguous.
    if case.channels_last:
        assert out.is_contiguous(memory_format=torch.channels_last)
    else:
        assert out.is_contiguous()


@pytest.mark.parametrize("n", [1, 5, 0])
def test_conv_any_batch_one_kernel(n):
    case = dataclasses.replace(CONV_TEST_CASES[0], n=n)  # the spec has no batch: same kernel
    args = case.inputs("cuda")
    _check_conv(case, case.run(*args), args)


@pytest.mark.parametrize("case", CONV_GRAD_CASES, ids=_conv_id)
def test_conv_autograd_and_opcheck(case):
    args = case.inputs("cuda", requires_grad=True)
    ref_args = [a.detach().clone().requires_grad_(True) if torch.is_tensor(a) else a for a in args]
    case.run(*args).float().sum().backward()
    case.reference(*ref_args).float().sum().backward()
    for got, want in zip(args, ref_args, strict=True):
        if torch.is_tensor(got):
            torch.testing.assert_close(got.grad.float(), want.grad.float(), **_conv_tol(case))
    torch.library.opcheck(torch.ops.tvm_gemm.conv2d_bias_relu.default, case.inputs("cuda", True))
    last = dataclasses.replace(case, channels_last=True)  # the fake kernel's strides too
    torch.library.opcheck(torch.ops.tvm_gemm.conv2d_bias_relu.default, last.inputs("cuda", True))


def test_conv_torch_compile_fullgraph():
    case = CONV_GRAD_CASES[0]
    args = case.inputs("cuda")
    _check_conv(case, torch.compile(case.run, fullgraph=True)(*args), args)


def test_conv_groups_are_rejected_on_cuda():
    x = torch.randn(1, 4, 8, 8, device="cuda", dtype=torch.float16)
    w = torch.randn(4, 2, 3, 3, device="cuda", dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="conv2d_bias_relu: argument 'groups'"):
        torch.ops.tvm_gemm.conv2d_bias_relu(x, w, None, 1, 1, 1, 2)
