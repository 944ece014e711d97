"""tvm_gemm.matmul against torch.matmul: dtypes, odd shapes, batching, layouts, empty dims."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DTYPES, assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm.runtime import table

# (M, K, N); (5, 70, 65) takes the gemv variant (M <= 16 and a B of >= 4096 elements).
SHAPES_2D = [
    (1, 1, 1),
    (7, 33, 1),
    (5, 70, 65),
    (33, 127, 257),
    (127, 7, 64),
    (257, 64, 33),
    (16, 16, 16),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n", SHAPES_2D)
def test_matmul_2d(m, k, n, dtype):
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)
    out = tg.matmul(a, b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, a.double() @ b.double(), k)


def test_gemv_tasks_come_in_even_counts():
    """The "kn" gemv's spans divide N's whole vectors into 1, an even count or many tasks
    (two threads take equal shares) where that costs at most half the span: 60 vectors in 4
    tasks of 15, not 3 of 20; 25 in 5 tasks of 5, not 25 of 1."""
    from torch_tvm_gemm.schedules import cpu

    assert cpu.gemv_kn_span(960, 16) == 240
    assert cpu.gemv_kn_span(768, 16) == 384 and cpu.gemv_kn_span(1024, 16) == 256  # 2 / 4 tasks
    assert cpu.gemv_kn_span(1000, 16) == 32  # 31 tasks: many
    assert cpu.gemv_kn_span(240, 16) == 240  # one task
    assert cpu.gemv_kn_span(400, 16) == 80


@pytest.mark.parametrize("n", [7, 100, 1001])
def test_gemv_of_a_b_off_the_vectors(n):
    """The "kn" gemv at an N off the 16-wide vectors: whole tasks of whole vectors, then one
    task for the last columns (read clamped), each its own copy of the loop (the first copy
    without the clamp); every M of the gemv, a NaN in B's last column stays in it."""
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.schedules import cpu

    spec = GemmSpec("float32", n, None, "kn", variant="gemv")
    span = cpu.gemv_kn_span(n, 16)
    assert span % 16 == 0 and (n // 16) % (span // 16) == 0  # (whole tasks of whole vectors)
    copies = 2 if n > span else 1  # (N under one vector: a single task)
    assert cpu.schedule_gemm(spec).script().count('T.sblock("acc_update")') == copies
    b = randn(640, n)
    b[5, n - 1] = float("nan")
    for m in range(1, cpu.GEMV_MAX_M + 1):
        assert cpu.gemm_variant(m, n, 640, static_k=False) == "gemv"
        a = randn(m, 640)
        out = tg.matmul(a, b)
        assert torch.isnan(out[:, n - 1]).all() and not torch.isnan(out[:, : n - 1]).any()
        assert_close(out[:, : n - 1], a @ b[:, : n - 1], 640)


@pytest.mark.parametrize("m", [1, 2, 16, 17, 100])
def test_one_kernel_serves_every_m(m):
    # M crosses the gemv/gemm threshold (B is big enough for gemv); each variant is
    # compiled once and reused.
    b = randn(130, 40)
    a = randn(m, 130)
    assert_close(tg.matmul(a, b), a @ b, 130)


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(513, 65, 70), (601, 1, 4100), (1024, 300, 130), (100, 256, 64), (41, 77, 192)],
)
def test_matmul_rows_variant(m, k, n):
    """A matmul of two activations (K symbolic: one kernel for every K) takes the row halves
    by the call's K as a Linear does: from ROWS_MIN_M rows, or below where N's panels do not
    share out between the threads (N = 64: one panel; 192: three). Odd M (halves of
    different lengths), N off the panels and the vectors, K off the vectors and K = 1 (B of
    at least GEMV_MIN_B_ELEMENTS: a wide one); a NaN
    in A's last row stays in its row. The same kernel then serves another K."""
    from torch_tvm_gemm.ops.gemm_ops import gemm_spec
    from torch_tvm_gemm.schedules import cpu

    if not cpu.rows_max_k():
        pytest.skip("the rows variant needs 32 vector registers")
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spec = gemm_spec("float32", m, n, k, "kn", static_k=False)
        assert (spec.variant, spec.k) == ("rows", None)
        for kk in (k, k + 5):
            a, b = randn(m, kk), randn(kk, n)
            a[m - 1, 0] = float("nan")
            table.clear_table()
            out = tg.matmul(a, b)
            assert [(s.variant, s.k) for s in table._table] == [("rows", None)]
            assert torch.isnan(out[m - 1]).all() and not torch.isnan(out[: m - 1]).any()
            assert_close(out[: m - 1], a[: m - 1].double() @ b.double(), kk)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    "shape_a,shape_b",
    [
        ((3, 7, 33), (3, 33, 5)),  # batched
        ((3, 7, 33), (33, 5)),  # 3-D @ 2-D: one GEMM over all rows
        ((1, 7, 33), (4, 33, 5)),  # batch broadcast of a
        ((4, 7, 33), (1, 33, 5)),  # batch broadcast of b
        ((7, 33), (2, 33, 5)),  # 2-D @ 3-D
    ],
)
def test_matmul_batched(shape_a, shape_b):
    a, b = randn(*shape_a), randn(*shape_b)
    assert_close(tg.matmul(a, b), torch.matmul(a, b), 33)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 33, 5), (17, 64, 70), (33, 7, 130), (9, 40, 80)])
def test_batched_matmul_is_one_kernel(m, k, n, dtype):
    # A batch of products is one batched kernel (the batch a parallel axis), for B given
    # as (batch, K, N) and as a batch of transposed matrices (attention's K^T), read in place.
    a = randn(5, m, k, dtype=dtype)
    b = randn(5, k, n, dtype=dtype)
    bt = randn(5, n, k, dtype=dtype).transpose(1, 2)
    table.clear_table()
    for rhs in (b, bt):
        assert_close(tg.matmul(a, rhs), torch.matmul(a.double(), rhs.double()), k)
    specs = list(table._table)
    assert len(specs) == 2 and all(s.batched for s in specs)
    # K^T's head dim is part of the "nk" kernel; "kn" (P @ V, K the sequence) keeps it symbolic.
    assert {s.b_layout: s.k for s in specs} == {"kn": None, "nk": k}


@pytest.mark.parametrize("s", [128, 67, 197])
def test_attention_scores_batched(s):
    # Q @ K^T at attention's shapes: S = 128 packs K^T by cpu_transpose's whole 16 x 16 tiles
    # (two 64-wide panels); S = 67 and 197 (ViT) by LLVM's transpose (a clamped last panel),
    # their tile stores split at the whole panels (cpu_tile_store). Odd batch and M, K^T read
    # in place; the kernel's output starts as NaN: every value must be written.
    from torch_tvm_gemm.ops.gemm_ops import gemm_spec
    from torch_tvm_gemm.runtime.table import get_kernel
    from torch_tvm_gemm.schedules import cpu as cpu_schedules
    from torch_tvm_gemm.schedules import cpu_tile_store

    q, key = randn(7, s, 64), randn(7, s, 64)
    kt = key.transpose(1, 2)
    expected = torch.matmul(q.double(), kt.double())
    assert_close(tg.matmul(q, kt), expected, 64)
    assert_close(tg.matmul(q[:, :37], kt), torch.matmul(q[:, :37].double(), kt.double()), 64)
    spec = gemm_spec("float32", s, s, 64, "nk", batched=True)
    out = torch.full((7, s, s), float("nan"))
    get_kernel(spec)(q, key, out)
    assert_close(out, expected, 64)
    if s % 16:
        assert cpu_tile_store.splits(cpu_schedules.schedule_gemm(spec))


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_batched_last_tile_runs_the_rows_left(layout):
    # Each batch entry's last tile of 6 rows runs only the rows left, as a tail of 2 or 4
    # (cpu_tail_tile): S at every remainder of 6, Q @ K^T ("nk") and P @ V ("kn", one panel
    # wide: read in place). The output starts as NaN: every value must be written.
    from torch_tvm_gemm.ops.gemm_ops import gemm_spec
    from torch_tvm_gemm.runtime.table import get_kernel
    from torch_tvm_gemm.schedules import cpu as cpu_schedules

    d = 64
    spec = gemm_spec("float32", 128, 128 if layout == "nk" else d, d, layout, batched=True)
    if layout == "kn":
        spec = dataclasses.replace(spec, k=None)  # (P @ V: K, the sequence, symbolic)
    assert cpu_schedules.schedule_gemm(spec).script().count('sblock("acc_update")') == 3
    kernel = get_kernel(spec)
    for m in [1, 2, 3, 4, 5, 6, 7, 11, 127, 128, 130]:
        a = randn(3, m, d)
        b = randn(3, spec.n, d) if layout == "nk" else randn(3, d, spec.n)
        out = torch.full((3, m, spec.n), float("nan"))
        kernel(a, b, out)
        b_kn = b.transpose(1, 2) if layout == "nk" else b
        assert_close(out, torch.matmul(a.double(), b_kn.double()), d)


@pytest.mark.parametrize(
    "dtype,n",
    [(torch.float32, 64), (torch.float64, 32), (torch.bfloat16, 64)]
    + [(torch.float32, 32), (torch.float32, 80), (torch.float64, 40)],  # (batched_tile)
    ids=str,
)
def test_batched_matmul_one_panel_wide(dtype, n):
    # P @ V with V exactly one register panel wide (the register tile's, or a panel of N
    # columns for a V of a few vectors: 80 = 5 x 16, rows 4): read in place (fp32/fp64),
    # packed (narrow dtypes, converted once); M off the row tile, K off the vectors.
    p, v = randn(3, 37, 45, dtype=dtype), randn(3, 45, n, dtype=dtype)
    assert_close(tg.matmul(p, v), torch.matmul(p.double(), v.double()), 45)


def test_batched_tile_one_panel_for_a_few_vectors():
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.schedules.cpu import batched_tile, register_tile
    from torch_tvm_gemm.target import host_cpu

    cpu = host_cpu()
    if cpu.vector_registers < 32:
        pytest.skip("the register tile's panels on this CPU")

    def tile(n, layout="kn"):
        return batched_tile(GemmSpec("float32", n, None, layout, batched=True), cpu)

    mr, nr, vec = register_tile(GemmSpec("float32", 64, None, "kn", batched=True), cpu)
    assert tile(80) == (24 // 5, 80, vec) and tile(2 * vec) == (12, 2 * vec, vec)
    assert tile(nr) == tile(2 * nr) == (mr, nr, vec)  # whole panels
    assert tile(80, "nk") == tile(100) == (mr, nr, vec)  # "nk"; N off the vectors
    assert tile(7 * vec) == (mr, nr, vec)  # past ONE_PANEL_MAX_VECTORS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 2, 7, 33])
@pytest.mark.parametrize("k", [130, 128])
def test_matmul_by_a_transposed_weight(m, k, dtype):
    # b = w.T of a contiguous w is read in place as "nk" with a static K, as a Linear: the
    # gemv at M = 1, the dot variants for 2 <= M <= 32 where K is whole vectors (else the
    # gemv or the packed kernel), the packed kernel above (B of >= 4096 elements).
    a, w = randn(m, k, dtype=dtype), randn(40, k, dtype=dtype)
    assert_close(tg.matmul(a, w.t()), a.double() @ w.t().double(), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batched_matmul_broadcast_and_non_contiguous_batch(dtype):
    a = randn(1, 9, 40, dtype=dtype).expand(6, 9, 40)  # broadcast batch (stride 0)
    b = randn(12, 40, 20, dtype=dtype)[::2]  # every other batch entry: not contiguous
    assert_close(tg.matmul(a, b), torch.matmul(a.double(), b.double()), 40)
    p = randn(20, 6, 40, dtype=dtype).permute(1, 0, 2)  # batch not outermost in memory
    assert_close(tg.matmul(p, b), torch.matmul(p.double(), b.double()), 40)
    two_d = randn(9, 40, dtype=dtype)
    assert_close(tg.matmul(two_d, b), torch.matmul(two_d.double(), b.double()), 40)
    assert tg.matmul(randn(0, 9, 40), randn(0, 40, 20)).shape == (0, 9, 20)
    assert torch.equal(tg.matmul(randn(3, 9, 0), randn(3, 0, 20)), torch.zeros(3, 9, 20))


def test_matmul_non_contiguous_inputs():
    a = randn(40, 66)[:, ::2]  # sliced
    b = randn(20, 33).t()  # transposed: read in place as the "nk" layout
    assert not a.is_contiguous() and not b.is_contiguous()
    assert_close(tg.matmul(a, b), a @ b, 33)
    e = randn(1, 33).expand(9, 33)  # expanded (stride 0)
    assert_close(tg.matmul(e, b), e @ b, 33)
    c = randn(33, 17).to(memory_format=torch.contiguous_format)[:, 1:]
    assert_close(tg.matmul(a, c), a @ c, 33)


@pytest.mark.parametrize("m,k,n", [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)])
def test_matmul_empty(m, k, n):
    a, b = randn(m, k), randn(k, n)
    out = tg.matmul(a, b)
    torch.testing.assert_close(out, a @ b)


@pytest.mark.parametrize(
    "a,b,exc,words",
    [
        (
            torch.ones(3, 4, dtype=torch.int32),
            torch.ones(4, 2, dtype=torch.int32),
            TypeError,
            ["'a'", "int32"],
        ),
        (torch.ones(3, 4, dtype=torch.bool), torch.ones(4, 2), TypeError, ["'a'", "bool"]),
        (
            torch.ones(3, 4, dtype=torch.complex64),
            torch.ones(4, 2),
            TypeError,
            ["'a'", "complex64"],
        ),
        (torch.ones(3, 4), torch.ones(4, 2, dtype=torch.float64), TypeError, ["'b'", "mixed"]),
        (torch.ones(3, 4), torch.ones(5, 2), ValueError, ["inner dims", "(3, 4)", "(5, 2)"]),
        (torch.ones(2, 3, 4), torch.ones(3, 4, 2), ValueError, ["batch", "broadcast"]),
        (torch.ones(3, 4), torch.ones(4, 2, device="meta"), RuntimeError, ["'b'", "meta"]),
        # the ranks torch.matmul takes too (test_matmul_ranks.py): what it also refuses
        (torch.ones(()), torch.ones(3), ValueError, ["'a'", "0-D"]),
        (torch.ones(3, 4), torch.ones(()), ValueError, ["'b'", "0-D"]),
        (torch.ones(2, 3, 4), torch.ones(5), ValueError, ["inner dims", "(2, 3, 4)", "(5,)"]),
        (torch.ones(2, 2, 3, 4), torch.ones(3, 4, 2), ValueError, ["batch", "(2, 2, 3, 4)"]),
    ],
)
def test_matmul_bad_input(a, b, exc, words):
    with pytest.raises(exc) as info:
        tg.matmul(a, b)
    msg = str(info.value)
    assert "tvm_gemm.matmul" in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("m,k,n", [(7, 33, 5), (20, 33, 5), (7, 130, 40), (20, 130, 40)])
def test_views_that_start_off_the_alignment(m, k, n):
    # Batch slices and storage offsets start at any byte: the kernels assume 64-byte
    # aligned buffers (a misaligned B once crashed the packed kernel), so these are copied.
    a = randn(3 * m * k + 1)[1:].view(3, m, k)
    b = randn(3 * k * n + 1)[1:].view(3, k, n)
    assert a[1].data_ptr() % 64 and b[1].data_ptr() % 64
    assert_close(tg.matmul(a, b), torch.matmul(a, b), k)
    assert_close(tg.matmul(a[1], b[2]), a[1] @ b[2], k)
    w, bias = randn(n * k + 1)[1:].view(n, k), randn(n + 1)[1:]
    assert_close(tg.linear(a[1], w, bias, "relu"), torch.relu(a[1] @ w.t() + bias), k)
