"""Outputs of HUGE_OUTPUT_BYTES or more are advised as transparent huge pages (Linux), on
both impl paths, and hold the same values as torch's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, randn

from torch_tvm_gemm import _ext, ops
from torch_tvm_gemm.runtime import huge_pages

pytestmark = pytest.mark.skipif(
    huge_pages.huge_output_bytes() == 0
    or not os.path.exists("/proc/self/smaps")
    or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),  # a kernel without THP
    reason="no madvise(MADV_HUGEPAGE) here",
)
EXT = _ext.load()
PATHS = [
    pytest.param("cpp", marks=pytest.mark.skipif(EXT is None, reason="no C++ extension")),
    "python",
]
BIG_ROWS = huge_pages.HUGE_OUTPUT_BYTES // (4 * 8192)  # a (rows, 8192) fp32 output at the threshold


@pytest.fixture(params=PATHS)
def impl(request):
    previous = ops.use_impl(request.param)
    yield request.param
    ops.use_impl(previous)


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


def test_empty_advises_big_outputs_only():
    big = huge_pages.empty((BIG_ROWS, 8192), torch.float32, torch.device("cpu"))
    assert big.shape == (BIG_ROWS, 8192) and big.dtype == torch.float32
    assert "hg" in vm_flags(big)
    small = huge_pages.empty((4, 8), torch.float32, torch.device("cpu"))
    assert small.shape == (4, 8)


def test_linear_big_output(impl):
    x, w, b = randn(BIG_ROWS, 16), randn(8192, 16), randn(8192)
    y = torch.ops.tvm_gemm.linear(x, w, b, "relu")
    assert "hg" in vm_flags(y)
    assert_close(y, F.relu(F.linear(x, w, b)))


def test_batched_matmul_big_output(impl):
    a, b = randn(8, BIG_ROWS // 8, 16), randn(8, 16, 8192)
    y = torch.ops.tvm_gemm.matmul(a, b)
    assert "hg" in vm_flags(y)
    assert_close(y, torch.bmm(a, b))


def test_conv_big_output():
    x, w, b = randn(2, 8, 512, 512), randn(16, 8, 1, 1), randn(16)
    y = torch.ops.tvm_gemm.conv2d_bias_relu(x, w, b)
    assert "hg" in vm_flags(y)
    assert_close(y, F.relu(F.conv2d(x, w, b)))
