"""Depthwise convs (groups == C, schedules/cpu_depthwise.py) against torch, at their edges."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm.kernels.conv2d import Conv2dSpec
from torch_tvm_gemm.schedules.cpu_depthwise import (
    LLVM_PHASE_SPLIT_MIN_W,
    ROW_BLOCK,
    ROW_VECTOR,
    images_outside,
    is_depthwise,
)


def reference(x, w, b, stride, padding, dilation, groups, relu=True):
    y = F.conv2d(
        x.double(), w.double(), None if b is None else b.double(), stride, padding, dilation, groups
    )
    return F.relu(y) if relu else y


# (N, C, H, W, multiplier, kernel, stride, padding, dilation): odd widths (not a multiple of
# a vector), rows not a multiple of ROW_BLOCK, stride 1 / 2 / (2, 1), padding 0 / 1 / 2 /
# (0, 2), dilation, channel multiplier 2 (K = 2C), batch > 1, rows wider than ROW_VECTOR
# (cut into pieces that divide them: 200 -> 100, 259 -> 37; 131, a prime, takes the clipped
# path), a 1x1 image.
CASES = [
    (1, 8, 13, 17, 1, 3, 1, 1, 1),
    (3, 5, 9, 11, 1, 3, 2, 1, 1),
    (2, 4, 12, 7, 2, 3, 1, 0, 1),
    (1, 6, 15, 19, 1, 5, 2, 2, 1),
    (2, 3, 10, 23, 1, 3, (2, 1), (0, 2), (2, 1)),
    (1, 4, 11, 13, 3, 3, 1, 2, 2),
    (1, 2, 6, 200, 1, 3, 1, 1, 1),
    (2, 3, 5, 2 * ROW_VECTOR + 3, 1, 3, 2, 1, 1),
    (1, 2, 4, ROW_VECTOR + 3, 1, 3, 1, 1, 1),
    (1, 3, 1, 1, 1, 1, 1, 0, 1),
    (1, 3, 9, 15, 1, 3, 2, 1, 2),  # stride 2, dilation 2: the taps read one phase only
    (2, 4, 2, 2, 1, 3, 2, 1, 1),  # a 1x1 output: the padding keeps its condition
    (1, 3, 1, 6, 1, 3, 1, 1, 1),  # one input row
    (1, 3, 5, 1, 2, 3, 2, 1, 1),  # one input column
    (1, 4, 2, 1, 1, 7, 2, 3, 1),  # a column phase with no input column in bounds
    # rows of at least LLVM_PHASE_SPLIT_MIN_W columns at stride 2: the phases are split from
    # the padded row (or from x itself, with no padding)
    (1, 3, 9, LLVM_PHASE_SPLIT_MIN_W + 2, 1, 3, 2, 0, 1),
    (2, 2, 7, LLVM_PHASE_SPLIT_MIN_W + 1, 2, 3, (1, 2), (1, 0), 1),
    (1, 2, 8, LLVM_PHASE_SPLIT_MIN_W + 5, 1, 3, 2, 1, 2),
    # rows of 3, 5-7 or 9-15 columns are computed 8 or 16 wide (kernels/conv2d_depthwise.py
    # row_width) and their columns copied: EfficientNet's 5x5 at 7x7 and 14x14, a 7x7 kernel
    (2, 16, 7, 7, 1, 5, 1, 2, 1),
    (2, 16, 14, 14, 1, 7, 1, 3, 1),
    (1, 4, 9, 23, 1, 5, 2, 2, 1),  # 10 columns at stride 2
    # more than 14 x 14 outputs an image: the parallel loop runs over
    # (image, channel) pairs (images_outside), here with an odd batch
    (3, 5, 17, 19, 1, 3, 1, 1, 1),
    (3, 4, 30, LLVM_PHASE_SPLIT_MIN_W + 2, 2, 3, 2, 1, 1),
]


def _case_id(case) -> str:
    n, c, h, w, m, r, s, p, d = case
    return f"n{n}c{c}{h}x{w}m{m}r{r}s{s}p{p}d{d}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_torch(case):
    n, c, h, w, m, r, stride, padding, dilation = case
    x, wt, b = randn(n, c, h, w), randn(m * c, 1, r, r), randn(m * c)
    y = tg.conv2d_bias_relu(x, wt, b, stride, padding, dilation, groups=c)
    assert y.is_contiguous()
    assert_close(y, reference(x, wt, b, stride, padding, dilation, c), k=r * r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stride", [1, 2])
def test_dtypes(dtype, stride):
    x, w, b = randn(2, 6, 11, 9, dtype=dtype), randn(6, 1, 3, 3, dtype=dtype), randn(6, dtype=dtype)
    y = tg.conv2d_bias_relu(x, w, b, stride, 1, groups=6)
    assert y.dtype == dtype
    assert_close(y, reference(x, w, b, stride, 1, 1, 6), k=9)


@pytest.mark.parametrize("bias, relu", [(False, False), (True, False), (False, True)])
def test_bias_and_relu_flags(bias, relu):
    x, w = randn(2, 4, 9, 10), randn(8, 1, 3, 3)
    b = randn(8) if bias else None
    y = torch.ops.tvm_gemm.conv2d_bias_relu(x, w, b, [2, 2], [1, 1], [1, 1], 4, relu)
    assert_close(y, reference(x, w, b, 2, 1, 1, 4, relu=relu), k=9)
    if not relu:
        assert (y < 0).any()


def test_nan_goes_through_relu():
    """A NaN input stays NaN in the outputs that read it (relu keeps NaN, as torch's does);
    the zero padding and the other outputs are untouched."""
    x, w, b = randn(1, 3, 8, 8), randn(3, 1, 3, 3), randn(3)
    x[0, 1, 4, 0] = float("nan")
    y = tg.conv2d_bias_relu(x, w, b, 1, 1, groups=3)
    expected = reference(x, w, b, 1, 1, 1, 3)
    assert torch.equal(y.isnan(), expected.isnan()) and y.isnan().sum() == 6
    mask = ~expected.isnan()
    assert_close(y[mask], expected[mask], k=9)


@pytest.mark.parametrize("hw", [(7, 9), (15, 14)], ids=["channels-outside", "images-outside"])
def test_any_batch_one_kernel(hw):
    w, b = randn(5, 1, 3, 3), randn(5)
    spec = Conv2dSpec("float32", 5, 5, 3, 3, *hw, padding=(1, 1), groups=5)
    assert images_outside(spec) == (hw == (15, 14))  # both orders run
    for n in (1, 4, 2 * ROW_BLOCK + 1):
        x = randn(n, 5, *hw)
        assert_close(
            tg.conv2d_bias_relu(x, w, b, 1, 1, groups=5), reference(x, w, b, 1, 1, 1, 5), k=9
        )


def test_which_specs_are_depthwise():
    def spec(c, k, groups):
        return Conv2dSpec("float32", c, k, 3, 3, 8, 8, groups=groups)

    assert is_depthwise(spec(8, 8, 8)) and is_depthwise(spec(8, 16, 8))
    assert not is_depthwise(spec(8, 8, 4)) and not is_depthwise(spec(8, 8, 1))
    assert not is_depthwise(spec(1, 4, 1))  # one channel, groups 1: the ordinary kernels
    # rows too wide for a task's stack buffer: the "direct" kernel
    wide = Conv2dSpec("float32", 4, 4, 3, 3, 8, 1 << 16, padding=(1, 1), groups=4)
    assert not is_depthwise(wide) and is_depthwise(
        Conv2dSpec("float32", 4, 4, 1, 3, 1, 1 << 16, groups=4)
    )


@pytest.mark.parametrize("h, r", [(1, 1), (8, 3)], ids=["one-row", "too-wide-for-a-task"])
def test_very_wide_rows(h, r):
    """A 65536-column row: one row is padded per task in pieces of vectors; three rows do
    not fit a task's buffer and take the "direct" kernel."""
    x, w, b = randn(1, 2, h, 1 << 16), randn(2, 1, r, 3), randn(2)
    y = tg.conv2d_bias_relu(x, w, b, 1, (r // 2, 1), groups=2)
    assert_close(y, reference(x, w, b, 1, (r // 2, 1), 1, 2), k=3 * r)


def test_gradcheck():
    x = torch.randn(2, 3, 6, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: tg.conv2d_bias_relu(x, w, b, 2, 1, groups=3), (x, w, b)
    )
