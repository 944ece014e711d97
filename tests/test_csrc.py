"""The C++ impls (csrc/) against the Python ones: same results, same errors, threads, leaks.

Every behavioural test runs on both paths (the ``impl`` fixture switches with
``ops.use_impl``); the C++ ones are skipped when the extension is not built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn, run_on

from torch_tvm_gemm import _ext, ops
from torch_tvm_gemm.runtime import table

EXT = _ext.load()
needs_ext = pytest.mark.skipif(EXT is None, reason=f"C++ extension not built ({_ext.load_error})")
PATHS = [pytest.param("cpp", marks=needs_ext), "python"]

mm = torch.ops.tvm_gemm.matmul
lin = torch.ops.tvm_gemm.linear


@pytest.fixture(params=PATHS)
def impl(request):
    previous = ops.use_impl(request.param)
    yield request.param
    ops.use_impl(previous)


# --- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((7, 130), (130, 40)),  # gemv variant (M <= 16, B of >= 4096 elements)
        ((7, 33), (33, 5)),  # small B: the packed variant even at M <= 16
        ((127, 33), (33, 17)),  # gemm variant
        ((3, 7, 33), (33, 5)),  # 3-D a, shared b: one GEMM over all rows
        ((3, 7, 33), (3, 33, 5)),  # batched
        ((1, 7, 33), (3, 33, 5)),  # a's batch broadcast
        ((7, 33), (3, 33, 5)),  # 2-D a against a batch
        ((3, 7, 33), (1, 33, 5)),  # b's batch broadcast
        ((0, 33), (33, 5)),  # M = 0
        ((7, 33), (33, 0)),  # N = 0
        ((7, 0), (0, 5)),  # K = 0: zeros
        ((0, 7, 33), (0, 33, 5)),  # empty batch
        ((2, 7, 0), (0, 5)),  # K = 0 with a 3-D a
        ((2, 7, 0), (2, 0, 5)),  # K = 0, batched
    ],
)
def test_matmul_shapes(impl, a_shape, b_shape):
    a, b = randn(*a_shape), randn(*b_shape)
    out = mm(a, b)
    assert out.shape == torch.matmul(a, b).shape
    assert_close(out, torch.matmul(a, b), k=a_shape[-1])


def test_matmul_layouts(impl):
    a, w = randn(20, 40), randn(24, 40)
    assert_close(mm(a, w.t()), a @ w.t(), k=40)  # transposed contiguous b: read as "nk"
    a_nc = randn(40, 20).t()  # non-contiguous a
    b_nc = randn(24, 80)[:, ::2].t()  # neither contiguous nor transposed-contiguous
    assert_close(mm(a_nc, b_nc), a_nc @ b_nc, k=40)
    a_off, b9 = a[2:, 3:], randn(37, 9)  # a storage offset
    assert_close(mm(a_off, b9), a_off @ b9, k=37)
    out3 = mm(randn(4, 5, 40)[:, 1:], randn(4, 40, 6))  # non-contiguous batch entries
    assert out3.shape == (4, 4, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(70, 33), (1100, 600), (2, 40)], ids=str)
def test_transposed_a_copied_to_rows(impl, dtype, shape):
    """A transposed a (a backward's dZ.t()) is copied to rows (C++: by blocks, on torch's
    threads, into the pool past 2 MB): sizes off the blocks, every element size, and the
    same bits as a contiguous a."""
    rows, cols = shape
    a = randn(cols, rows, dtype=dtype).t()  # (rows, cols), the transpose of a contiguous matrix
    b = randn(cols, 9, dtype=dtype)
    out = mm(a, b)
    assert torch.equal(out, mm(a.contiguous(), b))
    assert_close(out, a.double() @ b.double(), k=cols)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_matmul_dtypes(impl, dtype):
    a, b = randn(9, 33, dtype=dtype), randn(33, 7, dtype=dtype)
    out = mm(a, b)
    assert out.dtype == dtype
    assert_close(out, a.double() @ b.double(), k=33)


@pytest.mark.parametrize("x_shape", [(33,), (5, 33), (2, 3, 33), (0, 33)])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_linear(impl, x_shape, activation):
    x, w, b = randn(*x_shape), randn(17, 33), randn(17)
    act = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}[activation]
    assert_close(lin(x, w, b, activation), act(F.linear(x, w, b)), k=33)


def test_linear_no_bias_and_empty_k(impl):
    x, w = randn(5, 33), randn(17, 33)
    assert_close(lin(x, w), F.linear(x, w), k=33)
    x0, w0, b0 = randn(5, 0), randn(17, 0), randn(17)
    assert_close(lin(x0, w0, b0, "relu"), F.relu(F.linear(x0, w0, b0)))
    assert_close(lin(x0, w0), torch.zeros(5, 17))
    x3 = randn(2, 3, 0)
    assert_close(lin(x3, w0, b0, "gelu"), F.gelu(F.linear(x3, w0, b0)))


def test_both_paths_agree_bitwise():
    """Same kernels, same arguments: the two paths must give identical bits."""
    if EXT is None:
        pytest.skip("C++ extension not built")
    a, b = randn(33, 65), randn(65, 19)
    x, w, bias = randn(3, 65), randn(19, 65), randn(19)
    got = {
        path: run_on(path, lambda: (mm(a, b), lin(x, w, bias, "gelu")))
        for path in ("cpp", "python")
    }
    for c, p in zip(got["cpp"], got["python"], strict=True):
        assert torch.equal(c, p)


def test_autograd(impl):
    a, b = randn(6, 9).requires_grad_(), randn(9, 4).requires_grad_()
    x, w, bias = (
        randn(3, 9).requires_grad_(),
        randn(5, 9).requires_grad_(),
        randn(5).requires_grad_(),
    )
    (mm(a, b).sum() + lin(x, w, bias, "relu").square().sum()).backward()
    a2, b2, x2, w2, bias2 = (t.detach().clone().requires_grad_() for t in (a, b, x, w, bias))
    ((a2 @ b2).sum() + F.relu(F.linear(x2, w2, bias2)).square().sum()).backward()
    for t, ref in [(a, a2), (b, b2), (x, x2), (w, w2), (bias, bias2)]:
        assert_close(t.grad, ref.grad, k=9)
    with torch.no_grad():  # the no-grad fast path: no graph
        assert mm(a, b).grad_fn is None


@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_opcheck(impl, op):
    if op == "matmul":
        args = (randn(5, 7).requires_grad_(), randn(7, 3).requires_grad_())
    else:
        args = (randn(2, 7).requires_grad_(), randn(3, 7).requires_grad_(), randn(3), "gelu")
    torch.library.opcheck(getattr(torch.ops.tvm_gemm, op).default, args)


# --- errors: the same on both paths ----------------------------------------------------------

f32 = torch.float32
BAD_CALLS = {
    "int dtype": lambda: mm(
        torch.ones(2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64)
    ),
    "complex b": lambda: mm(randn(2, 2), torch.ones(2, 2, dtype=torch.complex64)),
    "1-D a": lambda: mm(randn(3), randn(3, 2)),
    "None a": lambda: mm(None, randn(3, 2)),
    "4-D b": lambda: mm(randn(2, 3), randn(1, 1, 3, 2)),
    "mixed dtypes": lambda: mm(randn(2, 3), randn(3, 2, dtype=torch.float64)),
    "inner dims": lambda: mm(randn(2, 3), randn(4, 2)),
    "batch dims": lambda: mm(randn(2, 2, 3), randn(3, 3, 2)),
    "activation": lambda: lin(randn(2, 3), randn(4, 3), None, "tanh"),
    "activation quote": lambda: lin(randn(2, 3), randn(4, 3), None, "it's\n"),
    # (the C++ GEMM table knows the conv's epilogues too; the linear op takes only its own)
    "conv epilogue": lambda: lin(randn(2, 3), randn(4, 3), None, "sigmoid"),
    "0-D x": lambda: lin(torch.tensor(1.0), randn(4, 3)),
    "9-D x": lambda: lin(randn(*[1] * 8, 3), randn(4, 3)),
    "1-D weight": lambda: lin(randn(2, 3), randn(3)),
    "None weight": lambda: lin(randn(2, 3), None),
    "features": lambda: lin(randn(2, 3), randn(4, 5)),
    "bias rank": lambda: lin(randn(2, 3), randn(4, 3), randn(1, 4)),
    "bias size": lambda: lin(randn(2, 3), randn(4, 3), randn(5)),
    "bias dtype": lambda: lin(randn(2, 3), randn(4, 3), randn(4, dtype=torch.float64)),
    "weight dtype": lambda: lin(randn(2, 3, dtype=torch.float16), randn(4, 3)),
}


def _outcome(path: str, call):
    """("ok", result) or ("error", type, message) of ``call`` on one path."""

    def run():
        try:
            return ("ok", call())
        except Exception as err:  # noqa: BLE001 (compared between the paths)
            return ("error", type(err), str(err))

    return run_on(path, run)


@needs_ext
def test_random_calls_agree():
    """Random ranks, sizes (incl. 0), dtypes and epilogues: both paths succeed with the same
    bits or fail with the same error. Sizes are drawn from a few values so that only a handful
    of kernels get built."""
    g = torch.Generator().manual_seed(1234)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    def tensor(rank: int, last: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        dims = [pick([0, 1, 3]) for _ in range(rank - len(last))] + list(
            last[-rank:] if rank else []
        )
        if pick(range(10)) == 0:  # now and then one tensor of another dtype
            dtype = pick([torch.float64, torch.int64, torch.complex64])
        if dtype == torch.int64:
            return torch.ones(dims, dtype=dtype)
        return torch.randn(dims, generator=g).to(dtype)

    for i in range(300):
        k, n = pick([3] * 7 + [2]), pick([3, 3, 3, 0])
        dtype = pick([torch.float32] * 8 + [torch.float64, torch.int64])
        if i % 2 == 0:
            a = tensor(pick([1, 2, 2, 2, 3, 3, 4]), (pick([1, 3]), k), dtype)
            b = tensor(pick([1, 2, 2, 2, 3, 3]), (3, n), dtype)
            call = lambda a=a, b=b: mm(a, b)  # noqa: E731
        else:
            x = tensor(pick([0, 1, 2, 2, 2, 3]), (k,), dtype)
            w = tensor(pick([2, 2, 2, 1]), (n, 3), dtype)
            bias = pick(
                [None, tensor(1, (n,), dtype), tensor(1, (n,), dtype), tensor(1, (2,), dtype)]
            )
            act = pick(["none", "relu", "gelu"] * 3 + ["sigmoid"])
            call = lambda x=x, w=w, bias=bias, act=act: lin(x, w, bias, act)  # noqa: E731
        cpp, py = _outcome("cpp", call), _outcome("python", call)
        assert cpp[0] == py[0], (i, cpp, py)
        if cpp[0] == "ok":
            assert torch.equal(cpp[1], py[1]), i
        else:
            assert cpp[1:] == py[1:], i


def _error_of(path: str, call) -> tuple[type, str]:
    def run():
        with pytest.raises(Exception) as info:
            call()
        return info.type, str(info.value)

    return run_on(path, run)


@needs_ext
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_same_errors(name):
    py_err = _error_of("python", BAD_CALLS[name])
    cpp_err = _error_of("cpp", BAD_CALLS[name])
    assert cpp_err == py_err
    assert py_err[1].startswith("tvm_gemm."), py_err


def test_kernel_build_error_surfaces(impl, monkeypatch):
    """A failure inside the Python miss handler reaches the caller unchanged."""
    from torch_tvm_gemm.runtime.cache import KernelNotCachedError

    monkeypatch.setenv("TVM_GEMM_NO_COMPILE", "1")
    a, b = randn(3, 5), randn(5, 1013)  # N = 1013: a kernel no other test builds
    with pytest.raises(KernelNotCachedError, match="TVM_GEMM_NO_COMPILE"):
        mm(a, b)


# --- which kernel: one rule (gemm_spec), the C++ table key agreeing with it -------------------


@needs_ext
def test_cpp_table_key_follows_gemm_spec_variant():
    """Over M / N / K around every threshold, the C++ key's variant is gemm_spec's."""
    from torch_tvm_gemm.schedules import cpu

    limit = cpu.GEMV_MIN_B_ELEMENTS
    ms = sorted({1, 2, 3, cpu.GEMV_MAX_M, cpu.GEMV_MAX_M + 1, cpu.DOT2_MAX_M, cpu.DOT2_MAX_M + 1})
    ms += [cpu.DOT_MAX_M, cpu.BF16_DOT_MAX_M, cpu.BF16_DOT_MAX_M + 1]
    ms += [cpu.BF16_GEMV_MAX_M, cpu.BF16_GEMV_MAX_M + 1, cpu.KTAIL_GEMV_MAX_M + 1]
    ms += [cpu.DOT_MAX_M + 1, 64, 1000]
    ms += [cpu.SWAP_MIN_M - 1, cpu.SWAP_MIN_M, 63, 65, cpu.SWAP_MAX_M, cpu.SWAP_MAX_M + 1, 120]
    nks = [(1, limit), (limit, 1), (64, limit // 64), (64, limit // 64 - 1), (7, 33), (768, 3072)]
    nks += [(64, cpu.swap_max_k()), (64, cpu.swap_max_k() + 1)]
    nks += [(512, cpu.DOT_K_MULTIPLE * 20 + 1), (512, cpu.DOT_K_MULTIPLE * 20 + 2)]  # K tails
    nks += [(50257, 768), (768, cpu.swap_max_k() // 2 + 1)]  # (once: two panels of x)
    nks += [(cpu.SWAP2_MIN_N, 768), (cpu.SWAP2_MIN_N - 1, 768)]  # "swap2" at M = 120..128
    ms += [119, 121, 128]
    nks += [(768, 16384)]  # bf16 on AMX: x of 64 rows at the L2 size of 2 MB (amx_dot_limits)
    nks += [(cpu.KSPLIT_MIN_N, 768), (cpu.KSPLIT_MIN_N - 16, 768), (cpu.KSPLIT_MIN_N + 8, 768)]
    ms += [cpu.KSPLIT_MAX_M, cpu.KSPLIT_MAX_M + 1]
    ms += [cpu.ROWS_MIN_M - 1, cpu.ROWS_MIN_M, 5000]  # "rows"
    nks += [(cpu.ROWS_MAX_N, 768), (cpu.ROWS_MAX_N + 1, 768)]
    nks += [(768, cpu.rows_max_k()), (768, cpu.rows_max_k() + 1)]
    for m in (4, 8, 12):  # "dot" needs K >= dot_min_k(M, N) (at most DOT_MIN_K_CAP)
        ms.append(m)
        for n in (1152, cpu.DOT_WIDE_MIN_N, cpu.DOT_WIDE_MIN_N - 1):
            nks += [(n, cpu.dot_min_k(m, n) - 1), (n, cpu.dot_min_k(m, n))]
    nks += [(768, cpu.DOT_MIN_K_CAP - 1), (768, cpu.DOT_MIN_K_CAP)]
    for variant, (rows, _, _) in cpu.ONE_PANEL_SWAPS.items():  # swap32, swap48
        ms += [rows - cpu.SWAP_SLACK - 1, rows - cpu.SWAP_SLACK, rows, rows + 1]
        max_k = cpu.one_panel_swap_max_k(variant)
        nks += [(64, max_k), (64, max_k + 1)]
    kinds = [("float32", True), ("float32", False), ("float64", True), ("bfloat16", True)]
    kinds += [("bfloat16", False)]
    previous = ops.use_impl("cpp")  # (the key's constants come at registration)
    try:
        disagree = [
            (m, n, k, layout, dtype, static_k, key, spec.variant)
            for m in ms
            for n, k in nks
            for layout in ("kn", "nk")
            for dtype, static_k in kinds
            if (key := EXT.key_variant(m, n, k, layout, dtype, static_k))
            != (spec := ops.gemm_spec(dtype, m, n, k, layout, static_k=static_k)).variant
        ]
    finally:
        ops.use_impl(previous)
    assert not disagree, disagree
    rows = {"rows"} if cpu.rows_max_k() else set()  # (CPUs with 32 vector registers)
    assert {ops.gemm_spec("float32", m, n, n, "nk").variant for m in ms for n in (64, 768)} == {
        "gemv",
        "dot2",
        "dot",
        "swap32",
        "swap48",
        "swap",
        "gemm",
    } | rows  # the sweep reaches every variant
    assert {ops.gemm_spec("float32", m, 1024, 64, "kn").variant for m in ms} == {
        "ksplit",
        "gemv",
        "gemm",
    } | rows


@needs_ext
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_cpp_table_key_follows_the_thread_count(threads):
    """The rows variant below ROWS_MIN_M depends on the threads: both rules read torch's."""
    from torch_tvm_gemm.schedules import cpu

    ms = [cpu.DOT_MAX_M, cpu.DOT_MAX_M + 1, 40, 60, 64, 65, 80, 81, 100, 128, 511, 512]
    ns = [64, 100, 192, 256, 320, 576, 704, 768, 1000]
    previous_threads, previous_impl = torch.get_num_threads(), ops.use_impl("cpp")
    torch.set_num_threads(threads)
    try:
        disagree = [
            (m, n, layout, key, spec.variant)
            for m in ms
            for n in ns
            for layout in ("kn", "nk")
            if (key := EXT.key_variant(m, n, 256, layout, "float32", True))
            != (spec := ops.gemm_spec("float32", m, n, 256, layout)).variant
        ]
    finally:
        torch.set_num_threads(previous_threads)
        ops.use_impl(previous_impl)
    assert not disagree, disagree


@needs_ext
def test_cpp_miss_hands_python_the_call(monkeypatch):
    """On a miss the C++ impl passes the call's M and K; gemm_spec makes the spec."""
    from torch_tvm_gemm.ops import impls

    asked = []
    real = impls.get_kernel
    monkeypatch.setattr(impls, "get_kernel", lambda spec: asked.append(spec) or real(spec))
    table.clear_table()
    x, w, b = randn(4, 192), randn(80, 192), randn(80)
    a, bm = randn(5, 24), randn(24, 9)
    run_on("cpp", lambda: (lin(x, w, b, "relu"), mm(a, bm)))
    assert asked == [
        ops.gemm_spec("float32", 4, 80, 192, "nk", bias=True, activation="relu"),
        ops.gemm_spec("float32", 5, 9, 24, "kn", static_k=False),
    ]
    assert asked[0].variant == "dot" and asked[1].k is None


def test_miss_handler_rejects_a_variant_gemm_spec_would_not_pick():
    from torch_tvm_gemm.ops import impls

    with pytest.raises(RuntimeError, match="internal error.*'gemv'.*'gemm'"):
        impls._kernel_for_cpp(
            "float32", 500, 128, 64, "nk", False, "none", True, False, "gemv", "cpu"
        )
    impls._cpp_miss.error = None  # (kept for C++, which is not waiting for it here)


@pytest.mark.parametrize("k", [21, 22], ids=["serial", "parallel"])
def test_products_either_side_of_the_serial_threshold(impl, k):
    """A product of at most 2^18 multiply-adds runs its parallel loop on the calling thread
    (C++ path): here three 258-row tasks of the packed kernel on one thread, then (K = 22,
    past the threshold) on the pool, and the pool still used after it."""
    m, n = 600, 20
    assert (m * n * 21 <= 1 << 18) and (m * n * 22 > 1 << 18)
    a, b = randn(m, k), randn(k, n)
    assert_close(mm(a, b), a.double() @ b.double(), k)
    x, w = randn(300, 256), randn(256, 256)
    assert_close(mm(x, w), x.double() @ w.double(), 256)


@needs_ext
def test_serial_products_leave_big_weights_to_the_pool():
    """The C++ path runs a product of at most 2^18 multiply-adds on the calling thread, unless
    B has GEMV_PARALLEL_MIN_ELEMENTS or more, where the few-row kernels are built parallel
    (a one-token 512 x 512 Linear: a read of 1 MB that two threads stream faster)."""
    from torch_tvm_gemm.schedules.cpu import GEMV_PARALLEL_MIN_ELEMENTS

    assert EXT.serial_product(16, 16, 16) and EXT.serial_product(64, 64, 64)
    assert not EXT.serial_product(64, 64, 65)  # past 2^18 multiply-adds
    for m, n, k in [(1, 256, 256), (1, 256, 512), (1, 512, 512), (2, 256, 512), (4, 128, 512)]:
        big_b = n * k >= GEMV_PARALLEL_MIN_ELEMENTS
        assert EXT.serial_product(m, n, k) == (m * n * k <= 1 << 18 and not big_b), (m, n, k)
    x, w, b = randn(1, 512), randn(512, 512), randn(512)
    assert_close(lin(x, w, b, "none"), x.double() @ w.double().T + b.double(), 512)


# --- safety: threads, leaks, switches ---------------------------------------------------------


@pytest.mark.parametrize("fresh_table", [False, True])
def test_threads(impl, fresh_table):
    """Several threads at once, on a warm table or all missing together."""
    shapes = [(3, 33, 5), (40, 33, 5), (8, 17, 12), (21, 17, 12)]
    inputs = [(randn(m, k), randn(k, n)) for m, k, n in shapes]
    for a, b in inputs:  # build the kernels first: the race is on the table, not the compiler
        mm(a, b)
    if fresh_table:
        table.clear_table()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for j in range(50):
                a, b = inputs[(i + j) % len(inputs)]
                torch.testing.assert_close(mm(a, b), a @ b, rtol=1.3e-5, atol=1e-4)
        except BaseException as err:  # noqa: BLE001 (reported by the main thread)
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


@needs_ext
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_no_leak_cpp():
    """100k calls on the C++ path (and 2k rejected ones): RSS must not grow with the count."""
    previous = ops.use_impl("cpp")
    try:
        a, b = randn(16, 16), randn(16, 16)
        x, w, bias = randn(1, 64), randn(64, 64), randn(64)
        bad = randn(3, 5)

        def calls(n: int) -> None:
            for _ in range(n):
                mm(a, b)
                lin(x, w, bias)
            for _ in range(n // 50):
                with pytest.raises(ValueError):
                    mm(a, bad)

        calls(5_000)  # warm-up: allocator caches, kernel table
        before = _rss_kb()
        calls(50_000)
        after = _rss_kb()
    finally:
        ops.use_impl(previous)
    # 100k successful calls of 1 KiB outputs: a per-call leak would show as >= 100 MB.
    assert after - before < 8 * 1024, f"RSS grew by {after - before} KiB"


def test_clear_table_clears_cpp_table():
    if EXT is None:
        pytest.skip("C++ extension not built")
    run_on("cpp", lambda: mm(randn(4, 8), randn(8, 3)))
    assert EXT.table_size() > 0
    table.clear_table()
    assert EXT.table_size() == 0
    out = run_on("cpp", lambda: mm(randn(4, 8), randn(8, 3)))  # reloads through Python
    assert out.shape == (4, 3)


def test_thread_count_follows_torch(impl):
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a, b = randn(64, 48), randn(48, 32)
        assert_close(mm(a, b), a @ b, k=48)
    finally:
        torch.set_num_threads(n)
    assert_close(mm(a, b), a @ b, k=48)


def test_use_impl_rejects_unknown_path():
    with pytest.raises(ValueError, match="impl path"):
        ops.use_impl("fortran")


# --- import-time choice, in fresh processes ----------------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != _ext.ENV_PYTHON_IMPL}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120
    )


def test_env_var_selects_python_impls():
    code = "import torch_tvm_gemm.ops as o; print(o.impl_path())"
    proc = _python(code, TVM_GEMM_PYTHON_IMPL="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "python"
    assert "not available" not in proc.stderr
    if EXT is not None:
        proc = _python(code)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "cpp"


def test_missing_extension_warns_once_and_works():
    code = (
        "import sys; sys.modules['torch_tvm_gemm._C'] = None\n"  # makes the import fail
        "import torch, torch_tvm_gemm as tg, torch_tvm_gemm.ops as o\n"
        "a, b = torch.randn(4, 8), torch.randn(8, 3)\n"
        "assert torch.allclose(tg.matmul(a, b), a @ b, atol=1e-5)\n"
        "print(o.impl_path())\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "python"
    lines = [line for line in proc.stderr.splitlines() if "C++ extension not available" in line]
    assert len(lines) == 1, proc.stderr
