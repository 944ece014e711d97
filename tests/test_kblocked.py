"""The K-blocked packed CPU kernel (a static K past the L2 threshold): chunk boundaries, padded
K, every dtype, epilogues applied once to the final sum, both B layouts, a per-row bias."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm.kernels.gemm import GemmSpec
from torch_tvm_gemm.runtime.table import get_kernel
from torch_tvm_gemm.schedules.cpu import k_chunk, k_chunk_max, one_pass_max_k
from torch_tvm_gemm.target import host_cpu

CPU = host_cpu()
pytestmark = pytest.mark.skipif(CPU.vector_registers < 32, reason="no K blocking on this CPU")
# The largest K that still runs as one pass (a 4-vector-wide fp32 panel under half the L2).
K_ONE_PASS = one_pass_max_k(CPU)
K_CHUNK = k_chunk_max(CPU)  # the longest chunk
K_EXACT = (K_ONE_PASS // K_CHUNK + 1) * K_CHUNK  # whole chunks of K_CHUNK
K_ODD = K_ONE_PASS + 2  # no chunk of whole vectors divides it: K padded to whole chunks


def spec(k: int, dtype: str = "float32", **kw) -> GemmSpec:
    return GemmSpec(dtype, 70, k, kw.pop("b_layout", "nk"), **kw)


def reference(x, w, b, act):
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    return {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}[act](y)


def test_chunk_rule_at_the_threshold():
    assert k_chunk(spec(K_ONE_PASS), CPU) is None
    assert k_chunk(spec(K_ONE_PASS + 1), CPU) is not None  # a panel of half the L2: chunks
    assert k_chunk(spec(K_EXACT), CPU) == K_CHUNK
    kc = k_chunk(spec(K_ODD), CPU)
    assert kc % 16 == 0 and K_ODD % kc != 0
    # A K with a shorter whole-vector chunk than K_CHUNK that divides it takes that chunk.
    k = (K_CHUNK - 16) * math.ceil(K_EXACT / (K_CHUNK - 16))
    assert k % K_CHUNK != 0 and K_CHUNK // 2 <= k_chunk(spec(k), CPU) < K_CHUNK
    assert k % k_chunk(spec(k), CPU) == 0
    # Not for small M variants, symbolic K or batched kernels.
    assert k_chunk(spec(K_EXACT, variant="dot"), CPU) is None
    assert k_chunk(GemmSpec("float32", 70, None, "kn"), CPU) is None


def test_chunks_follow_the_l2():
    # A panel's piece of a chunk takes at most an eighth of the L2: LLaMA-7B's K = 11008 in
    # 16 chunks of 688 on a 2 MB L2, 43 of 256 on 1 MB.
    import dataclasses

    two_mb, one_mb = (dataclasses.replace(CPU, l2_bytes=size << 20) for size in (2, 1))
    assert (k_chunk_max(two_mb), k_chunk_max(one_mb)) == (1024, 512)
    assert (k_chunk(spec(11008), two_mb), k_chunk(spec(11008), one_mb)) == (688, 256)
    assert k_chunk(spec(14336, "float64"), two_mb) == 1024


@pytest.mark.parametrize("k", [K_ONE_PASS, K_ODD, K_EXACT], ids=["one-pass", "padded", "exact"])
@pytest.mark.parametrize("m", [33, 127])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_linear_around_the_threshold(k, m, act):
    x, w, b = randn(m, k), randn(70, k), randn(70)
    assert_close(tg.linear(x, w, b, act), reference(x, w, b, act), k)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(dtype, layout):
    x, w, b = randn(40, K_ODD, dtype=dtype), randn(130, K_ODD, dtype=dtype), randn(130, dtype=dtype)
    weight = w if layout == "nk" else w.t().contiguous().t()
    assert_close(tg.linear(x, weight, b, "relu"), reference(x, w, b, "relu"), K_ODD)


@pytest.mark.parametrize("n", [1024, 1000], ids=["whole-panels", "last-panel-padded"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_several_panels_per_task_and_large_m(n, layout):
    # 16 panels of 64, two per parallel task (a "kn" chunk's rows copied in vectors across
    # both); M = 513 off the 6-row tile.
    from torch_tvm_gemm.schedules.cpu import _panels_per_task

    assert _panels_per_task(GemmSpec("float32", n, K_EXACT, layout), 64, CPU) >= 2
    x, w = randn(513, K_EXACT), randn(n, K_EXACT)
    weight = w if layout == "nk" else w.t().contiguous().t()  # ("kn": a (K, N) weight's view)
    assert_close(tg.linear(x, weight, None), reference(x, w, None, "none"), K_EXACT)


@pytest.mark.parametrize("m", [7, 513])
def test_kn_last_panel_of_whole_vectors(m):
    # N = 1040: 16 panels of 64 and one of 16 vectors' worth padded to 64, its padded columns
    # clamped by vectors (schedules/cpu.py column_granule) and never stored.
    s = GemmSpec("float32", 1040, K_EXACT, "kn", bias=True, activation="relu")
    assert k_chunk(s, CPU) is not None
    x, w, b = randn(m, K_EXACT), randn(1040, K_EXACT), randn(1040)
    out = torch.full((m, 1040), float("nan"))
    get_kernel(s)(x, w.t().contiguous(), b, out)  # (the packed kernel at any M)
    assert_close(out, reference(x, w, b, "relu"), K_EXACT)


def test_relu_keeps_nan_and_applies_once():
    # The partial sums of the first chunks are negative, the total positive: a relu applied
    # per chunk would clamp them. A NaN in a row of x stays a NaN in that row only.
    k = K_EXACT
    x = torch.ones(40, k)
    w = torch.ones(3, k)
    w[:, : k // 2] = -1.0
    w[:, k // 2 :] = 1.5
    x[5, 7] = float("nan")
    out = tg.linear(x, w, torch.zeros(3), "relu")
    expected = F.relu(F.linear(x.double(), w.double())).float()
    assert torch.isnan(out[5]).all() and not torch.isnan(out[torch.arange(40) != 5]).any()
    torch.testing.assert_close(out, expected, equal_nan=True)
    assert (out[0] > 0).all()


@pytest.mark.parametrize("bias_axis", ["n", "m"])
def test_kn_layout_and_row_bias(bias_axis):
    # The layout a 1x1 convolution uses (W @ X, one bias per row) with a static K.
    k = K_ODD
    s = spec(k, b_layout="kn", bias=True, activation="relu", bias_axis=bias_axis)
    assert k_chunk(s, CPU) is not None
    fn = get_kernel(s)
    a, bm = randn(19, k), randn(k, 70)
    bias = randn(19 if bias_axis == "m" else 70)
    out = torch.empty(19, 70)
    fn(a, bm, bias, out)
    y = a.double() @ bm.double() + (bias.double()[:, None] if bias_axis == "m" else bias.double())
    assert_close(out, F.relu(y), k)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_asks_for_the_next_chunk_of_the_weight_on_a_small_l2(layout):
    # cpu_pack_prefetch.prefetch_next_chunk: one prefetch, in the loop over the tiles, taken
    # while M's tiles of a chunk of A take at most a third of the L2; none past a 1 MB L2.
    import dataclasses

    from torch_tvm_gemm.schedules import cpu as cpu_schedules

    one_mb, two_mb = (dataclasses.replace(CPU, l2_bytes=size << 20) for size in (1, 2))
    k = 4 * 2048  # (chunked on both: K past half of either L2 in a 64-wide panel)
    script = cpu_schedules.schedule_gemm(spec(k, b_layout=layout), one_mb).script()
    assert script.count("llvm.prefetch") == 1
    max_tiles = one_mb.l2_bytes // 3 // (6 * k_chunk(spec(k), one_mb) * 4)
    assert f"(M + T.int64(5)) // T.int64(6) <= T.int64({max_tiles})" in script
    script = cpu_schedules.schedule_gemm(spec(k, b_layout=layout), two_mb).script()
    assert "llvm.prefetch" not in script


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_last_tile_runs_the_rows_left(layout):
    # cpu_tail_tile in the K-blocked kernel: each chunk's last tile of 6 rows sums only the
    # rows left (a tail of 2 or 4), M at every remainder of 6; its partial sums still add
    # up across the chunks. The output starts as NaN: every value must be written.
    from torch_tvm_gemm.schedules import cpu as cpu_schedules

    s = spec(K_ODD, b_layout=layout, bias=True, activation="relu")
    assert cpu_schedules.schedule_gemm(s, CPU).script().count('sblock("partial_update")') == 3
    kernel = get_kernel(s)
    w, b = randn(70, K_ODD), randn(70)
    for m in [1, 2, 3, 4, 5, 6, 7, 11, 127, 128]:
        x = randn(m, K_ODD)
        out = torch.full((m, 70), float("nan"))
        kernel(x, w if layout == "nk" else w.t().contiguous(), b, out)
        assert_close(out, reference(x, w, b, "relu"), K_ODD)


def test_kn_rule_takes_wide_tasks_the_cores_share_evenly():
    # A float32 Linear weight stored (K, N): chunks of KN_CHUNK, tasks of up to 6 panels,
    # their count a multiple of the cores; whole panels only, not for a vocabulary's N.
    import dataclasses

    from torch_tvm_gemm.schedules.cpu import KN_CHUNK, kn_panels_per_task

    two, four = (dataclasses.replace(CPU, l2_bytes=2 << 20, cores=c) for c in (2, 4))

    def width(n, k, cpu=two, layout="kn", dtype="float32", **kw):
        return kn_panels_per_task(GemmSpec(dtype, n, k, layout, **kw), cpu)

    assert (width(768, 3072), width(768, 3072, four), width(1280, 5120)) == (6, 3, 5)
    assert width(1024, 4096) == 4 and width(1024, 4096, dataclasses.replace(two, cores=16)) is None
    assert width(1000, 768) is None and width(50304, 768) is None  # part panel; thousands
    assert width(768, 256) is None and width(768, None) is None  # K short or symbolic
    assert width(768, 3072, layout="nk") is None and width(768, 3072, dtype="float64") is None
    assert width(768, 3072, bias=True, bias_axis="m") is None  # a 1x1 conv's GEMM
    assert k_chunk(GemmSpec("float32", 768, 3072, "kn"), two) == KN_CHUNK
    # (a "kn" chunk has no vectors along K: one that divides K where one does, else padded)
    assert k_chunk(GemmSpec("float32", 768, 1000, "kn"), two) == 250
    assert k_chunk(GemmSpec("float32", 768, 1376, "kn"), two) == 172  # (LLaMA-style dX)
    assert k_chunk(GemmSpec("float32", 768, 1009, "kn"), two) in range(
        KN_CHUNK // 2, KN_CHUNK + 1, 16
    )


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_padded_chunks_keep_an_inf_in_its_row(layout):
    # Where the chunks pad K, A is copied into tiles with zeros past K: the last column of x
    # holding an inf makes its row infinite, never a NaN, and no other row changes.
    k, n = (1009, 768) if layout == "kn" else (K_ODD, 70)  # ("kn": chunked in whole panels)
    s = GemmSpec("float32", n, k, layout)
    assert k % k_chunk(s, CPU) != 0  # (padded)
    x, w = randn(40, k), randn(n, k)
    x[3, -1] = float("inf")
    out = torch.full((40, n), float("nan"))
    get_kernel(s)(x, w if layout == "nk" else w.t().contiguous(), out)
    expected = reference(x, w, None, "none")
    assert not torch.isnan(out).any() and torch.isinf(out[3]).all()
    rows = torch.arange(40) != 3
    assert_close(out[rows], expected[rows], k)
    assert torch.equal(out[3], expected[3].float())


@pytest.mark.parametrize("k", [768, 1000, 1009], ids=["whole-vectors", "chunks-of-250", "padded"])
@pytest.mark.parametrize("m", [1, 7, 33, 127, 513])
def test_kn_linear_in_wide_tasks(k, m):
    # GPT-2's Conv1D layout: the packed kernel called directly at every M (the op picks
    # other kernels for the smallest), N = 768: 12 panels, tasks of several.
    from torch_tvm_gemm.schedules.cpu import kn_panels_per_task

    s = GemmSpec("float32", 768, k, "kn", bias=True, activation="gelu")
    assert (k_chunk(s, CPU) is not None) == (kn_panels_per_task(s, CPU) is not None)
    x, w, b = randn(m, k), randn(768, k), randn(768)
    out = torch.full((m, 768), float("nan"))
    get_kernel(s)(x, w.t().contiguous(), b, out)
    assert_close(out, reference(x, w, b, "gelu"), k)
    assert_close(tg.linear(x, w.t().contiguous().t(), b, "gelu"), reference(x, w, b, "gelu"), k)
