"""The bf16 GEMM on AMX tiles (schedules/cpu_amx.py): which specs take it, every M range and
padded K, both B layouts, epilogues, NaN, and the code it compiles to. The tests that run
kernels need a CPU with AMX (Sapphire Rapids or later); the others run everywhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm.kernels.gemm import GemmSpec, torch_activation
from torch_tvm_gemm.ops.gemm_ops import gemm_spec
from torch_tvm_gemm.schedules import cpu, cpu_amx
from torch_tvm_gemm.target import CpuInfo, host_cpu

CPU = host_cpu()
needs_amx = pytest.mark.skipif(not CPU.amx_bf16, reason="this CPU has no usable AMX tiles")
BF16 = torch.bfloat16


def reference(x, w, b, act):
    """torch's result from the same bf16 inputs, summed in fp32 (as the tiles do)."""
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    return torch_activation(act)(y)


def test_which_specs_run_on_tiles():
    amx = dataclasses.replace(CPU, features=CPU.features | {"amx_tile", "amx_bf16"})
    if not amx.amx_bf16:  # the flags alone are not enough: Linux must grant the tiles
        pytest.skip("this process may not use AMX tiles")
    linear = gemm_spec("bfloat16", 128, 768, 768, "nk", bias=True, activation="gelu")
    assert cpu_amx.applies(linear, amx)
    assert cpu_amx.applies(gemm_spec("bfloat16", 17, 768, 768, "nk"), amx)  # "dot" M
    assert cpu_amx.applies(gemm_spec("bfloat16", 64, 768, 77, "kn", static_k=False), amx)
    assert cpu_amx.applies(gemm_spec("bfloat16", 128, 50257, 768, "kn"), amx)  # a partial panel
    assert cpu_amx.applies(dataclasses.replace(linear, bias_axis="m"), amx)  # a 1x1 conv
    assert cpu_amx.applies(GemmSpec("bfloat16", 64, 64, "kn", batched=True), amx)  # P @ V
    assert cpu_amx.applies(GemmSpec("bfloat16", 128, 64, "nk", batched=True), amx)  # Q @ K^T
    # Not: other dtypes, M = 1 and 2 (the weight read once), an odd K of a Linear's weight
    # (read in pairs).
    assert not cpu_amx.applies(dataclasses.replace(linear, dtype="float32"), amx)
    assert not cpu_amx.applies(gemm_spec("bfloat16", 2, 768, 768, "nk"), amx)
    assert not cpu_amx.applies(gemm_spec("bfloat16", 1, 768, 768, "nk"), amx)
    assert not cpu_amx.applies(gemm_spec("bfloat16", 128, 768, 767, "nk"), amx)
    assert not cpu_amx.applies(GemmSpec("bfloat16", 64, 63, "nk", batched=True), amx)


def test_no_tiles_without_the_flags():
    plain = CpuInfo("x86_64", "", frozenset({"avx512f", "avx2", "fma"}))
    assert not plain.amx_bf16
    assert not cpu_amx.applies(gemm_spec("bfloat16", 128, 768, 768, "nk"), plain)
    assert not plain.key().endswith("-amx")


def test_compiles_to_tile_instructions():
    """Cross-compiled for an AMX target (no AMX needed to build): the tile product is there."""
    import tvm

    spec = gemm_spec("bfloat16", 128, 64, 96, "nk", bias=True, activation="relu")
    mod = cpu_amx.schedule_gemm_amx(spec)
    target = {"kind": "llvm", "mcpu": "sapphirerapids", "mtriple": "x86_64-linux-gnu"}
    asm = tvm.compile(mod, target=tvm.target.Target(target)).mod.inspect_source("asm")
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert instruction in asm, instruction


@pytest.mark.parametrize("mcpu", ["sapphirerapids", "znver4"])
def test_weight_pack_loads_each_row_once(mcpu):
    """``pack_nk``'s 16 x 16 transposes (AMX kernels; vdpbf16ps ones on Zen 4): 16 loads, 4
    rounds of shuffles, 16 stores. As one expression tree per column, loaded again after
    every store, they compiled to ~400 vector loads and ~350 shuffles here, now ~40 and 112."""
    import re

    import tvm

    from torch_tvm_gemm.schedules import cpu_avx512_bf16

    spec = gemm_spec("bfloat16", 128, 64, 96, "nk", bias=True)
    amx = mcpu == "sapphirerapids"
    mod = cpu_amx.schedule_gemm_amx(spec) if amx else cpu_avx512_bf16.schedule_gemm_dp(spec)
    target = {"kind": "llvm", "mcpu": mcpu, "mtriple": "x86_64-linux-gnu"}
    lines = tvm.compile(mod, target=tvm.target.Target(target)).mod.inspect_source("asm")
    loads = re.findall(r"\t(?:vmov\w+|vinsert\w+)\t[^%\n]*\(.*%zmm", lines)
    shuffles = re.findall(r"\tv(?:perm|shuf|unpck)\w*\t", lines)
    assert len(loads) < 100 and len(shuffles) < 200, (len(loads), len(shuffles))


@needs_amx
@pytest.mark.parametrize("m", [3, 7, 17, 33, 127, 513])
@pytest.mark.parametrize("act", ["none", "relu", "gelu", "silu"])
def test_linear_every_m(m, act):
    k = 96  # three whole K steps
    x, w, b = randn(m, k, dtype=BF16), randn(64, k, dtype=BF16), randn(64, dtype=BF16)
    assert cpu_amx.applies(gemm_spec("bfloat16", m, 64, k, "nk", bias=True, activation=act), CPU)
    assert_close(tg.linear(x, w, b, act), reference(x, w, b, act), k)


def test_dot_variant_range():
    """bf16 "nk" with a static even K takes the tiles' "dot" kernel up to AMX_DOT_MAX_M rows
    on an AMX CPU, while x fits in the L2; elsewhere the range of every dtype."""
    amx = dataclasses.replace(CPU, features=CPU.features | {"amx_tile", "amx_bf16"})
    plain = CpuInfo("x86_64", "", frozenset({"avx512f", "avx2", "fma"}))
    if amx.amx_bf16:
        assert cpu.amx_dot_limits(amx) == (cpu.AMX_DOT_MAX_M, amx.l2_bytes)
    assert cpu.amx_dot_limits(plain) == (0, 0)
    if CPU.amx_bf16:
        variants = [gemm_spec("bfloat16", m, 768, 768, "nk").variant for m in (3, 128, 129)]
        assert variants == ["dot", "dot", "gemm"]
        long_k = CPU.l2_bytes // (2 * 64)  # x of 64 rows fills the L2
        variants = [gemm_spec("bfloat16", m, 768, long_k, "nk").variant for m in (32, 64, 65)]
        assert variants == ["dot", "dot", "gemm"]
        assert gemm_spec("bfloat16", 64, 768, 767, "nk").variant == "gemm"  # an odd K
        assert gemm_spec("bfloat16", 64, 768, 768, "nk", static_k=False).variant == "gemm"
        assert gemm_spec("bfloat16", 64, 768, 768, "kn").variant == "gemm"


def test_kn_gemv_range():
    """bf16 with B (K, N) (a Conv1D weight, a product of two activations): the gemv (fp32
    math) up to BF16_GEMV_MAX_M rows on an AMX CPU, then the tiles' packed kernel, as on
    vdpbf16ps; GEMV_MAX_M rows where bf16 has no such kernel."""
    amx = dataclasses.replace(CPU, features=CPU.features | {"amx_tile", "amx_bf16"})
    plain = CpuInfo("x86_64", "", frozenset({"avx512f", "avx2", "fma"}))
    if amx.amx_bf16:
        assert cpu.bf16_gemv_max_m(amx) == cpu.BF16_GEMV_MAX_M
    assert cpu.bf16_gemv_max_m(plain) == cpu.GEMV_MAX_M
    if CPU.amx_bf16:
        for static_k in (True, False):
            variants = [
                gemm_spec("bfloat16", m, 2304, 768, "kn", static_k=static_k).variant
                for m in (1, cpu.BF16_GEMV_MAX_M, cpu.BF16_GEMV_MAX_M + 1, 8)
            ]
            assert variants == ["gemv", "gemv", "gemm", "gemm"]


@needs_amx
@pytest.mark.parametrize("m", [cpu.BF16_GEMV_MAX_M + 1, 7, 16])
def test_kn_few_rows_on_tiles(m):
    """A few rows against B (K, N) on the tiles' packed kernel: a Conv1D-style linear (the
    weight read through its transpose), with bias and activation, and a product of two
    activations (K symbolic)."""
    k, n = 96, 200
    x, w, b = randn(m, k, dtype=BF16), randn(k, n, dtype=BF16), randn(n, dtype=BF16)
    assert gemm_spec("bfloat16", m, n, k, "kn").variant == "gemm"
    assert_close(tg.linear(x, w.t(), b, "gelu"), reference(x, w.t(), b, "gelu"), k)
    assert_close(tg.matmul(x, w), (x.double() @ w.double()).to(BF16), k)


@needs_amx
@pytest.mark.parametrize("m", [3, 33, 64, 127])
@pytest.mark.parametrize(
    "n, k",
    [(256, 96), (100, 64), (200, 34), (504, 64), (768, 544)],
    ids=["whole", "partial-block", "partial-step", "16-blocks-partial", "chunks"],
)
def test_dot_variant_on_tiles(m, n, k):
    """The transposed product (the weight's rows as tiles in place, x packed; out^T summed):
    whole blocks, a partial last block of weight rows (N % 32 != 0, after 1 or 15 whole
    ones), a K that is not whole 32-value steps (every block copied, zero-padded), K in
    several chunks; bias and activation per column."""
    x, w, b = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16), randn(n, dtype=BF16)
    assert gemm_spec("bfloat16", m, n, k, "nk", bias=True, activation="gelu").variant == "dot"
    assert_close(tg.linear(x, w, b, "gelu"), reference(x, w, b, "gelu"), k)


@needs_amx
def test_dot_kernel_any_m():
    """The dot kernel itself loops over blocks of 32 rows of x: right past its M range too."""
    from torch_tvm_gemm.runtime.table import get_kernel

    kernel = get_kernel(GemmSpec("bfloat16", 512, 64, "nk", bias=True, variant="dot"))
    for m in (1, 161):
        x, w, b = randn(m, 64, dtype=BF16), randn(512, 64, dtype=BF16), randn(512, dtype=BF16)
        out = torch.empty(m, 512, dtype=BF16)
        kernel(x, w, b, out)
        assert_close(out, reference(x, w, b, "none"), 64)


@needs_amx
@pytest.mark.parametrize(
    "m, n",
    [(161, 100), (40, 512), (40, 224)],
    ids=["partial-blocks", "4-panels-a-task", "partial-last-task"],
)
def test_k_blocked_on_tiles(m, n):
    """A Linear whose panels of pairs outgrow half the L2 runs over blocks of K: three blocks
    (the last of 2 steps), sums kept across them, the epilogue once at the end; a partial
    last block of A (copied per K block) and a partial last panel."""
    k = 2 * cpu_amx.K_BLOCK_STEPS * cpu_amx.K_STEP + 64
    spec = gemm_spec("bfloat16", m, n, k, "nk", bias=True, activation="gelu")
    if not cpu_amx._k_blocked(spec):
        pytest.skip("this CPU's L2 holds the panels of this K")
    x, w, b = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16), randn(n, dtype=BF16)
    if spec.variant == "dot":  # (M = 40: the packed kernel itself)
        from torch_tvm_gemm.runtime.table import get_kernel

        kernel = get_kernel(dataclasses.replace(spec, variant="gemm"))
        out = torch.empty(m, n, dtype=BF16)
        kernel(x, w, b, out)
    else:
        out = tg.linear(x, w, b, "gelu")
    assert_close(out, reference(x, w, b, "gelu"), k)


@needs_amx
@pytest.mark.parametrize("k", [34, 80, 544], ids=["one-partial-step", "partial", "chunks"])
@pytest.mark.parametrize("n", [32, 256, 512], ids=["1-panel", "2-per-task", "4-per-task"])
def test_linear_padded_k_and_panel_groups(k, n):
    """K not a multiple of the 32-value step (zero padding in both operands), more than one
    K chunk of 256, and N split into tasks of 1, 2 and 4 panels."""
    m = cpu.AMX_DOT_MAX_M + 17  # the packed kernel (below: the dot variant, for "nk")
    x, w = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16)
    assert gemm_spec("bfloat16", m, n, k, "nk").variant == "gemm"
    assert_close(tg.linear(x, w, None, "none"), reference(x, w, None, "none"), k)


@needs_amx
@pytest.mark.parametrize("k", [470, 512], ids=["partial-chunk-and-step", "four-chunks"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_two_panel_tasks_in_short_chunks(k, layout):
    """Tasks of two panels run a K of up to 16 steps in chunks of PAIR_CHUNK_STEPS, the sums
    kept in memory between chunks: whole chunks, and a last chunk of 3 steps whose last step
    is partial (zero-padded)."""
    n = 256  # 8 panels: 4 tasks of 2
    assert cpu_amx.panels_per_task(n // cpu_amx.BLOCK) == 2
    steps = -(-k // cpu_amx.K_STEP)
    assert cpu_amx.chunk_steps(steps, 2) == cpu_amx.PAIR_CHUNK_STEPS < steps
    m = cpu.AMX_DOT_MAX_M + 17  # the packed kernel
    x, w, b = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16), randn(n, dtype=BF16)
    assert gemm_spec("bfloat16", m, n, k, layout, bias=True).variant == "gemm"
    weight = w if layout == "nk" else w.t().contiguous().t()
    assert_close(tg.linear(x, weight, b, "silu"), reference(x, w, b, "silu"), k)


def test_chunk_steps():
    """All of a K of up to 16 steps at once, except with two panels a task (chunks of
    PAIR_CHUNK_STEPS); a longer or symbolic K in chunks of CHUNK_STEPS."""
    pair, chunk = cpu_amx.PAIR_CHUNK_STEPS, cpu_amx.CHUNK_STEPS
    assert [cpu_amx.chunk_steps(s, 4) for s in (1, 3, 16, 17, 24)] == [1, 3, 16, chunk, chunk]
    assert [cpu_amx.chunk_steps(s, 2) for s in (3, pair, 5, 16, 17)] == [3, pair, pair, pair, chunk]
    assert cpu_amx.chunk_steps(10, 1) == 10


def test_panels_per_task():
    assert [cpu_amx.panels_per_task(p) for p in (1, 4, 7, 8, 16, 24)] == [1, 1, 2, 2, 4, 4]
    # Few tasks: the group that leaves the busier of two threads the fewest panels, of two
    # panels or more (43: 11 tasks of 4 would give one thread 24 panels, 22 tasks of 2 give
    # 22; 10: 5 tasks of 2, not 10 of 1); from FEW_TASKS tasks on, the most panels a task.
    assert [cpu_amx.panels_per_task(p) for p in (43, 20, 60, 10, 13)] == [2, 2, 3, 2, 4]
    assert cpu_amx.panels_per_task(4 * cpu_amx.FEW_TASKS + 3) == 4
    assert cpu_amx.panels_per_task(43, batched=True) == 1  # (the batch entries are tasks)


@needs_amx
@pytest.mark.parametrize("n", [224, 197, 1376], ids=["7-panels", "6.2-panels", "43-panels"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_partial_last_task(n, layout):
    """Panels that no group size divides: tasks of 2 or 4 panels, the last task computing its
    last panel (partial where N % 32 != 0) again in place of the missing ones."""
    m = cpu.AMX_DOT_MAX_M + 9  # the packed kernel
    x, w, b = randn(m, 96, dtype=BF16), randn(n, 96, dtype=BF16), randn(n, dtype=BF16)
    assert gemm_spec("bfloat16", m, n, 96, layout, bias=True).variant == "gemm"
    weight = w if layout == "nk" else w.t().contiguous().t()
    assert_close(tg.linear(x, weight, b, "silu"), reference(x, w, b, "silu"), 96)


@needs_amx
@pytest.mark.parametrize("m", [992, 993, 1057, 1090], ids=["31-blocks", "32", "34", "35"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_row_halves(m, layout):
    """From ROW_HALVES_MIN_BLOCKS blocks of 32 rows on, a Linear's tasks are (half of the
    blocks, panels): just below and at the threshold, an even and an odd block count, the
    last block partial; 7 panels (the last task repeats one), N and K off the steps."""
    n, k = 224, 100
    assert cpu_amx.row_halves(gemm_spec("bfloat16", m, n, k, layout))
    assert cpu_amx.row_halves(gemm_spec("bfloat16", m, 3072, 768, layout))
    assert not cpu_amx.row_halves(gemm_spec("bfloat16", m, 4096, 4096, layout))  # a big weight
    assert not cpu_amx.row_halves(gemm_spec("bfloat16", m, n, k, layout, static_k=False))
    blocks = -(-m // cpu_amx.BLOCK)
    assert (blocks >= cpu_amx.ROW_HALVES_MIN_BLOCKS) == (m >= 993)
    x, w, b = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16), randn(n, dtype=BF16)
    assert gemm_spec("bfloat16", m, n, k, layout, bias=True).variant == "gemm"
    weight = w if layout == "nk" else w.t().contiguous().t()
    out = tg.linear(x, weight, b, "gelu")
    assert_close(out, reference(x, w, b, "gelu"), k)


@needs_amx
@pytest.mark.parametrize("n", [1, 40, 100], ids=["one-column", "1.25-panels", "3.1-panels"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_partial_last_panel(n, layout):
    """N not a multiple of 32 (a vocabulary projection): the last panel's columns past N
    read clamped, their sums never stored; the bias and activation still per column."""
    m = cpu.AMX_DOT_MAX_M + 9  # the packed kernel
    x, w, b = randn(m, 64, dtype=BF16), randn(n, 64, dtype=BF16), randn(n, dtype=BF16)
    assert gemm_spec("bfloat16", m, n, 64, layout, bias=True).variant == "gemm"
    assert cpu_amx.applies(gemm_spec("bfloat16", m, n, 64, layout, bias=True), CPU)
    # "kn": a weight stored (K, N), read through its transposed view (GPT-2's Conv1D)
    weight = w if layout == "nk" else w.t().contiguous().t()
    assert_close(tg.linear(x, weight, b, "relu"), reference(x, w, b, "relu"), 64)


@needs_amx
@pytest.mark.parametrize(
    "a_shape, b_shape, transposed",
    [
        ((12, 128, 64), (12, 128, 64), True),  # attention's Q @ K^T: K^T read in place, "nk"
        ((12, 128, 128), (12, 128, 64), False),  # P @ V
        ((3, 100, 77), (3, 77, 100), False),  # partial blocks and panel, an odd K
        ((3, 37, 66), (3, 45, 66), True),
        ((1, 40, 64), (5, 64, 96), False),  # a broadcast batch
    ],
)
def test_batched_on_tiles(a_shape, b_shape, transposed):
    """3-D @ 3-D in one launch on the tiles: each task packs its panel of its own batch
    entry's B and writes its entry's rows."""
    a, b = randn(*a_shape, dtype=BF16), randn(*b_shape, dtype=BF16)
    b = b.transpose(1, 2) if transposed else b
    layout = "nk" if transposed else "kn"
    k = a.shape[-1]
    spec = gemm_spec("bfloat16", a.shape[1], b.shape[2], k, layout, static_k=transposed,
                     batched=True)  # fmt: skip
    assert cpu_amx.applies(spec, CPU)
    want = a.float() @ b.float()
    got = tg.matmul(a, b)
    assert got.shape == want.shape
    assert_close(got, want, k)


@needs_amx
@pytest.mark.parametrize("k", [1, 33, 64, 301])
@pytest.mark.parametrize("m", [5, 40, 100])
def test_matmul_symbolic_k(m, k):
    """torch.matmul's layout (K, N), one kernel for every K, odd K included."""
    a, b = randn(m, k, dtype=BF16), randn(k, 96, dtype=BF16)
    assert_close(tg.matmul(a, b), a.float() @ b.float(), k)


@needs_amx
def test_same_as_torch_bf16_linear():
    """Against torch's own bf16 linear (oneDNN, also on AMX): equal to the rounding of the
    last bit (the same fp32 sums, in another order)."""
    x, w, b = randn(200, 768, dtype=BF16), randn(768, 768, dtype=BF16), randn(768, dtype=BF16)
    ours, theirs = tg.linear(x, w, b, "none").float(), F.linear(x, w, b).float()
    ulp = theirs.abs().clamp_min(1e-30) * 2.0**-7
    assert ((ours - theirs).abs() <= ulp).float().mean() > 0.99


@needs_amx
def test_nan_and_inf_propagate():
    x, w, b = randn(40, 64, dtype=BF16), randn(64, 64, dtype=BF16), randn(64, dtype=BF16)
    x[3, 5] = float("nan")
    x[7, 0] = float("inf")
    y = tg.linear(x, w, b, "relu")
    expected = reference(x, w, b, "relu")
    assert torch.isnan(y[3]).all() and torch.isnan(expected[3]).all()
    torch.testing.assert_close(torch.isnan(y), torch.isnan(expected.to(BF16)))
    finite = ~torch.isnan(expected) & ~torch.isinf(expected)
    assert_close(y[finite], expected[finite], 64)


@needs_amx
@pytest.mark.parametrize("act", ["relu", "relu6"])
def test_pointwise_conv_on_tiles(act):
    """A bf16 1x1 conv of any size runs as one tile GEMM per image (W @ x[n], a bias per
    output channel, i.e. per row; 14 x 14 = 196 pixels: a partial last panel)."""
    from torch_tvm_gemm import ops
    from torch_tvm_gemm.schedules.cpu_conv2d import pointwise_as_gemm

    x, w, b = (
        randn(2, 96, 14, 14, dtype=BF16),
        randn(128, 96, 1, 1, dtype=BF16),
        randn(128, dtype=BF16),
    )
    conv_args = ((1, 1), (0, 0), (1, 1), 1, False, act)
    assert pointwise_as_gemm(ops.conv2d_spec(x, w, b, *conv_args[:5], None, act))
    assert cpu_amx.applies(gemm_spec("bfloat16", 128, 196, 96, "kn", bias=True, bias_axis="m"), CPU)
    y = torch.ops.tvm_gemm.conv2d_bias_relu(x, w, b, *conv_args)
    expected = F.conv2d(x.float(), w.float(), b.float())
    expected = F.relu(expected) if act == "relu" else F.relu6(expected)
    assert_close(y, expected, 96)


@needs_amx
@pytest.mark.parametrize(
    "r, stride, padding, dilation, act",
    [
        (3, 1, 1, 1, "relu"),
        (3, 2, 1, 1, "none"),
        (1, 2, 0, 1, "relu6"),
        (3, 1, 2, 2, "silu"),
        (1, 1, 1, 1, "hardswish"),
        (5, 3, 1, 1, "relu"),
    ],
)
def test_nhwc_conv_on_tiles(r, stride, padding, dilation, act):
    """Other bf16 convs with whole 32-channel steps (groups 1): the AMX implicit GEMM, taps
    in the padding read as zero, every activation, an output size not a multiple of 32."""
    from torch_tvm_gemm import ops
    from torch_tvm_gemm.kernels.conv2d import torch_activation as conv_activation
    from torch_tvm_gemm.schedules import cpu_amx_conv
    from torch_tvm_gemm.schedules.cpu_conv2d import nhwc_kernel

    x, w = randn(2, 64, 11, 9, dtype=BF16), randn(40, 64, r, r, dtype=BF16)
    b = randn(40, dtype=BF16)
    geometry = ((stride,) * 2, (padding,) * 2, (dilation,) * 2, 1)
    assert nhwc_kernel(ops.conv2d_spec(x, w, b, *geometry, False, None, act)) is cpu_amx_conv
    y = torch.ops.tvm_gemm.conv2d_bias_relu(x, w, b, *geometry, False, act)
    expected = F.conv2d(x.float(), w.float(), b.float(), stride, padding, dilation)
    assert y.shape == expected.shape and y.is_contiguous()
    assert_close(y, conv_activation(act)(expected), 64 * r * r)
    # channels_last input, no bias: the same kernel's numbers
    y_cl = torch.ops.tvm_gemm.conv2d_bias_relu(
        x.to(memory_format=torch.channels_last), w, None, *geometry, False, act
    )
    expected = F.conv2d(x.float(), w.float(), None, stride, padding, dilation)
    assert_close(y_cl, conv_activation(act)(expected), 64 * r * r)


def test_nhwc_conv_needs_whole_channel_steps():
    from torch_tvm_gemm.kernels.conv2d import Conv2dSpec
    from torch_tvm_gemm.schedules import cpu_amx_conv

    amx = dataclasses.replace(CPU, features=CPU.features | {"amx_tile", "amx_bf16"})
    if not amx.amx_bf16:
        pytest.skip("this process may not use AMX tiles")
    assert cpu_amx_conv.applies(Conv2dSpec("bfloat16", 64, 64, 3, 3, 56, 56), amx)
    assert not cpu_amx_conv.applies(Conv2dSpec("bfloat16", 3, 64, 7, 7, 224, 224), amx)
    assert not cpu_amx_conv.applies(Conv2dSpec("float32", 64, 64, 3, 3, 56, 56), amx)
    assert not cpu_amx_conv.applies(Conv2dSpec("bfloat16", 64, 64, 3, 3, 9, 9, groups=2), amx)


@needs_amx
@pytest.mark.parametrize(
    "r, stride, padding, dilation",
    [(3, 1, 1, 1), (3, 1, 2, 2), (5, 1, 2, 1), (1, 1, 1, 1), (3, 2, 1, 1)],
)
@pytest.mark.parametrize("width", [101, 27], ids=["row-blocks", "two-rows-a-block"])
def test_nhwc_conv_direct_tile_loads(r, stride, padding, dilation, width):
    """A's tiles loaded straight from the zero-bordered NHWC input at the stride of a filter
    tap: wide output rows in blocks of 32 pixels (the last partly past the row's end), rows
    of 16 pixels or fewer two a block (an odd last row paired with a dropped one)."""
    from torch_tvm_gemm import ops
    from torch_tvm_gemm.schedules.cpu_amx_conv import input_padding

    if width == 27 and stride == 1:
        width = 14  # 12-16 output columns: a tile per row
    x, w = randn(2, 32, 7, width, dtype=BF16), randn(48, 32, r, r, dtype=BF16)
    b = randn(48, dtype=BF16)
    geometry = ((stride,) * 2, (padding,) * 2, (dilation,) * 2, 1)
    assert input_padding(ops.conv2d_spec(x, w, b, *geometry, True)) is not None
    y = torch.ops.tvm_gemm.conv2d_bias_relu(x, w, b, *geometry, True)
    expected = F.relu(F.conv2d(x.float(), w.float(), b.float(), stride, padding, dilation))
    assert_close(y, expected, 32 * r * r)
