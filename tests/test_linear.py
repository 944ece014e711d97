"""tvm_gemm.linear against F.linear + activation: epilogues, dtypes, leading dims, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_close, randn, tolerance

import torch_tvm_gemm as tg
from torch_tvm_gemm.kernels.gemm import ACTIVATIONS, torch_activation
from torch_tvm_gemm.ops.gemm_ops import gemm_spec
from torch_tvm_gemm.runtime import cache
from torch_tvm_gemm.schedules import cpu as cpu_schedules
from torch_tvm_gemm.schedules import cpu_tail_tile, cpu_tile_store
from torch_tvm_gemm.schedules.cpu import gemm_variant
from torch_tvm_gemm.target import host_cpu

REF_ACT = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}


def reference(x, w, b, act):
    return REF_ACT[act](F.linear(x.double(), w.double(), None if b is None else b.double()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("m,k,n", [(7, 33, 65), (9, 64, 80), (33, 127, 7)])
def test_linear(m, k, n, act, has_bias, dtype):
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype)
    b = randn(n, dtype=dtype) if has_bias else None
    out = tg.linear(x, w, b, act)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, reference(x, w, b, act), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("m", [1, 7, 33, 127, 513])
def test_kn_weight_of_whole_vectors_but_not_whole_panels(m, dtype):
    """A "kn" weight (a Conv1D's) whose N is whole vectors but not whole panels: the last
    panel's padded columns clamp by vectors (``column_granule``) and are never stored. The
    packed kernel called directly at every M, and the op (which picks by M)."""
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.runtime.table import get_kernel

    name, k = str(dtype).removeprefix("torch."), 40
    _, nr, vec = cpu_schedules.register_tile(GemmSpec(name, 64, k, "kn"), host_cpu())
    n = nr + vec  # one whole panel and one vector (AVX-512 float32: 80)
    spec = GemmSpec(name, n, k, "kn", bias=True, activation="relu")
    assert cpu_schedules.column_granule(spec, nr, vec) == vec
    x, w, b = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    want = reference(x, w, b, "relu")
    out = torch.full((m, n), float("nan"), dtype=dtype)
    get_kernel(spec)(x, w.t().contiguous(), b, out)
    assert_close(out, want, k)
    assert_close(tg.linear(x, w.t().contiguous().t(), b, "relu"), want, k)


@pytest.mark.parametrize("m", [4, 40], ids=["dot", "gemm"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_epilogue_accuracy_over_a_wide_range(act, m):
    """The epilogue alone (x @ I = x exactly) over [-20, 20], against torch in float64: the
    CPU's float32 erf / exp are polynomials (vectorizable), accurate to ~1e-7."""
    k = 64
    x = torch.linspace(-20, 20, m * k).reshape(m, k)
    out = tg.linear(x, torch.eye(k), None, act)
    expected = torch_activation(act)(x.double()).float()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=2e-6)


def test_activation_applied_once_to_the_final_sum():
    # relu(x @ w.T + b) with partial sums that go negative then positive: an activation
    # applied per reduction step (TVM's fuse_reduction_epilogue) would give a different answer.
    x = torch.tensor([[1.0, 1.0, 1.0]])
    w = torch.tensor([[-2.0, 3.0, 1.0], [3.0, -5.0, 1.0]])
    b = torch.tensor([-1.0, 0.5])
    assert torch.equal(tg.linear(x, w, b, "relu"), torch.tensor([[1.0, 0.0]]))


@pytest.mark.parametrize("shape", [(33,), (2, 3, 33), (2, 1, 3, 33)])
def test_linear_leading_dims(shape):
    x, w, b = randn(*shape), randn(17, 33), randn(17)
    out = tg.linear(x, w, b, "relu")
    assert out.shape == (*shape[:-1], 17)
    assert_close(out, reference(x, w, b, "relu"), 33)


@pytest.mark.parametrize("m", [1, 8, 16, 17, 300])
def test_linear_small_and_large_m(m):
    x, w, b = randn(m, 64), randn(72, 64), randn(72)  # B of 4608 elements: gemv at M <= 16
    assert_close(tg.linear(x, w, b, "gelu"), reference(x, w, b, "gelu"), 64)


@pytest.mark.parametrize("m", [1, 2, 7, 17, 33, 127, 513])
@pytest.mark.parametrize("k,n", [(50, 70), (96, 130), (77, 100)])
def test_linear_every_m_range(m, k, n):
    # Every variant (gemv at M=1, dot at 2..32 when the weight has >= 4096 elements, packed
    # gemm), K and N off the 16-wide vectors and the register tiles, M off the row tiles.
    x, w, b = randn(m, k), randn(n, k), randn(n)
    assert_close(tg.linear(x, w, b, "relu"), reference(x, w, b, "relu"), k)


def test_packed_task_order_rule():
    # (halves of the panels, rows of A per chunk): halves for two panels or more, and for an N
    # off the vectors only where the tiles are stored from registers (float32 / float64: the
    # store is then split at the whole panels, cpu_tile_store); long chunks up to K = 2048.
    def order(n, k, dtype="float32"):
        return cpu_schedules.task_order(gemm_spec(dtype, 2000, n, k, "nk"), 64, 16)

    assert order(768, 768) == (2, cpu_schedules.LONG_CHUNK_ROWS)
    assert order(320, 3000) == (2, cpu_schedules.M_CHUNK_ROWS)
    assert order(100, 768) == (2, cpu_schedules.LONG_CHUNK_ROWS)  # N % 16 != 0
    assert order(100, 768, "float16") == (1, cpu_schedules.SHORT_CHUNK_ROWS)
    assert order(48, 768) == (1, cpu_schedules.SHORT_CHUNK_ROWS)  # one panel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("m", [100, 130, 1100])
@pytest.mark.parametrize("n,layout", [(1000, "nk"), (70, "kn"), (333, "nk")])
def test_packed_n_off_the_vectors(n, layout, m, dtype):
    # N not a whole number of vectors (a 1000-class head, GPT-2's 50257), in halves of the
    # panels: each tile's store is split, a copy without the column bound for the panels
    # below N, over one chunk of rows and several; at M = 1100 float32 takes the halves of the
    # rows ("rows"), whose stores are split the same way. The kernel's output starts as NaN:
    # every value must be written.
    from torch_tvm_gemm.runtime.table import get_kernel

    k = 96
    spec = gemm_spec(str(dtype).split(".")[1], m, n, k, layout, bias=True, activation="relu")
    rows = m >= cpu_schedules.ROWS_MIN_M and dtype == torch.float32 and cpu_schedules.rows_max_k()
    assert spec.variant == ("rows" if rows else "gemm")
    if dtype == torch.float32 and host_cpu().vector_registers >= 32:
        assert cpu_tile_store.splits(cpu_schedules.schedule_gemm(spec))
    x, w, b = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    expected = reference(x, w, b, "relu")
    out = torch.full((m, n), float("nan"), dtype=dtype)
    get_kernel(spec)(x, w if layout == "nk" else w.t().contiguous(), b, out)
    assert_close(out, expected, k)
    weight = w if layout == "nk" else w.t().contiguous().t()  # (K, N) storage, as Conv1D
    assert_close(tg.linear(x, weight, b, "relu"), expected, k)


@pytest.mark.parametrize(
    "variant,dtype", [("gemm", torch.float32), ("gemm", torch.float64), ("rows", torch.float32)]
)
def test_packed_last_tile_runs_the_rows_left(variant, dtype):
    # The packed kernel's last tile of 6 rows runs only the rows left, as a tail of 2 or 4
    # rows where one covers them (cpu_tail_tile): M at every remainder of 6 and past a
    # whole tile, one chunk of rows or several; "rows" splits them in two halves first. The
    # output starts as NaN: every value must be written, and no more.
    from torch_tvm_gemm.runtime.table import get_kernel

    k, n = 96, 130
    name = str(dtype).split(".")[1]
    spec = gemm_spec(name, 100, n, k, "nk", bias=True, activation="relu")
    spec = dataclasses.replace(spec, variant=variant)
    tiles = 1 + len(cpu_tail_tile.tail_rows(6))  # (the 6-row tile: AVX-512 and AVX2 alike)
    assert cpu_schedules.schedule_gemm(spec).script().count('sblock("acc_update")') == tiles
    kernel = get_kernel(spec)
    w, b = randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 127, 128, 129, 130, 131, 1033, 1036]:
        x = randn(m, k, dtype=dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        kernel(x, w, b, out)
        assert_close(out, reference(x, w, b, "relu"), k)


def test_packed_a_copy_rule():
    # A copied into row tiles only for a static K, A_PACK_MIN_PANELS panels or more (a
    # vocabulary projection) and a weight of at least A_PACK_MIN_B_ELEMENTS.
    def packs(n, k):
        return cpu_schedules.packs_a(gemm_spec("float32", 2000, n, k, "nk"), 64)

    assert packs(50257, 768) and packs(32000, 512) and packs(16384, 4)
    assert not packs(768, 768) and not packs(11008, 4096)  # read in place
    assert not packs(16384, 2)  # a small weight
    dynamic_k = dataclasses.replace(gemm_spec("float32", 2000, 50257, 768, "kn"), k=None)
    assert not cpu_schedules.packs_a(dynamic_k, 64)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_packed_kernel_pack_prefetches(isa):
    # The float32 packed kernel's pack of B asks for the lines it reads next
    # (cpu_pack_prefetch): the transposing pack of a "nk" weight, the copy of a "kn" one;
    # with the AVX2 tile too (8 x 8 transposes, 16-wide panels), which must still build.
    import tvm

    from torch_tvm_gemm.target import CpuInfo

    features = {"avx2", "fma"} | ({"avx512f"} if isa == "avx512" else set())
    cpu = CpuInfo("x86_64", "", frozenset(features), 2 << 20)
    for layout, k in (("nk", 80), ("kn", 70)):
        mod = cpu_schedules.schedule_gemm(gemm_spec("float32", 300, 100, k, layout), cpu)
        assert mod.script().count("llvm.prefetch") == 1
        if layout == "kn":  # the copy's block sits in a vectorized loop
            lines = mod.script().splitlines()
            copy = next(i for i, line in enumerate(lines) if 'T.sblock("B_pad")' in line)
            assert "T.vectorized" in lines[copy - 1]
        if isa == "avx2":
            tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))
    # A "nk" K off whole tiles packs its last values apart from the whole tiles (no prefetch)
    mod = cpu_schedules.schedule_gemm(gemm_spec("float32", 300, 100, 70, "nk"), cpu)
    assert "partition" in mod.script() and "llvm.prefetch" not in mod.script()
    if isa == "avx2":
        tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))
    batched = gemm_spec("float32", 128, 128, 64, "nk", batched=True)
    assert cpu_schedules.schedule_gemm(batched, cpu).script().count("llvm.prefetch") == 1


def test_pack_transpose_rule():
    # The pack of a "nk" B transposes its tiles with cpu_transpose's shuffles only where every
    # tile is whole: float32, 16-wide vectors, K of whole tiles, N of whole 64-wide panels and
    # an even count of them for the two halves of the tasks.
    def applies(n, k, dtype="float32", vec=16, halves=2, static_k=True):
        spec = gemm_spec(dtype, 200, n, k, "nk", static_k=static_k)
        return cpu_schedules.transposes_in_registers(spec, 4 * vec, vec, halves)

    assert applies(768, 768) and applies(128, 64) and applies(192, 64, halves=1)
    assert not applies(320, 768)  # 5 panels: the second half has a missing panel
    assert not applies(330, 768) and not applies(768, 100)  # a clamped column, a part tile
    assert not applies(768, 768, "bfloat16") and not applies(768, 768, vec=8)
    assert not applies(768, 768, static_k=False)


@pytest.mark.parametrize("m", [33, 130])
@pytest.mark.parametrize("k,n", [(64, 128), (160, 256)])
def test_linear_with_the_pack_transposed_in_registers(m, k, n):
    spec = gemm_spec("float32", m, n, k, "nk", bias=True, activation="relu")
    assert spec.variant == "gemm"
    if host_cpu().vector_bytes == 64:
        mod = cpu_schedules.schedule_gemm(spec)
        assert mod.script().count("T.Shuffle") == 64  # the intrinsic: 4 rounds of 16
        assert mod.script().count("llvm.prefetch") == 1  # and the pack still prefetches
    x, w, b = randn(m, k), randn(n, k), randn(n)
    assert_close(tg.linear(x, w, b, "relu"), reference(x, w, b, "relu"), k)


@pytest.mark.parametrize("m", [600, 1100, 2100])
@pytest.mark.parametrize(
    "k,n",
    [(300, 320), (300, 330), (2100, 192), (5, 16400)],
    ids=["halves", "n-off-the-vectors", "516-row-chunks", "a-copied"],
)
def test_linear_packed_over_several_chunks(m, k, n):
    """The packed kernel past one chunk of A (uneven last chunks): in halves of the panels (an
    odd count: 5) and in the order (chunk, panel) (N = 330 is no whole number of vectors),
    A read in place or (257 panels) copied into row tiles first. (The op takes the halves of
    the rows, "rows", at most of these M: the "gemm" kernel is called directly as well.)"""
    from torch_tvm_gemm.runtime.table import get_kernel

    spec = gemm_spec("float32", m, n, k, "nk", bias=True, activation="relu")
    assert spec.variant in ("gemm", "rows")
    spec = dataclasses.replace(spec, variant="gemm")
    assert cpu_schedules.packs_a(spec, 64) == (n >= 64 * cpu_schedules.A_PACK_MIN_PANELS)
    x, w, b = randn(m, k), randn(n, k), randn(n)
    expected = reference(x, w, b, "relu")
    out = torch.full((m, n), float("nan"))
    get_kernel(spec)(x, w, b, out)
    assert_close(out, expected, k)
    assert_close(tg.linear(x, w, b, "relu"), expected, k)
    wt = randn(k, n)
    assert_close(tg.matmul(x, wt), x.double() @ wt.double(), k)


@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("k,n", [(333, 777), (48, 100)])
def test_linear_kn_weight_gemv(m, k, n):
    # A weight stored (in, out) (transformers' Conv1D) at M <= 16 takes the "kn" gemv: N
    # split into several tasks (777: three of 288 columns, the last one padded), K off its
    # 16-value unroll (333) or on it (48, a weight small enough for one thread).
    from torch_tvm_gemm.runtime import table

    x, w, b = randn(m, k), randn(k, n), randn(n)
    table.clear_table()
    out = tg.linear(x, w.t(), b, "gelu")
    assert [(s.variant, s.b_layout) for s in table._table] == [("gemv", "kn")]
    assert_close(out, reference(x, w.t(), b, "gelu"), k)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("k,n", [(333, 1024), (48, 1040)])
def test_linear_kn_weight_ksplit(m, k, n):
    # The same weight layout at M <= 4 with N >= 1024 takes "ksplit": K split among tasks of
    # whole rows (333: 11 tasks of 32 rows and one of 13, off the 16-row unroll; 48: three
    # tasks on one thread), partial sums added up, then bias and activation. M = 5: the gemv.
    from torch_tvm_gemm.runtime import table

    x, w, b = randn(m, k), randn(k, n), randn(n)
    table.clear_table()
    out = tg.linear(x, w.t(), b, "gelu")
    want = "ksplit" if m <= 4 else "gemv"
    assert [(s.variant, s.b_layout) for s in table._table] == [(want, "kn")]
    assert_close(out, reference(x, w.t(), b, "gelu"), k)
    assert_close(tg.linear(x, w.t()), x @ w, k)  # no bias, no activation: the sums alone


def test_ksplit_kernel_refuses_a_larger_m():
    # Its workspace holds KSPLIT_MAX_M rows of partial sums: called with more (never by the
    # ops, whose variant rule follows M), the kernel raises instead of writing past it.
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.runtime.table import get_kernel
    from torch_tvm_gemm.schedules.cpu_gemv import KSPLIT_MAX_M

    kernel = get_kernel(GemmSpec("float32", 1024, 48, "kn", variant="ksplit"))
    w = randn(48, 1024)
    x, out = randn(KSPLIT_MAX_M, 48), torch.empty(KSPLIT_MAX_M, 1024)
    kernel(x, w, out)
    assert_close(out, x @ w, 48)
    x, out = randn(KSPLIT_MAX_M + 1, 48), torch.empty(KSPLIT_MAX_M + 1, 1024)
    with pytest.raises(Exception, match="M > "):
        kernel(x, w, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [512, 77])
def test_linear_gemv_odd_n(dtype, k):
    # M = 1 with N off the gemv's 4-output groups, on a weight big enough for both threads
    # (as GPT-2's lm_head, N = 50257): the padded outputs are computed, never stored. The
    # prefetching kernel (cpu_gemv) in both dtypes (bf16: fp32 sums, rounded once), a K off
    # the vectors too (its last values in lane 0); a NaN stays in its output.
    from torch_tvm_gemm.runtime import table
    from torch_tvm_gemm.schedules import cpu_gemv

    x, w, b = randn(1, k, dtype=dtype), randn(301, k, dtype=dtype), randn(301, dtype=dtype)
    w[7, k - 1] = float("nan")
    table.clear_table()
    out = tg.linear(x, w, b, "relu")
    specs = list(table._table)
    assert [(s.variant, s.b_layout) for s in specs] == [("gemv", "nk")]
    assert cpu_gemv.applies(specs[0])
    assert torch.isnan(out[0, 7]) and torch.isnan(out).sum() == 1
    want = reference(x, w, b, "relu").to(dtype)
    torch.testing.assert_close(out, want, equal_nan=True, **tolerance(dtype, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_gemv_long_rows(dtype):
    # Rows of 2048 values: the prefetching kernel in bf16 (4 KB rows), the scheduled one in
    # float32 (8 KB rows, where the hardware prefetchers alone read faster); both correct.
    from torch_tvm_gemm.runtime import table
    from torch_tvm_gemm.schedules import cpu_gemv

    x, w, b = randn(1, 2048, dtype=dtype), randn(301, 2048, dtype=dtype), randn(301, dtype=dtype)
    table.clear_table()
    out = tg.linear(x, w, b, "relu")
    (spec,) = table._table
    assert (spec.variant, spec.b_layout) == ("gemv", "nk")
    assert cpu_gemv.applies(spec) == (dtype == torch.bfloat16)
    want = reference(x, w, b, "relu").to(dtype)
    torch.testing.assert_close(out, want, **tolerance(dtype, 2048))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("k", [80, 77])
def test_linear_two_rows(dtype, act, k):
    # M = 2 takes the 2-row dot kernel ("dot2"), on the C++ path as on the Python one, N off
    # the 10-row weight tile; a K off the 16-wide vectors too in float32 (its last values
    # summed apart), else the gemv (the packed kernel for bf16, see DOT_K_MULTIPLE); a NaN
    # stays in its row.
    from torch_tvm_gemm.runtime import table

    x, w, b = randn(2, k, dtype=dtype), randn(103, k, dtype=dtype), randn(103, dtype=dtype)
    x[1, 3] = float("nan")
    table.clear_table()
    out = tg.linear(x, w, b, act)
    tail = {torch.bfloat16: "gemm", torch.float32: "dot2"}.get(dtype, "gemv")
    assert [s.variant for s in table._table] == [
        "dot2" if k % cpu_schedules.DOT_K_MULTIPLE == 0 else tail
    ]
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    torch.testing.assert_close(
        out, reference(x, w, b, act).to(dtype), equal_nan=True, **tolerance(dtype, k)
    )
    assert gemm_variant(3, 100, 160, "nk") == "dot" and gemm_variant(1, 100, 77, "nk") == "gemv"
    assert gemm_variant(3, 100, 150, "nk") == "dot"  # (K's last 6 values apart)
    assert gemm_variant(3, 100, 151, "nk", dtype="bfloat16") == "gemm"  # (bf16: no tail apart)
    assert gemm_variant(2, 4096, 15, "nk") == "gemv" and gemm_variant(3, 4096, 15, "nk") == "gemm"


@pytest.mark.parametrize("act", ["gelu_tanh", "silu", "relu"])
@pytest.mark.parametrize("m", [2, 8, 17])
def test_dot_epilogue_in_vectors(m, act):
    # The dot kernels run a polynomial activation as a loop of its own over each row's
    # vectors (N = 103: 6 whole vectors and 7 values apart), a ReLU at each tile as before;
    # a NaN stays in its row.
    spec = gemm_spec("float32", m, 103, 800, "nk", bias=True, activation=act)
    assert spec.variant == ("dot2" if m == 2 else "dot")
    script = cpu_schedules.schedule_gemm(spec, host_cpu()).script()
    lines = script.splitlines()
    vectorized_out = any(
        "T.vectorized" in line and 'sblock("out' in after
        for line, after in zip(lines[:-1], lines[1:], strict=True)
    )
    assert vectorized_out == (act in cpu_schedules.VECTOR_EPILOGUES)
    x, w, b = randn(m, 800), randn(103, 800), randn(103)
    x[1, 5] = float("nan")
    out = tg.linear(x, w, b, act)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    want = torch_activation(act)(F.linear(x.double(), w.double(), b.double()))
    torch.testing.assert_close(out, want.float(), equal_nan=True, **tolerance(torch.float32, 800))


@pytest.mark.parametrize(
    "m,n,k,act", [(8, 1, 4096, "silu"), (2, 5, 1024, "gelu"), (17, 15, 2048, "gelu_tanh")]
)
def test_dot_epilogue_of_rows_shorter_than_a_vector(m, n, k, act):
    # A head of fewer outputs than a vector's lanes (16 on AVX-512; a value head: N = 1) with
    # a polynomial activation: no whole vector to split off the row (the build failed on it).
    # The dot kernel itself (whichever kernel this CPU's rule picks), then through the op.
    from torch_tvm_gemm.runtime.table import get_kernel

    spec = gemm_spec("float32", m, n, k, "nk", bias=True, activation=act)
    spec = dataclasses.replace(spec, variant="dot2" if m <= cpu_schedules.DOT2_MAX_M else "dot")
    x, w, b = randn(m, k), randn(n, k), randn(n)
    x[1, 5] = float("nan")
    want = torch_activation(act)(F.linear(x.double(), w.double(), b.double())).float()
    out = torch.empty(m, n)
    get_kernel(spec)(x, w, b, out)
    for got in (out, tg.linear(x, w, b, act)):
        assert torch.isnan(got[1]).all() and not torch.isnan(got[0]).any()
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance(torch.float32, k))


@pytest.mark.parametrize("n", [200, 768])
@pytest.mark.parametrize("m,k,variant", [(8, 48, "gemm"), (2, 48, "dot2"), (2, 33, "dot2"),
                                         (4, "least", "dot"), (4, "shorter", "gemm"),
                                         (8, "least", "dot"), (8, "shorter", "gemm"),
                                         (12, "least", "dot"), (12, "shorter", "gemm"),
                                         (20, "least", "dot"), (20, "shorter", "gemm"),
                                         (4, 193, "dot"), (8, 399, "dot")])  # fmt: skip
def test_dot_takes_rows_long_enough(n, m, k, variant):
    # float32 rows shorter than dot_min_k(M, N) take the packed kernel (a squeeze-and-excitation
    # conv's 48 -> 1152 at batch 8); "dot2" keeps M = 2.
    from torch_tvm_gemm.runtime import table

    least = cpu_schedules.dot_min_k(m, n)
    k = {"least": least, "shorter": least - 1}.get(k, k)
    x, w, b = randn(m, k), randn(n, k), randn(n)
    table.clear_table()
    out = tg.linear(x, w, b, "relu")
    assert [s.variant for s in table._table] == [variant]
    assert_close(out, reference(x, w, b, "relu"), k)


def test_dot_rows_least_length_by_cpu():
    """48 values a row on the AMD EPYC (measured there); on an Intel Xeon with AVX-512
    (measured there) 24 from M = 8 for weights of 512 rows or more, at least 256; 768 at most."""
    from torch_tvm_gemm.target import CpuInfo

    avx512 = frozenset({"avx512f", "avx2", "fma"})
    amd = CpuInfo("x86_64", "AMD EPYC 9B45", avx512, 1 << 20, 2)
    intel = CpuInfo("x86_64", "Intel(R) Xeon(R) Processor", avx512, 2 << 20, 2)
    intel_avx2 = CpuInfo("x86_64", "Intel(R) Core(TM) i7", frozenset({"avx2", "fma"}), 1 << 20, 2)
    least = cpu_schedules.dot_min_k
    ms = (3, 4, 7, 8, 12, 16, 20, 32)
    rule = [144, 192, 336, 384, 576, 768, 768, 768]
    assert [least(m, 4096, amd) for m in ms] == rule
    assert [least(m, 511, intel) for m in ms] == rule
    assert [least(m, 512, intel) for m in ms] == [144, 192, 336, 256, 288, 384, 480, 768]
    assert [least(m, 4096, intel_avx2) for m in ms] == rule


@pytest.mark.parametrize("m", [56, 61, 64])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_linear_swap_variant(monkeypatch, m, act):
    # M at or just under one 64-row panel takes the "swap" kernel (x packed, the weight
    # read in place); N off its 48-row tasks, K off the vectors; a NaN stays in its row.
    check_variant(monkeypatch, m, 100, act)


def check_variant(monkeypatch, m, n, act, k=77, variant="swap"):
    """linear(M x K by N x K) runs ``variant``'s own kernel (a swap variant's forced:
    TVM_GEMM_SWAP=1), is close to torch, keeps a NaN in its row."""
    from torch_tvm_gemm.runtime import table, variant_choice

    monkeypatch.setenv(variant_choice.ENV_SWAP, "1")
    x, w, b = randn(m, k), randn(n, k), randn(n)
    x[m - 1, 5] = float("nan")
    table.clear_table()
    out = tg.linear(x, w, b, act)
    assert [s.variant for s in table._table] == [variant]
    assert torch.isnan(out[m - 1]).all() and not torch.isnan(out[: m - 1]).any()
    want = reference(x, w, b, act).float()
    torch.testing.assert_close(out, want, equal_nan=True, **tolerance(torch.float32, k))


@pytest.mark.parametrize(
    ("m", "act", "variant"),
    [
        (24, "relu", "swap32"),
        (29, "gelu", "swap32"),
        (32, "none", "swap32"),
        (43, "gelu", "swap48"),
    ],
)
def test_linear_one_panel_swap_variants(monkeypatch, m, act, variant):
    # M within 8 rows of one panel of 32 or 48 rows: the swap kernel with that panel ("swap32":
    # 12 x 32 tiles, "swap48": 8 x 48); N off its 48-row tasks (and past swap48's least N), K
    # off the vectors; a NaN stays in its row.
    from torch_tvm_gemm.schedules import cpu

    check_variant(
        monkeypatch, m, max(100, cpu.ONE_PANEL_SWAPS[variant][2] + 5), act, variant=variant
    )


@pytest.mark.parametrize(("m", "act"), [(57, "gelu"), (64, "relu")])
def test_linear_swap_long_k(monkeypatch, m, act):
    # The longest K the swap kernel takes (its panel of x in half the L2) and one short of it,
    # off the vectors; N off the tiles; a NaN stays in its row.
    from torch_tvm_gemm.schedules import cpu

    check_variant(monkeypatch, m, 101, act, cpu.swap_max_k() - (m % 2) * 3)


def test_swap_variant_rule():
    assert [gemm_variant(m, 768, 768, "nk") for m in (49, 55, 56, 60, 64, 65, 120, 128)] == [
        "gemm",
        "gemm",
        "swap",
        "swap",
        "swap",
        "gemm",
        "gemm",
        "gemm",
    ]
    assert gemm_variant(64, 768, 768, "kn") == "gemm"  # a (K, N) B: no weight rows to read
    assert gemm_variant(64, 768, 768, "nk", dtype="float64") == "gemm"
    # bf16: the AMX tiles' own "dot" (tests/test_amx.py), else the packed kernel
    amx = host_cpu().amx_bf16
    assert gemm_variant(64, 768, 768, "nk", dtype="bfloat16") == ("dot" if amx else "gemm")
    assert gemm_variant(64, 768, 768, "nk", static_k=False) == "gemm"
    assert gemm_variant(64, 768, 11008, "nk") == "gemm"  # a panel of x past half the L2
    # Two panels of x ("swap2", a measured choice) only for vocabulary-wide N at M = 120-128.
    assert [
        gemm_variant(m, n, k, "nk") for m in (119, 120, 128, 129) for n, k in [(50257, 768)]
    ] == ["gemm", "swap2", "swap2", "gemm"]
    least_n = cpu_schedules.SWAP2_MIN_N
    assert gemm_variant(128, least_n, 768, "nk") == "swap2"
    assert gemm_variant(128, least_n - 1, 768, "nk") == "gemm"
    assert gemm_variant(128, least_n, cpu_schedules.swap_max_k() + 1, "nk") == "gemm"
    assert gemm_variant(128, least_n, 768, "kn") == "gemm"
    assert gemm_variant(128, least_n, 768, "nk", static_k=False) == "gemm"


SWAP_SHAPES = {  # variant -> (N, K) of a weight it takes: N off the tasks and panels, K off the vectors
    "swap32": (100, 77),
    "swap48": (cpu_schedules.ONE_PANEL_SWAPS["swap48"][2] + 5, 37),
    "swap": (100, 77),
    "swap2": (cpu_schedules.SWAP2_MIN_N + 5, 37),
}


@pytest.mark.parametrize("variant", list(SWAP_SHAPES))
@pytest.mark.parametrize("setting", ["0", "1", "auto"])
def test_linear_swap_serves_the_chosen_kernel(monkeypatch, variant, setting):
    # M near one or two panels of x: TVM_GEMM_SWAP forces the swap kernel ("1") or the packed
    # one ("0"), or ("auto") the faster of the two here serves the spec. The edges of the
    # window of M, a NaN stays in its row: the same answer whichever kernel runs.
    from torch_tvm_gemm.runtime import table, variant_choice

    monkeypatch.setenv(variant_choice.ENV_SWAP, setting)
    n, k = SWAP_SHAPES[variant]
    w, b = randn(n, k), randn(n)
    least_m, most_m = cpu_schedules.swap_rows(variant)
    table.clear_table()
    for m in (least_m, least_m + 1, most_m - 1, most_m):
        assert gemm_variant(m, n, k, "nk") == variant
        x = randn(m, k)
        x[m - 2, 3] = float("nan")
        out = tg.linear(x, w, b, "gelu")
        assert torch.isnan(out[m - 2]).all() and not torch.isnan(out[: m - 2]).any()
        want = reference(x, w, b, "gelu").float()
        torch.testing.assert_close(out, want, equal_nan=True, **tolerance(torch.float32, k))
    spec = next(spec for spec in table._table if spec.variant == variant)
    assert len(table._table) == (1 if setting == "1" else 2)  # (+ the packed kernel's spec)
    chosen = variant_choice.chosen_variant(spec)
    assert chosen == {"0": "gemm", "1": variant}.get(setting, chosen)
    assert chosen in ("gemm", variant)
    table.clear_table()
    assert variant_choice.chosen_variant(spec) is None  # forgotten with the table


@pytest.mark.parametrize(("variant", "untimed"), [("swap2", "gemm"), ("swap", "swap")])
def test_swap_weight_too_large_to_time(monkeypatch, variant, untimed):
    # Past MAX_MEASURED_BYTES nothing is timed: two panels of x keep the packed kernel, one
    # panel its own.
    from torch_tvm_gemm.runtime import table, variant_choice

    monkeypatch.setenv(variant_choice.ENV_SWAP, "auto")
    monkeypatch.setattr(variant_choice, "MAX_MEASURED_BYTES", 0)
    monkeypatch.setattr(variant_choice, "_time_pair", None)  # (would raise if called)
    n, k = SWAP_SHAPES[variant]
    x, w = randn(sum(cpu_schedules.swap_rows(variant)) // 2, k), randn(n, k)
    table.clear_table()
    torch.testing.assert_close(tg.linear(x, w), x @ w.T, **tolerance(torch.float32, k))
    spec = next(spec for spec in table._table if spec.variant == variant)
    assert variant_choice.chosen_variant(spec) == untimed
    table.clear_table()


def test_swap2_in_a_cache_only_process_takes_the_kernel_it_has(monkeypatch):
    # TVM_GEMM_NO_COMPILE=1 with only the packed kernel cached (a cache filled before this
    # variant existed): that kernel serves, unmeasured, instead of a missing-kernel error.
    from torch_tvm_gemm.runtime import table, variant_choice

    monkeypatch.setenv(variant_choice.ENV_SWAP, "auto")
    monkeypatch.setattr(variant_choice, "_time_pair", None)  # (would raise if called)
    n, k = cpu_schedules.SWAP2_MIN_N + 11, 23
    x, w = randn(126, k), randn(n, k)
    spec = gemm_spec("float32", 126, n, k, "nk")
    assert spec.variant == "swap2"
    cache.kernel_path(spec).unlink(missing_ok=True)
    table.get_kernel(dataclasses.replace(spec, variant="gemm"))  # built and cached
    monkeypatch.setenv("TVM_GEMM_NO_COMPILE", "1")
    table.clear_table()
    torch.testing.assert_close(tg.linear(x, w), x @ w.T, **tolerance(torch.float32, k))
    assert variant_choice.chosen_variant(spec) == "gemm"
    table.clear_table()


def test_swap_setting_is_checked(monkeypatch):
    from torch_tvm_gemm.runtime import table, variant_choice

    monkeypatch.setenv(variant_choice.ENV_SWAP, "yes")
    table.clear_table()
    with pytest.raises(ValueError, match="TVM_GEMM_SWAP must be"):
        tg.linear(randn(128, 16), randn(cpu_schedules.SWAP2_MIN_N, 16))
    table.clear_table()


def test_one_panel_swap_variant_rule():
    from torch_tvm_gemm.schedules import cpu

    ms = (23, 24, 32, 33, 39, 40, 48, 49)
    assert [gemm_variant(m, 768, 768, "nk") for m in ms] == [
        "dot",
        "swap32",
        "swap32",
        "gemm",
        "gemm",
        "swap48",
        "swap48",
        "gemm",
    ]
    max_k = cpu.one_panel_swap_max_k("swap32")
    assert max_k == 4 * cpu.swap_max_k() and cpu.one_panel_swap_max_k("swap48") < max_k
    assert gemm_variant(32, 768, max_k, "nk") == "swap32"
    assert gemm_variant(32, 768, max_k + cpu.DOT_K_MULTIPLE, "nk") == "dot"
    assert gemm_variant(48, 768, cpu.one_panel_swap_max_k("swap48") + 1, "nk") == "gemm"
    least_n = cpu.ONE_PANEL_SWAPS["swap48"][2]
    assert gemm_variant(48, least_n - 1, 768, "nk") == "gemm"  # too few tasks of 48 rows
    assert gemm_variant(32, least_n - 1, 768, "nk") == "swap32"
    assert gemm_variant(32, 768, 768, "nk", dtype="float64") == "dot"
    assert gemm_variant(32, 768, 768, "nk", static_k=False) == "gemm"  # (see DOT_K_MULTIPLE)
    assert gemm_variant(32, 768, 768, "kn") == "gemm"
    assert gemm_variant(32, 60, 60, "nk") == "gemm"  # a weight under 4096 elements


@pytest.mark.parametrize(
    ("m", "n", "k", "act"),
    [
        (512, 100, 77, "relu"),
        (517, 64, 768, "gelu"),
        (1031, 1000, 77, "none"),
        (2101, 33, 130, "relu"),
    ],
)
def test_linear_rows_variant(monkeypatch, m, n, k, act):
    # From ROWS_MIN_M rows each thread takes half of the rows of x: M is padded to two register
    # tiles, so an odd M leaves the second half a partial tile; N off the panels and the
    # vectors, K off the vectors; a NaN in the last row stays in its row.
    if not cpu_schedules.rows_max_k():
        pytest.skip("the rows variant needs 32 vector registers")
    check_variant(monkeypatch, m, n, act, k, variant="rows")


def test_linear_kn_weight_rows_variant():
    # A weight stored (K, N) (GPT-2's Conv1D, passed transposed) takes the row halves too.
    from torch_tvm_gemm.runtime import table

    if not cpu_schedules.rows_max_k():
        pytest.skip("the rows variant needs 32 vector registers")
    x, w_kn, b = randn(601, 90), randn(90, 130), randn(130)
    table.clear_table()
    out = tg.linear(x, w_kn.t(), b, "gelu")
    assert [(s.variant, s.b_layout) for s in table._table] == [("rows", "kn")]
    assert_close(out, reference(x, w_kn.t(), b, "gelu"), 90)


def test_rows_variant_rule():
    lo, max_k = cpu_schedules.ROWS_MIN_M, cpu_schedules.rows_max_k()
    if not max_k:
        pytest.skip("the rows variant needs 32 vector registers")
    ms = (lo - 1, lo, 1024, 25088)
    assert [gemm_variant(m, 768, 768, "nk") for m in ms] == ["gemm"] + ["rows"] * 3
    assert gemm_variant(1024, 768, 768, "kn") == "rows"
    assert gemm_variant(1024, 768, max_k, "nk") == "rows"
    assert gemm_variant(1024, 768, max_k + 1, "nk") == "gemm"  # (K chunks)
    assert gemm_variant(1024, cpu_schedules.ROWS_MAX_N, 768, "nk") == "rows"
    assert gemm_variant(1024, cpu_schedules.ROWS_MAX_N + 1, 768, "nk") == "gemm"  # (A copied)
    assert gemm_variant(1024, 768, 768, "nk", dtype="float64") == "gemm"
    assert gemm_variant(1024, 768, 768, "kn", static_k=False) == "rows"  # (a matmul: the call's K)
    assert gemm_variant(1024, 768, max_k + 1, "kn", static_k=False) == "gemm"
    assert gemm_variant(1024, 768, 768, "nk", device="cuda") == "gemm"


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_rows_variant_rule_for_panels_that_do_not_share_out():
    # Below ROWS_MIN_M the row halves serve a weight whose 64-wide panels do not share out
    # evenly between the threads, once M pays for each thread packing the whole weight (M >
    # 8 x (panels - 1) on two threads), past the rows of the dot and swap32 kernels.
    if not cpu_schedules.rows_max_k():
        pytest.skip("the rows variant needs 32 vector registers")
    panel, past_dot = cpu_schedules.ROWS_PANEL, cpu_schedules.DOT_MAX_M + 1

    def variant(m, n, k=256, layout="kn", threads=2):
        return gemm_variant(m, n, k, layout, threads=threads)

    assert variant(past_dot, 3 * panel, layout="nk") == "rows"  # 2 panels against 1
    assert variant(past_dot - 1, 3 * panel, layout="nk") == "swap32"
    assert variant(past_dot, 3 * panel - 10) == "rows"  # (a part panel counts whole)
    assert variant(100, panel) == "rows"  # one panel: one thread idle
    assert variant(60, panel, layout="nk") == "rows"  # (before the swap kernels)
    assert variant(100, 4 * panel) == "gemm"  # 2 panels each
    assert [variant(m, 9 * panel) for m in (64, 65)] == ["gemm", "rows"]
    assert [variant(m, 11 * panel) for m in (80, 81)] == ["gemm", "rows"]
    assert variant(100, panel, threads=1) == "gemm"
    assert variant(100, 3 * panel, threads=3) == "gemm"  # a panel each
    assert variant(100, 5 * panel, threads=4) == "rows"  # 2 panels against 1
    assert gemm_variant(100, panel, 256, "kn", dtype="float64", threads=2) == "gemm"
    assert gemm_variant(100, panel, 256, "kn", static_k=False, threads=2) == "rows"
    assert variant(100, 3 * panel, k=cpu_schedules.rows_max_k() + 1) == "gemm"


@pytest.mark.parametrize(
    ("m", "n", "k", "act", "layout"),
    [
        (33, 64, 256, "relu", "nk"),
        (41, 192, 77, "gelu", "kn"),
        (60, 130, 77, "none", "nk"),
        (127, 320, 130, "relu", "nk"),
        (197, 192, 768, "gelu", "kn"),
        (511, 576, 37, "none", "nk"),
    ],
)
def test_linear_rows_variant_below_rows_min_m(monkeypatch, two_threads, m, n, k, act, layout):
    # Odd M (halves of different lengths, partial register tiles), N off the panels and the
    # vectors, K off the vectors, either layout of the weight; a NaN stays in its row.
    if not cpu_schedules.rows_max_k():
        pytest.skip("the rows variant needs 32 vector registers")
    if layout == "nk":
        check_variant(monkeypatch, m, n, act, k, variant="rows")
        return
    from torch_tvm_gemm.runtime import table

    x, w_kn, b = randn(m, k), randn(k, n), randn(n)
    x[m - 1, 5] = float("nan")
    table.clear_table()
    out = tg.linear(x, w_kn.t(), b, act)
    assert [(s.variant, s.b_layout) for s in table._table] == [("rows", "kn")]
    assert torch.isnan(out[m - 1]).all() and not torch.isnan(out[: m - 1]).any()
    want = reference(x, w_kn.t(), b, act).float()
    torch.testing.assert_close(out, want, equal_nan=True, **tolerance(torch.float32, k))


def test_swap_needs_avx512():
    from torch_tvm_gemm.schedules import cpu
    from torch_tvm_gemm.target import CpuInfo

    avx2 = CpuInfo("x86_64", "", frozenset({"avx2", "fma"}))
    avx512 = CpuInfo("x86_64", "", frozenset({"avx2", "fma", "avx512f"}), 2 << 20)
    assert cpu.swap_max_k(avx2) == 0  # 6 x 64 accumulators would not fit 16 registers
    assert cpu.swap_max_k(avx512) == 4096
    # (K = 4096 is a 1 MB panel, half of the 2 MB L2: K chunks then, not one pass)
    assert cpu.rows_max_k(avx2) == 0 and cpu.rows_max_k(avx512) == 4095


@pytest.mark.parametrize("m,n", [(1, 1), (20, 2), (300, 70), (32, 4096), (60, 5000)])
def test_products_with_k_one(m, n):
    # K = 1 (an outer product): the packed kernel's pack then has no K loop (it failed to
    # build); the swap variants (M = 32, 60 with 4096+ rows) and batched kernels as well.
    x, w, b = randn(m, 1), randn(n, 1), randn(n)
    assert_close(tg.linear(x, w, b, "relu"), reference(x, w, b, "relu"), 1)
    assert_close(tg.matmul(x, w.t().contiguous()), x.double() @ w.t().double(), 1)
    xb, wb = randn(2, m, 1), randn(2, n, 1)
    assert_close(tg.matmul(xb, wb.transpose(1, 2)), xb.double() @ wb.transpose(1, 2).double(), 1)


def test_linear_non_contiguous():
    x = randn(9, 80)[:, ::2]
    w = randn(40, 19).t()  # (19, 40), not contiguous
    b = randn(38)[::2]
    assert_close(tg.linear(x, w, b), reference(x, w, b, "none"), 40)


@pytest.mark.parametrize("m,k,n", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
@pytest.mark.parametrize("act", ["none", "relu"])
def test_linear_empty(m, k, n, act):
    x, w, b = randn(m, k), randn(n, k), randn(n)
    torch.testing.assert_close(tg.linear(x, w, b, act), REF_ACT[act](F.linear(x, w, b)))


@pytest.mark.parametrize(
    "args,exc,words",
    [
        ((torch.ones(3, 4), torch.ones(5, 4), None, "tanh"), ValueError, ["'activation'", "tanh"]),
        ((torch.ones(3, 4), torch.ones(5, 3)), ValueError, ["features", "(5, 3)"]),
        ((torch.ones(3, 4), torch.ones(5, 4), torch.ones(4)), ValueError, ["'bias'", "(5,)"]),
        ((torch.ones(3, 4), torch.ones(5, 4), torch.ones(1, 5)), ValueError, ["'bias'", "2-D"]),
        ((torch.ones(3, 4), torch.ones(2, 5, 4)), ValueError, ["'weight'", "3-D"]),
        ((torch.ones(3, 4), torch.ones(5, 4).half()), TypeError, ["'weight'", "mixed"]),
        ((torch.ones(3, 4), torch.ones(5, 4), torch.ones(5).double()), TypeError, ["'bias'"]),
        (
            (torch.ones(3, 4, dtype=torch.int64), torch.ones(5, 4, dtype=torch.int64)),
            TypeError,
            ["'x'", "int64"],
        ),
        ((torch.ones(3, 4, device="meta"), torch.ones(5, 4)), RuntimeError, ["'weight'", "device"]),
    ],
)
def test_linear_bad_input(args, exc, words):
    with pytest.raises(exc) as info:
        tg.linear(*args)
    msg = str(info.value)
    assert "tvm_gemm.linear" in msg
    for w in words:
        assert w in msg, msg
