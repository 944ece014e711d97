"""The bf16 GEMM and conv on AVX512-BF16's vdpbf16ps (schedules/cpu_avx512_bf16.py and
cpu_avx512_bf16_conv.py): which specs take them, every M, N and K edge, both B layouts,
per-row and per-column bias, epilogues, NaN, conv geometries, and the code they compile to.
The kernels are built from the schedules directly, so they run on any CPU with AVX512-BF16
(AMX CPUs have it too, though their ops take the tiles); the tests through the ops need a
CPU where the ops choose these kernels (AVX512-BF16 and no AMX: AMD Zen 4 / 5)."""

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
    # (Specs built directly: which variant an M gets depends on the host, see the next test.)
    linear = GemmSpec("bfloat16", 768, 768, "nk", bias=True, activation="gelu")
    assert cpu_avx512_bf16.applies(linear, ZEN5)
    assert cpu_avx512_bf16.applies(GemmSpec("bfloat16", 50, 64, "kn"), ZEN5)
    assert cpu_avx512_bf16.applies(dataclasses.replace(linear, bias_axis="m"), ZEN5)
    # a product of two activations (K symbolic, any K), batched too (attention's products)
    for layout in ("kn", "nk"):
        assert cpu_avx512_bf16.applies(GemmSpec("bfloat16", 50, None, layout), ZEN5)
    assert cpu_avx512_bf16.applies(GemmSpec("bfloat16", 64, None, "kn", batched=True), ZEN5)
    assert cpu_avx512_bf16.applies(GemmSpec("bfloat16", 128, 64, "nk", batched=True), ZEN5)
    # Not: another dtype, an odd static K (a weight's rows are read in pairs), the small-M
    # variants, a CPU without the extension.
    assert not cpu_avx512_bf16.applies(dataclasses.replace(linear, dtype="float32"), ZEN5)
    assert not cpu_avx512_bf16.applies(dataclasses.replace(linear, k=767), ZEN5)
    assert not cpu_avx512_bf16.applies(GemmSpec("bfloat16", 128, 63, "nk", batched=True), ZEN5)
    assert not cpu_avx512_bf16.applies(dataclasses.replace(linear, variant="dot"), ZEN5)
    plain = dataclasses.replace(ZEN5, features=ZEN5.features - {"avx512_bf16"})
    assert not cpu_avx512_bf16.applies(linear, plain)


def test_small_m_takes_it_from_5_rows():
    """The "dot" variant (fp32 math) up to 4 rows of a bf16 Linear here, the packed kernel on
    vdpbf16ps from 5 (not the gemv up to GEMV_MAX_M); elsewhere "dot" up to DOT_MAX_M. With B
    (K, N) the gemv up to 3 rows here, GEMV_MAX_M elsewhere."""
    assert cpu.bf16_dot_max_m(ZEN5) == cpu.BF16_DOT_MAX_M < cpu.GEMV_MAX_M < cpu.DOT_MAX_M
    assert cpu.bf16_gemv_max_m(ZEN5) == cpu.BF16_GEMV_MAX_M < cpu.GEMV_MAX_M
    plain = dataclasses.replace(ZEN5, features=ZEN5.features - {"avx512_bf16"})
    assert cpu.bf16_dot_max_m(plain) == cpu.DOT_MAX_M
    assert cpu.bf16_gemv_max_m(plain) == cpu.GEMV_MAX_M
    if cpu_avx512_bf16.available(CPU):
        variant = functools.partial(cpu.gemm_variant, n=768, k=768, b_layout="nk")
        assert variant(1, dtype="bfloat16") == "gemv"
        assert variant(cpu.BF16_DOT_MAX_M, dtype="bfloat16") == "dot"
        for m in (cpu.BF16_DOT_MAX_M + 1, cpu.GEMV_MAX_M, cpu.GEMV_MAX_M + 1):
            assert variant(m, dtype="bfloat16") == "gemm"
            assert variant(m, dtype="float32") != "gemm"  # (float32 unchanged: dot, swap32)
        # an odd K (fp32 math) is off the vectors too: the packed kernel (see DOT_K_MULTIPLE)
        assert variant(8, k=767, dtype="bfloat16") == "gemm"
        # B (K, N): the gemv up to BF16_GEMV_MAX_M rows (not GEMV_MAX_M), K symbolic or even
        kn = functools.partial(cpu.gemm_variant, n=768, b_layout="kn", dtype="bfloat16")
        for static_k, k in ((False, 767), (True, 768)):
            assert kn(cpu.BF16_GEMV_MAX_M, k=k, static_k=static_k) == "gemv"
            assert kn(cpu.BF16_GEMV_MAX_M + 1, k=k, static_k=static_k) == "gemm"
        assert kn(cpu.BF16_GEMV_MAX_M + 1, k=767) == "gemv"  # a static odd K: fp32 math
        assert cpu.gemm_variant(17, 768, 767, "nk", dtype="bfloat16") == "gemm"  # odd K
        assert cpu.gemm_variant(17, 768, 768, "nk", dtype="float32") == "dot"


@pytest.mark.parametrize(
    "spec",
    [
        gemm_spec("bfloat16", 128, 64, 96, "nk", bias=True, activation="relu"),
        gemm_spec("bfloat16", 128, 64, 96, "kn", static_k=False),  # (its even-K loop first)
    ],
    ids=["linear", "matmul"],
)
def test_compiles_to_dot_products_in_registers(spec):
    """Cross-compiled for Zen 4 (no AVX512-BF16 needed to build): vdpbf16ps, with the sums in
    registers: no vector store in a loop of the K steps (a block that jumps back to its own
    label and holds a row block's dot products; with the sums in TVM's "local" scope, a heap
    workspace, a store followed every dot product). (Outside the loops, e.g. an unrolled
    loop's last step, LLVM may keep broadcasts on the stack.)"""
    import re

    import tvm

    mod = cpu_avx512_bf16.schedule_gemm_dp(spec)
    target = {"kind": "llvm", "mcpu": "znver4", "mtriple": "x86_64-linux-gnu"}
    asm = tvm.compile(mod, target=tvm.target.Target(target)).mod.inspect_source("asm")
    loops = [
        body
        for label, body in re.findall(r"^(\.LBB\w+):\n(.*?)(?=^\S+:)", asm, re.M | re.S)
        if re.search(rf"\tj\w+\t{re.escape(label)}$", body, re.M)
        and body.count("vdpbf16ps") >= 2 * cpu_avx512_bf16.MR
    ]
    assert loops
    for body in loops:
        stores = re.findall(r"vmov\w+\t%zmm\d+, .*\(", body)
        assert not stores, stores[:3]


def test_target_names_the_cpus_instruction_sets(monkeypatch):
    """A VM may show a CPU model whose LLVM name lacks the instruction sets the CPU has (KVM
    showing a Xeon with AMX and AVX512-BF16 as model 167, "rocketlake" to LLVM): the target
    names them from the CPU's flags, else LLVM aborts the build on vdpbf16ps."""
    import tvm
    import tvm.target.codegen

    from torch_tvm_gemm.compiler import build

    flags = {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "avx512_bf16", "amx_tile"}
    monkeypatch.setattr(build, "host_cpu", lambda: CpuInfo("x86_64", "vm", frozenset(flags)))
    monkeypatch.setattr(tvm.target.codegen, "llvm_get_system_cpu", lambda: "rocketlake")
    target = build.llvm_target_json()
    assert target["mcpu"] == "rocketlake"
    assert {"+avx512bf16", "+amx-tile", "+avx512f", "+fma"} <= set(target["mattr"])
    assert "+amx-bf16" not in target["mattr"] and "+avx512fp16" not in target["mattr"]
    spec = gemm_spec("bfloat16", 64, 64, 96, "nk", bias=True, activation="relu")
    mod = cpu_avx512_bf16.schedule_gemm_dp(spec)
    asm = tvm.compile(mod, target=tvm.target.Target(target)).mod.inspect_source("asm")
    assert "vdpbf16ps" in asm


@needs_bf16_dot
@pytest.mark.parametrize("m", [1, 4, 7, 8, 12, 13, 16, 20, 33, 127])
@pytest.mark.parametrize(("n", "k"), [(64, 96), (50, 70), (96, 2), (32, 1030), (32, 8320)])
def test_linear_every_edge(m, n, k):
    """M around the 12-row tile and its last block's tail tiles of 4 and 8 rows (M = 16, 20:
    a block of 12 and one of 4 or 8), N off the 32-column panel, K of one pair and off the
    packs' 32-value steps (K = 1030: one pass, past the L1; K = 8320: chunks of K, the sums
    kept between them, past a quarter of a 2 MB L2 too)."""
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
@pytest.mark.parametrize("m", [1, 7, 13, 20, 127])
@pytest.mark.parametrize(("n", "layout"), [(32, "kn"), (50, "kn"), (50, "nk")])
def test_matmul_of_activations_every_k(m, n, layout):
    """One kernel (K symbolic) for every K: odd ones (rows start off 32-bit words: A's pairs
    put together from halves, the last value alone; B (N, K) packed a value at a time), one
    value, off the packs' 32-value steps, past a chunk of 256 pairs (K = 513: the last chunk
    only the odd value)."""
    spec = gemm_spec("bfloat16", m, n, 64, layout, static_k=False)
    assert spec.k is None
    for k in (1, 2, 33, 64, 513, 514, 1031):
        a = randn(m, k, dtype=BF16)
        b = randn(*((n, k) if layout == "nk" else (k, n)), dtype=BF16)
        assert_close(run(spec, a, b), reference(a, b, None, spec), k)


@needs_bf16_dot
@pytest.mark.parametrize(("layout", "k"), [("nk", 64), ("kn", 64), ("kn", 33), ("kn", 600)])
def test_batched_matmul(layout, k):
    """Attention's products as one batched kernel: ``Q @ K^T`` (B (batch, N, K), a static
    even K) and ``P @ V`` (B (batch, K, N), K symbolic), each entry its own matrices."""
    spec = GemmSpec("bfloat16", 40, k if layout == "nk" else None, layout, batched=True)
    a = randn(3, 29, k, dtype=BF16)
    b = randn(3, *((40, k) if layout == "nk" else (k, 40)), dtype=BF16)
    out = torch.empty(3, 29, 40, dtype=BF16)
    kernel(spec)(a, b, out)
    for i in range(3):
        assert_close(out[i], reference(a[i], b[i], None, spec), k)


@needs_bf16_dot
def test_odd_k_nan_and_inf_stay_in_their_rows():
    """With an odd K a row's last value pairs with zero, not with the next row's first: an
    inf there times the pack's zero padding would be NaN in the row before."""
    spec = gemm_spec("bfloat16", 14, 64, 35, "kn", static_k=False)
    a, b = randn(14, 35, dtype=BF16), randn(35, 64, dtype=BF16)
    a[3, 5] = float("nan")
    a[7, 0] = float("inf")  # row 6's last value is next to it
    a[13, 34] = float("inf")  # the last value of the last row
    y, expected = run(spec, a, b), reference(a, b, None, spec)
    torch.testing.assert_close(torch.isnan(y), torch.isnan(expected.to(BF16)))
    assert torch.isnan(y[3]).all() and not torch.isnan(y[6]).any()
    finite = torch.isfinite(expected)
    assert_close(y[finite], expected[finite], 35)


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
    not cpu_avx512_bf16.available(CPU),
    reason="the ops take this kernel on a CPU with AVX512-BF16 and no AMX",
)
@pytest.mark.parametrize("m", [5, 16, 200])
def test_through_the_ops_against_torch_bf16(m):
    """The op's bf16 linear takes this kernel here (from M = 5), and is equal to torch's own
    bf16 linear (oneDNN, also on vdpbf16ps) to the rounding of the last bit."""
    x, w, b = randn(m, 768, dtype=BF16), randn(768, 768, dtype=BF16), randn(768, dtype=BF16)
    assert cpu.gemm_variant(m, 768, 768, "nk", dtype="bfloat16") == "gemm"
    ours, theirs = tg.linear(x, w, b, "none").float(), F.linear(x, w, b).float()
    ulp = theirs.abs().clamp_min(1e-30) * 2.0**-7
    assert ((ours - theirs).abs() <= ulp).float().mean() > 0.99


def test_which_convs_take_it():
    from torch_tvm_gemm.kernels.conv2d import Conv2dSpec
    from torch_tvm_gemm.schedules import cpu_avx512_bf16_conv
    from torch_tvm_gemm.schedules.cpu_conv2d import nhwc_kernel, pointwise_as_gemm

    conv3x3 = Conv2dSpec("bfloat16", 64, 64, 3, 3, 56, 56, padding=(1, 1))
    assert nhwc_kernel(conv3x3, ZEN5) is cpu_avx512_bf16_conv
    # a 1x1 conv is a GEMM per image (on the GEMM above); an odd C (RGB), a grouped conv, a
    # CPU without the extension: the conv kernel
    pointwise = dataclasses.replace(conv3x3, r=1, s=1, padding=(0, 0))
    assert pointwise_as_gemm(pointwise, ZEN5) and nhwc_kernel(pointwise, ZEN5) is None
    assert nhwc_kernel(dataclasses.replace(conv3x3, c=3), ZEN5) is None
    assert nhwc_kernel(dataclasses.replace(conv3x3, groups=2), ZEN5) is None
    plain = dataclasses.replace(ZEN5, features=ZEN5.features - {"avx512_bf16"})
    assert nhwc_kernel(conv3x3, plain) is None


@functools.cache
def conv_kernel(spec):
    import tvm

    from torch_tvm_gemm.compiler.build import llvm_target_json
    from torch_tvm_gemm.schedules import cpu_avx512_bf16_conv

    mod = cpu_avx512_bf16_conv.schedule_conv2d_dp(spec)
    return tvm.compile(mod, target=tvm.target.Target(llvm_target_json()))["main"]


@needs_bf16_dot
@pytest.mark.parametrize(
    ("c", "r", "stride", "padding", "dilation", "act"),
    [(32, 3, 1, 1, 1, "relu"), (16, 3, 2, 1, 1, "none"), (8, 5, 1, 2, 2, "silu"),
     (34, 3, 1, 0, 1, "relu6"), (6, 1, 2, 0, 1, "hardswish"), (64, 7, 2, 3, 1, "relu")],
)  # fmt: skip
def test_conv_every_geometry(c, r, stride, padding, dilation, act):
    """The implicit GEMM as ops/conv_ops.py runs it (NHWC input with a zero border of the
    conv's padding, OHWI weight, NHWC output): strides, paddings, dilations, an output size
    not a multiple of the 12-pixel tile, 40 filters (a partial panel)."""
    from torch_tvm_gemm.kernels.conv2d import torch_activation as conv_activation
    from torch_tvm_gemm.ops.conv_ops import conv2d_spec

    x, w, b = randn(2, c, 11, 9, dtype=BF16), randn(40, c, r, r, dtype=BF16), randn(40, dtype=BF16)
    geometry = ((stride,) * 2, (padding,) * 2, (dilation,) * 2, 1)
    spec = conv2d_spec(x, w, b, *geometry, False, None, act)
    x_nhwc = F.pad(x.permute(0, 2, 3, 1), (0, 0, padding, padding, padding, padding))
    w_ohwi = w.permute(0, 2, 3, 1).reshape(40, -1).contiguous()
    out = torch.empty(2 * spec.out_h * spec.out_w, 40, dtype=BF16)
    conv_kernel(spec)(x_nhwc.contiguous(), w_ohwi, b, out)
    y = out.view(2, spec.out_h, spec.out_w, 40).permute(0, 3, 1, 2)
    expected = F.conv2d(x.float(), w.float(), b.float(), stride, padding, dilation)
    assert_close(y, conv_activation(act)(expected), c * r * r)


@pytest.mark.skipif(
    not cpu_avx512_bf16.available(CPU),
    reason="the ops take this kernel on a CPU with AVX512-BF16 and no AMX",
)
def test_conv_through_the_op_channels_last_too():
    x, w, b = (
        randn(2, 32, 10, 12, dtype=BF16),
        randn(24, 32, 3, 3, dtype=BF16),
        randn(24, dtype=BF16),
    )
    expected = F.relu(F.conv2d(x.float(), w.float(), b.float(), 1, 1))
    for memory_format in (torch.contiguous_format, torch.channels_last):
        y = torch.ops.tvm_gemm.conv2d_bias_relu(
            x.contiguous(memory_format=memory_format), w, b, [1, 1], [1, 1], [1, 1], 1, True
        )
        assert y.is_contiguous(memory_format=memory_format)
        assert_close(y, expected, 32 * 9)


@pytest.mark.skipif(
    not cpu_avx512_bf16.available(CPU),
    reason="the ops take this kernel on a CPU with AVX512-BF16 and no AMX",
)
def test_matmul_op_takes_it_against_torch_bf16():
    """The op's bf16 matmul of two activations, 2-D and batched (a broadcast batch too), is
    torch's bf16 matmul to the rounding of the last bit (the sums in fp32 on both sides)."""
    a2, b2 = randn(200, 301, dtype=BF16), randn(301, 96, dtype=BF16)
    assert cpu.gemm_variant(200, 96, 301, "kn", dtype="bfloat16", static_k=False) == "gemm"
    q, k = randn(24, 128, 64, dtype=BF16), randn(24, 128, 64, dtype=BF16)
    p, v = randn(1, 128, 128, dtype=BF16), randn(24, 128, 64, dtype=BF16)
    for a, b in [(a2, b2), (q, k.transpose(1, 2)), (p, v)]:
        ours, theirs = tg.matmul(a, b).float(), torch.matmul(a, b).float()
        ulp = theirs.abs().clamp_min(1e-30) * 2.0**-7
        assert ((ours - theirs).abs() <= ulp).float().mean() > 0.99
