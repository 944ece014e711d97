"""The bf16 GEMM on AVX512-BF16's vdpbf16ps (schedules/cpu_avx512_bf16.py): which specs take
it, every M, N and K edge, both B layouts, per-row and per-column bias, epilogues, NaN, and
the code it compiles to. The kernels are built from the schedule directly, so they run on
any CPU with AVX512-BF16 (AMX CPUs have it too, though their ops take the tiles); the tests
through the ops need a CPU where the ops choose this kernel (AVX512-BF16 and no AMX: AMD
Zen 4 / 5)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm.kernels.gemm import GemmSpec, torch_activation
from torch_tvm_gemm.ops.gemm_ops import gemm_spec
from torch_tvm_gemm.schedules import cpu, cpu_avx512_bf16
from torch_tvm_gemm.target import CpuInfo, host_cpu

CPU = host_cpu()
needs_bf16_dot = pytest.mark.skipif(
    "avx512_bf16" not in CPU.features, reason="this CPU has no AVX512-BF16"
)
BF16 = torch.bfloat16
ZEN5 = CpuInfo("x86_64", "AMD EPYC", frozenset({"avx512f", "avx2", "fma", "avx512_bf16"}))


@functools.cache
def kernel(spec: GemmSpec):
    """The kernel of ``spec`` built from this schedule for this CPU (whatever the ops pick)."""
    import tvm

    from torch_tvm_gemm.compiler.build import llvm_target_json

    mod = cpu_avx512_bf16.schedule_gemm_dp(spec)
    return tvm.compile(mod, target=tvm.target.Target(llvm_target_json()))["main"]


def run(spec: GemmSpec, a, b, bias=None):
    out = torch.empty(a.shape[0], spec.n, dtype=BF16)
    kernel(spec)(a, b, *([] if bias is None else [bias]), out)
    return out


def reference(a, b, bias, spec: GemmSpec):
    """torch's result from the same bf16 inputs, summed in fp32 (as the kernel does)."""
    y = a.float() @ (b.float().t() if spec.b_layout == "nk" else b.float())
    if bias is not None:
        y = y + (bias.float()[:, None] if spec.bias_axis == "m" else bias.float())
    return torch_activation(spec.activation)(y)


def test_which_specs_take_it():
    linear = gemm_spec("bfloat16", 128, 768, 768, "nk", bias=True, activation="gelu")
    assert linear.variant == "gemm"
    assert cpu_avx512_bf16.applies(linear, ZEN5)
    assert cpu_avx512_bf16.applies(gemm_spec("bfloat16", 512, 50, 64, "kn"), ZEN5)
    assert cpu_avx512_bf16.applies(dataclasses.replace(linear, bias_axis="m"), ZEN5)
    # Not: another dtype, an odd or symbolic K (A is read in pairs), a batch, the small-M
    # variants, a CPU without the extension.
    assert not cpu_avx512_bf16.applies(dataclasses.replace(linear, dtype="float32"), ZEN5)
    assert not cpu_avx512_bf16.applies(dataclasses.replace(linear, k=767), ZEN5)
    assert not cpu_avx512_bf16.applies(dataclasses.replace(linear, k=None), ZEN5)
    assert not cpu_avx512_bf16.applies(GemmSpec("bfloat16", 64, 64, "kn", batched=True), ZEN5)
    assert not cpu_avx512_bf16.applies(gemm_spec("bfloat16", 8, 768, 768, "nk"), ZEN5)
    plain = dataclasses.replace(ZEN5, features=ZEN5.features - {"avx512_bf16"})
    assert not cpu_avx512_bf16.applies(linear, plain)


def test_compiles_to_dot_products_in_registers():
    """Cross-compiled for Zen 4 (no AVX512-BF16 needed to build): vdpbf16ps, with the sums in
    registers: no vector store between the K loop's first and last dot product (with the
    sums in TVM's "local" scope, a heap workspace, one followed every dot product)."""
    import re

    import tvm

    spec = gemm_spec("bfloat16", 128, 64, 96, "nk", bias=True, activation="relu")
    mod = cpu_avx512_bf16.schedule_gemm_dp(spec)
    target = {"kind": "llvm", "mcpu": "znver4", "mtriple": "x86_64-linux-gnu"}
    lines = tvm.compile(mod, target=tvm.target.Target(target)).mod.inspect_source("asm")
    lines = lines.splitlines()
    dots = [i for i, line in enumerate(lines) if "vdpbf16ps" in line]
    assert len(dots) >= 2 * cpu_avx512_bf16.MR
    stores = [
        line for line in lines[dots[0] : dots[-1]] if re.search(r"vmov\w+\t%zmm\d+, .*\(", line)
    ]
    assert not stores, stores[:3]


@needs_bf16_dot
@pytest.mark.parametrize("m", [1, 7, 12, 13, 33, 127])
@pytest.mark.parametrize(("n", "k"), [(64, 96), (50, 70), (96, 2), (32, 1030)])
def test_linear_every_edge(m, n, k):
    """M around the 12-row tile, N off the 32-column panel, K of one pair and off the packs'
    32-value steps."""
    spec = gemm_spec("bfloat16", m, n, k, "nk", bias=True, activation="relu")
    x, w, b = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16), randn(n, dtype=BF16)
    assert_close(run(spec, x, w, b), reference(x, w, b, spec), k)


@needs_bf16_dot
@pytest.mark.parametrize("act", ["none", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 34)])
def test_matmul_layout_and_epilogues(act, n, k):
    spec = gemm_spec("bfloat16", 45, n, k, "kn", activation=act)
    a, b = randn(45, k, dtype=BF16), randn(k, n, dtype=BF16)
    assert_close(run(spec, a, b), reference(a, b, None, spec), k)


@needs_bf16_dot
def test_bias_per_row():
    """A 1x1 convolution as W @ X: the bias is one per row of the result."""
    spec = gemm_spec("bfloat16", 24, 196, 64, "kn", bias=True, bias_axis="m")
    a, b, bias = randn(24, 64, dtype=BF16), randn(64, 196, dtype=BF16), randn(24, dtype=BF16)
    assert_close(run(spec, a, b, bias), reference(a, b, bias, spec), 64)


@needs_bf16_dot
def test_nan_stays_in_its_row():
    """A NaN in a row of x reaches that row's outputs only: the rows past M read the last
    row and the K loop stops at the real pairs (a padded pair times the panel's zeros would
    turn the next row's inf into NaN)."""
    spec = gemm_spec("bfloat16", 14, 64, 70, "nk", bias=True, activation="relu")
    x, w, b = randn(14, 70, dtype=BF16), randn(64, 70, dtype=BF16), randn(64, dtype=BF16)
    x[3, 5] = float("nan")
    x[13, 69] = float("inf")  # the last value of the last row
    y, expected = run(spec, x, w, b), reference(x, w, b, spec)
    torch.testing.assert_close(torch.isnan(y), torch.isnan(expected.to(BF16)))
    assert torch.isnan(y[3]).all() and not torch.isnan(y[:3]).any()
    finite = torch.isfinite(expected)
    assert_close(y[finite], expected[finite], 70)


@pytest.mark.skipif(
    not cpu_avx512_bf16.applies(gemm_spec("bfloat16", 128, 64, 64, "nk"), CPU),
    reason="the ops take this kernel on a CPU with AVX512-BF16 and no AMX",
)
def test_through_the_ops_against_torch_bf16():
    """The op's bf16 linear takes this kernel here, and is equal to torch's own bf16 linear
    (oneDNN, also on vdpbf16ps) to the rounding of the last bit."""
    x, w, b = randn(200, 768, dtype=BF16), randn(768, 768, dtype=BF16), randn(768, dtype=BF16)
    assert cpu.gemm_variant(200, 768, 768, "nk", dtype="bfloat16") == "gemm"
    ours, theirs = tg.linear(x, w, b, "none").float(), F.linear(x, w, b).float()
    ulp = theirs.abs().clamp_min(1e-30) * 2.0**-7
    assert ((ours - theirs).abs() <= ulp).float().mean() > 0.99
