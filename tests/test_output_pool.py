"""The ops' CPU outputs of 2 MiB or more come from the C++ extension's pool: blocks of whole
2 MiB pages (advised as transparent huge pages on Linux), kept when freed and handed to the
next output of the same size, which the kernel then overwrites entirely."""

from __future__ import annotations

import gc
import io
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm import _ext, ops
from torch_tvm_gemm.runtime import output_pool

EXT = _ext.load()
needs_pool = pytest.mark.skipif(EXT is None or os.name != "posix", reason="no C++ extension")
HAS_THP = (
    output_pool._madvise() is not None
    and os.path.exists("/proc/self/smaps")
    and os.path.exists("/sys/kernel/mm/transparent_hugepage")  # a kernel with THP
)
PATHS = [
    pytest.param("cpp", marks=pytest.mark.skipif(EXT is None, reason="no C++ extension")),
    "python",
]
HUGE_PAGE = 2 << 20
ROWS = output_pool.POOL_MIN_BYTES // (4 * 1024)  # a (ROWS, 1024) fp32 output at the threshold


@pytest.fixture(params=PATHS)
def impl(request):
    previous = ops.use_impl(request.param)
    yield request.param
    ops.use_impl(previous)


@pytest.fixture
def pool_limit(monkeypatch):
    """Reconfigure the pool with TVM_GEMM_OUTPUT_POOL_MB = the value given; restored after."""

    def set_limit(value: str):
        monkeypatch.setenv(output_pool.ENV_POOL_MB, value)
        output_pool.configure.cache_clear()
        return output_pool.configure()

    yield set_limit
    monkeypatch.delenv(output_pool.ENV_POOL_MB, raising=False)
    output_pool.configure.cache_clear()
    output_pool.configure()


def vm_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping that holds the middle of ``t``'s memory."""
    addr = t.data_ptr() + t.numel() * t.element_size() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= addr < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def assert_pooled(t: torch.Tensor) -> None:
    assert t.data_ptr() % HUGE_PAGE == 0
    if HAS_THP:
        assert "hg" in vm_flags(t)


@needs_pool
def test_linear_big_output(impl):
    x, w, b = randn(ROWS, 16), randn(1024, 16), randn(1024)
    y = torch.ops.tvm_gemm.linear(x, w, b, "relu")
    assert_pooled(y)
    assert_close(y, F.relu(F.linear(x, w, b)))


@needs_pool
def test_batched_matmul_big_output(impl):
    a, b = randn(8, ROWS // 8, 16), randn(8, 16, 1024)
    y = torch.ops.tvm_gemm.matmul(a, b)
    assert_pooled(y)
    assert_close(y, torch.bmm(a, b))


@needs_pool
def test_conv_big_output():
    x, w, b = randn(2, 8, 128, 128), randn(16, 8, 1, 1), randn(16)
    y = torch.ops.tvm_gemm.conv2d_bias_relu(x, w, b)
    assert_pooled(y)
    assert_close(y, F.relu(F.conv2d(x, w, b)))


@needs_pool
def test_freed_output_is_reused_and_overwritten(impl):
    """The next output of the size gets the freed block, garbage and all: every value must
    be written again."""
    x, w, b = randn(2 * ROWS + 3, 24), randn(1000, 24), randn(1000)
    y = tg.linear(x, w, b, "gelu")
    where = y.data_ptr()
    y.fill_(float("nan"))
    del y
    assert tg.output_pool_stats()["kept_bytes"] >= HUGE_PAGE
    y = tg.linear(x, w, b, "gelu")
    assert y.data_ptr() == where
    assert_close(y, F.gelu(F.linear(x, w, b)))


@needs_pool
def test_small_outputs_are_not_pooled():
    a, b = randn(64, 32), randn(32, 64)
    gc.collect()  # (outputs of earlier tests held in reference cycles: not this test's)
    before = tg.output_pool_stats()["live_bytes"]
    y = tg.matmul(a, b)
    assert tg.output_pool_stats()["live_bytes"] == before
    assert_close(y, a @ b)


@needs_pool
def test_stats_and_release():
    x, w = randn(ROWS, 8), randn(1024, 8)
    y = tg.linear(x, w)
    stats = tg.output_pool_stats()
    assert stats["live_bytes"] >= HUGE_PAGE
    assert stats["min_bytes"] == output_pool.POOL_MIN_BYTES
    assert stats["limit_bytes"] == output_pool.DEFAULT_POOL_MB << 20
    del y
    assert tg.output_pool_stats()["kept_blocks"] >= 1
    tg.release_output_pool()
    assert tg.output_pool_stats()["kept_bytes"] == 0
    assert tg.output_pool_stats()["kept_blocks"] == 0


@needs_pool
def test_limit_zero_keeps_nothing(pool_limit):
    pool_limit("0")
    assert tg.output_pool_stats()["limit_bytes"] == 0
    x, w = randn(ROWS, 8), randn(1024, 8)
    y = tg.linear(x, w)
    assert_pooled(y)
    assert_close(y, F.linear(x, w))
    del y
    assert tg.output_pool_stats()["kept_bytes"] == 0


@needs_pool
def test_bad_limit_names_the_variable(pool_limit):
    with pytest.raises(ValueError, match=output_pool.ENV_POOL_MB):
        pool_limit("lots")
    with pytest.raises(ValueError, match=output_pool.ENV_POOL_MB):
        pool_limit("-5")
    pool_limit("9" * 30)  # past any memory: no limit, not an overflow
    assert tg.output_pool_stats()["limit_bytes"] == (1 << 63) - 1


@needs_pool
def test_pooled_output_behaves_like_any_tensor():
    x, w = randn(ROWS, 8).requires_grad_(), randn(1024, 8).requires_grad_()
    y = tg.linear(x, w, None, "relu")
    y.sum().backward()
    x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
    F.relu(F.linear(x_ref, w_ref)).sum().backward()
    assert_close(x.grad, x_ref.grad)
    assert_close(w.grad, w_ref.grad)
    z = tg.linear(x.detach(), w.detach())
    kept = z.clone()
    z.resize_(3 * ROWS, 1024)  # a resizable storage: a bigger block from the same pool
    assert_close(z[:ROWS], kept)
    z[ROWS:] = 1.0  # (the rest is new, uninitialized memory)
    buf = io.BytesIO()
    torch.save(z, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf), z)


@needs_pool
def test_threads_share_the_pool():
    x, w = randn(ROWS, 16), randn(1024, 16)
    want = F.linear(x, w)
    errors = []

    def work():
        try:
            for _ in range(10):
                assert_close(tg.linear(x, w), want)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    gc.collect()  # (outputs of earlier tests held in reference cycles: not this test's)
    before = tg.output_pool_stats()["live_bytes"]
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tg.output_pool_stats()["live_bytes"] == before


def _linear_in_child(conn):
    torch.set_num_threads(1)  # (libgomp's pool does not survive fork: as DataLoader workers)
    x, w = randn(ROWS, 8, seed=3), randn(1024, 8, seed=4)
    y = tg.linear(x, w)
    ok = y.data_ptr() % HUGE_PAGE == 0 and torch.allclose(y, F.linear(x, w), atol=1e-5)
    del y
    conn.send((ok, tg.output_pool_stats()["kept_bytes"]))


@needs_pool
def test_forked_child_has_a_pool_of_its_own():
    """A child forked while the parent keeps blocks starts from an empty pool and works."""
    import multiprocessing

    keep = tg.linear(randn(ROWS, 8), randn(1024, 8))
    del keep
    assert tg.output_pool_stats()["kept_bytes"] > 0
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_linear_in_child, args=(child,))
    proc.start()
    assert parent.poll(120), "the forked child did not answer"
    ok, kept = parent.recv()
    proc.join(30)
    assert ok and kept == HUGE_PAGE  # its own output's block, and nothing of the parent's


@pytest.mark.skipif(not HAS_THP, reason="no madvise(MADV_HUGEPAGE) here")
def test_without_the_extension_big_outputs_are_advised(monkeypatch):
    monkeypatch.setattr(output_pool, "configure", lambda: None)
    rows = output_pool.HUGE_OUTPUT_BYTES // (4 * 8192)
    big = output_pool.empty((rows, 8192), torch.float32, torch.device("cpu"))
    assert big.shape == (rows, 8192) and big.dtype == torch.float32
    assert "hg" in vm_flags(big)
    small = output_pool.empty((4, 8), torch.float32, torch.device("cpu"))
    assert small.shape == (4, 8)
