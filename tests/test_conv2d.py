"""tvm_gemm.conv2d_bias_relu against F.relu(F.conv2d(...)): values, layouts, errors, autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_close, randn

import torch_tvm_gemm as tg

op = torch.ops.tvm_gemm.conv2d_bias_relu


def reference(x, w, b, stride=1, padding=0, dilation=1, groups=1, relu=True):
    """The torch result, computed in float64 from the same (rounded) inputs."""
    y = F.conv2d(
        x.double(), w.double(), None if b is None else b.double(), stride, padding, dilation, groups
    )
    return F.relu(y) if relu else y


# (N, C, H, W, K, kernel, stride, padding, dilation, groups): odd sizes, every kernel size.
CASES = [
    (1, 3, 13, 17, 8, 3, 1, 1, 1, 1),
    (2, 5, 9, 11, 7, 3, 2, 1, 1, 1),
    (3, 16, 10, 7, 33, 1, 1, 0, 1, 1),
    (1, 6, 15, 12, 20, 5, 1, 2, 1, 1),
    (2, 4, 19, 21, 16, 7, 2, 3, 1, 1),
    (1, 8, 14, 13, 12, 3, (2, 1), (0, 2), (2, 1), 1),
    (2, 7, 8, 9, 5, 1, 2, 0, 1, 1),
    (1, 1, 6, 17, 16, 1, 1, 1, 1, 1),  # one input channel, 1x1: a weight row of one value
]


def _case_id(case) -> str:
    n, c, h, w, k, r, s, p, d, g = case
    return f"n{n}c{c}{h}x{w}k{k}r{r}s{s}p{p}d{d}g{g}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_torch(case, dtype):
    n, c, h, w, k, r, stride, padding, dilation, groups = case
    x, wt, b = randn(n, c, h, w, dtype=dtype), randn(k, c // groups, r, r, dtype=dtype), None
    b = randn(k, dtype=dtype)
    y = tg.conv2d_bias_relu(x, wt, b, stride, padding, dilation, groups)
    assert y.dtype == dtype and y.is_contiguous()
    assert_close(y, reference(x, wt, b, stride, padding, dilation, groups), k=c * r * r)


# 1x1 convs that run as a GEMM per image (schedules/cpu_conv2d.pointwise_as_gemm): C <= 64 and
# at least 1024 pixels, or at least 784 pixels and 2^23 multiply-adds an image. 3 channels x
# 33x33 pixels puts image 1 at a 13068-byte offset, off the kernels' 64-byte alignment; K=5 is
# not a multiple of the 6-row register tile. 3 output channels of 1056 pixels take the
# "ksplit" kernel (a bias per row of its A, the weight). 28x28 pixels, 200 -> 60 channels:
# the fewest pixels, C past the 16-wide vectors.
POINTWISE = [(2, 3, 33, 33, 5), (1, 64, 32, 40, 70), (3, 16, 36, 30, 24), (2, 16, 32, 33, 3)]
POINTWISE += [(2, 200, 28, 28, 60)]


@pytest.mark.parametrize("case", POINTWISE, ids=lambda c: "n{}c{}{}x{}k{}".format(*c))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias, relu", [(True, True), (False, False)])
def test_pointwise_as_gemm(case, dtype, with_bias, relu):
    from torch_tvm_gemm.kernels.conv2d import Conv2dSpec
    from torch_tvm_gemm.schedules.cpu_conv2d import pointwise_as_gemm

    n, c, h, w, k = case
    assert pointwise_as_gemm(Conv2dSpec("float32", c, k, 1, 1, h, w))
    assert not pointwise_as_gemm(Conv2dSpec("float32", c, k, 1, 1, 27, 29))  # 783 pixels
    assert not pointwise_as_gemm(Conv2dSpec("float32", 200, 30, 1, 1, 28, 28))  # 4.7 M an image
    x, wt = randn(n, c, h, w, dtype=dtype), randn(k, c, 1, 1, dtype=dtype)
    b = randn(k, dtype=dtype) if with_bias else None
    y = tg.conv2d_bias_relu(x, wt, b, relu=relu)
    assert y.dtype == dtype and y.is_contiguous()
    assert_close(y, reference(x, wt, b, relu=relu), k=c)
    # channels_last input (one GEMM over all pixels), a non-contiguous weight view
    x_cl = x.to(memory_format=torch.channels_last)
    wt_t = wt.transpose(0, 1).contiguous().transpose(0, 1)
    y_cl = tg.conv2d_bias_relu(x_cl, wt_t, b, relu=relu)
    assert y_cl.is_contiguous(memory_format=torch.channels_last)
    assert_close(y_cl, y, k=c)


@pytest.mark.parametrize(
    "c, k, r, kwargs, act",
    [
        (24, 40, 1, {}, "relu"),  # one GEMM over the pixels
        (24, 40, 1, {"stride": 2}, "none"),  # the pixels it reads, then the same
        (16, 32, 1, {"stride": 2, "groups": 2}, "relu"),  # those pixels, the grouped kernel
        (24, 40, 1, {}, "hardswish"),  # an activation the GEMM lacks: after it, in place
        (6, 8, 3, {"padding": 1}, "relu"),  # the NCHW kernel, its output copied
        (8, 8, 3, {"padding": 1, "groups": 8}, "relu6"),  # depthwise
    ],
    ids=["1x1", "1x1-stride2", "1x1-stride2-groups2", "1x1-hardswish", "3x3", "depthwise"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_channels_last_in_channels_last_out(c, k, r, kwargs, act, dtype):
    # As F.conv2d: a channels_last input gives a channels_last output, whatever the route.
    x = randn(2, c, 9, 11, dtype=dtype).to(memory_format=torch.channels_last)
    groups = kwargs.get("groups", 1)
    w, b = randn(k, c // groups, r, r, dtype=dtype), randn(k, dtype=dtype)
    y = tg.conv2d_bias_relu(x, w, b, activation=act, **kwargs)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    want = tg.conv2d_bias_relu(x.contiguous(), w, b, activation=act, **kwargs)
    assert want.is_contiguous()
    assert_close(y, want, k=c // groups * r * r)
    args = (x, w, b, [kwargs.get("stride", 1)] * 2, [kwargs.get("padding", 0)] * 2, [1, 1])
    torch.library.opcheck(op, (*args, groups, True, act))  # the fake kernel's strides too


@pytest.mark.parametrize(
    "groups, c, k, stride",
    [(2, 32, 64, 1), (8, 8, 8, 1), (3, 6, 9, 1), (4, 8, 16, 1), (4, 32, 32, 1), (6, 48, 48, 2),
     (2, 48, 48, 1), (13, 104, 104, 2)],
    ids=["blocked-2", "depthwise", "odd-3", "quarter-vectors", "half-vectors",
         "half-vectors-stride2", "24-channel-groups", "regnet"],
)  # fmt: skip
def test_groups(groups, c, k, stride):
    # Groups of whole vectors, half vectors (RegNet's 8 channels) or quarter vectors run the
    # blocked kernel on vectors that wide (group_lanes); others the direct kernel.
    x, w, b = randn(2, c, 9, 10), randn(k, c // groups, 3, 3), randn(k)
    y = tg.conv2d_bias_relu(x, w, b, stride, 1, groups=groups)
    assert_close(y, reference(x, w, b, stride, 1, groups=groups), k=c // groups * 9)


def test_group_lanes_rule():
    from torch_tvm_gemm.schedules.cpu_conv2d import group_lanes
    from torch_tvm_gemm.target import CpuInfo

    cpu = CpuInfo("x86_64", "", frozenset({"avx512f"}))  # 16 floats a vector
    assert group_lanes(104, 104, 13, "float32", cpu) == 8  # RegNet: groups of 8 channels
    assert group_lanes(48, 48, 2, "float32", cpu) == 8  # groups of 24
    assert group_lanes(32, 64, 2, "float32", cpu) == 16
    assert group_lanes(128, 128, 32, "float32", cpu) == 4  # ResNeXt 32x4d's first stage
    assert group_lanes(32, 32, 16, "float32", cpu) is None  # 2 channels: the direct kernel
    assert group_lanes(32, 32, 1, "float32", cpu) is None  # not grouped
    assert group_lanes(32, 32, 32, "float32", cpu) is None  # depthwise


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("relu", [True, False])
def test_bias_and_relu_flags(bias, relu):
    x, w = randn(2, 5, 9, 8), randn(6, 5, 3, 3)
    b = randn(6) if bias else None
    y = op(x, w, b, [1, 1], [1, 1], [1, 1], 1, relu)
    assert_close(y, reference(x, w, b, 1, 1, relu=relu), k=45)
    if not relu:
        assert (y < 0).any()


def test_relu_once_on_the_final_sum():
    """The bias is added once and relu applied to the final sum, not to partial sums."""
    x = torch.ones(1, 1, 2, 2)
    w = torch.tensor([[[[-5.0, 3.0], [3.0, 1.0]]]])  # partial sums go negative first
    y = op(x, w, torch.tensor([-1.5]))
    assert y.item() == 0.5  # -5 + 3 + 3 + 1 - 1.5
    y = op(x, w, torch.tensor([-2.5]))
    assert y.item() == 0.0


def test_any_batch_one_kernel():
    """N is symbolic: batches of 1 and 5 give right results with one kernel."""
    w, b = randn(8, 3, 3, 3), randn(8)
    for n in (1, 5, 2):
        x = randn(n, 3, 11, 9)
        assert_close(op(x, w, b, [1, 1], [1, 1]), reference(x, w, b, 1, 1), k=27)


def test_layouts():
    x, w, b = randn(2, 6, 11, 13), randn(8, 6, 3, 3), randn(8)
    expected = reference(x, w, b, 1, 1)
    cl = x.to(memory_format=torch.channels_last)
    assert_close(op(cl, w, b, [1, 1], [1, 1]), expected, k=54)
    big = randn(2, 12, 11, 26)
    sliced = big[:, ::2, :, ::2]  # non-contiguous view
    assert_close(op(sliced, w, b, [1, 1], [1, 1]), reference(sliced, w, b, 1, 1), k=54)
    wt = randn(6, 8, 3, 3).transpose(0, 1)  # non-contiguous weight
    assert_close(op(x, wt, b, [1, 1], [1, 1]), reference(x, wt, b, 1, 1), k=54)


def test_empty_batch_and_channels():
    y = op(torch.randn(0, 3, 8, 8), torch.randn(4, 3, 3, 3), None)
    assert y.shape == (0, 4, 6, 6)
    b = torch.tensor([1.0, -1.0])
    x, w = torch.randn(2, 0, 5, 5), torch.randn(2, 0, 3, 3)
    y = op(x, w, b)  # no input channels: torch gives no output channels either
    assert y.shape == F.conv2d(x, w, b).shape == (2, 0, 3, 3)


BAD = [
    ((2, 3, 8, 8), (4, 5, 3, 3), 4, {}, r"given groups=1.*expects x to have 5 channels"),
    ((2, 3, 8, 8), (4, 3, 3), 4, {}, r"argument 'weight' must be 4-D"),
    ((2, 3, 8, 8), (4, 3, 3, 3), 5, {}, r"argument 'bias' must have shape \(4,\)"),
    ((3, 8, 8), (4, 3, 3, 3), 4, {}, r"argument 'x' must be 4-D"),
    ((2, 3, 4, 4), (4, 3, 5, 5), 4, {}, r"output would be empty"),
    ((2, 3, 8, 8), (4, 3, 3, 3), 4, {"dilation": [4, 4]}, r"output would be empty"),
    ((2, 3, 8, 8), (4, 3, 3, 3), 4, {"stride": [0, 1]}, r"argument 'stride'"),
    ((2, 3, 8, 8), (4, 3, 3, 3), 4, {"padding": [-1, 0]}, r"argument 'padding'"),
    ((2, 4, 8, 8), (6, 2, 3, 3), 6, {"groups": 4}, r"argument 'groups'"),
]


@pytest.mark.parametrize("xs, ws, bn, kwargs, match", BAD)
def test_bad_input(xs, ws, bn, kwargs, match):
    with pytest.raises(ValueError, match=r"tvm_gemm\.conv2d_bias_relu: .*" + match):
        op(torch.randn(xs), torch.randn(ws), torch.randn(bn), **kwargs)


def test_bad_dtypes():
    x, w = torch.randn(1, 3, 5, 5), torch.randn(2, 3, 3, 3)
    with pytest.raises(TypeError, match="argument 'weight' has dtype torch.float64"):
        op(x, w.double(), None)
    with pytest.raises(TypeError, match="argument 'x' must be float32"):
        op(x.int(), w.int(), None)


def test_opcheck():
    args = (randn(2, 3, 7, 6), randn(4, 3, 3, 3), randn(4), [2, 1], [1, 1], [1, 1], 1, True)
    torch.library.opcheck(op, args)
    torch.library.opcheck(
        op, (randn(1, 4, 5, 5), randn(4, 2, 1, 1), None, [1, 1], [0, 0], [1, 1], 2)
    )


@pytest.mark.parametrize("relu", [True, False])
def test_gradcheck(relu):
    def make(*shape):
        return randn(*shape, dtype=torch.float64).requires_grad_()

    # fast_mode: a few random directions instead of the full Jacobian (hundreds of torch
    # conv backward calls, slow on a loaded 2-core machine).
    x, w, b = make(2, 4, 6, 5), make(6, 2, 3, 3), make(6)
    assert torch.autograd.gradcheck(
        lambda x, w, b: op(x, w, b, [2, 1], [1, 1], [1, 2], 2, relu), (x, w, b), fast_mode=True
    )
    assert torch.autograd.gradcheck(
        lambda x, w: op(x, w, None, [1, 1], [0, 0], [1, 1], 2), (x, w), fast_mode=True
    )


def test_torch_compile_fullgraph():
    x, w, b = randn(2, 3, 9, 9), randn(8, 3, 3, 3), randn(8)
    w.requires_grad_()

    def f(x, w, b):
        return tg.conv2d_bias_relu(x, w, b, stride=1, padding=1).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(x, w, b)
    loss.backward()
    w_ref = w.detach().clone().requires_grad_()
    ref = F.relu(F.conv2d(x, w_ref, b, 1, 1)).sum()
    ref.backward()
    assert_close(loss.detach(), ref.detach(), k=27 * 162)
    assert_close(w.grad, w_ref.grad, k=162)


def test_packed_weight_follows_updates():
    """The kernel packs the weight at every call: in-place updates, .data swaps and new
    tensors are all seen."""
    x, w, b = randn(2, 16, 8, 8), randn(32, 16, 3, 3), randn(32)
    assert_close(op(x, w, b, [1, 1], [1, 1]), reference(x, w, b, 1, 1), k=144)
    w.mul_(-0.5)  # in place: bumps the version
    assert_close(op(x, w, b, [1, 1], [1, 1]), reference(x, w, b, 1, 1), k=144)
    p = torch.nn.Parameter(w.clone())
    assert_close(op(x, p, b, [1, 1], [1, 1]), reference(x, p, b, 1, 1), k=144)
    p.data = randn(32, 16, 3, 3)  # new storage, same object
    assert_close(op(x, p, b, [1, 1], [1, 1]), reference(x, p.detach(), b, 1, 1), k=144)
    with torch.inference_mode():
        wi = randn(32, 16, 3, 3)
        assert_close(op(x, wi, b, [1, 1], [1, 1]), reference(x, wi, b, 1, 1), k=144)


# How the blocked kernel splits its parallel tasks (schedules/cpu_conv2d.blocked_tasks): a
# chunk of images per task that the batch does not fill evenly (3 of 64, 70 = 64 + 6), a
# chunk of rows that does not divide the output height (47 = 24 + 23), K not a whole number
# of channel blocks (the packed block's missing channels are zeros, never stored), and a
# K of few channel blocks, where each task takes one image (the images feed the threads).
TASK_CASES = [
    ((3, 16, 9, 9, 264), lambda images, rows: images > 3),
    ((70, 16, 9, 9, 264), lambda images, rows: images < 70),
    ((8, 16, 9, 9, 24), lambda images, rows: images == 1),
    ((2, 64, 47, 47, 40), lambda images, rows: images == 1 and 47 % rows),
]


@pytest.mark.parametrize(
    "case, split", TASK_CASES, ids=["images-3", "images-70", "few-blocks", "rows-47"]
)
def test_blocked_task_edges(case, split):
    from torch_tvm_gemm.kernels.conv2d import Conv2dSpec
    from torch_tvm_gemm.schedules.cpu_conv2d import blocked_tasks, blocked_tile
    from torch_tvm_gemm.target import host_cpu

    n, c, h, w, k = case
    spec = Conv2dSpec("float32", c, k, 3, 3, h, w, padding=(1, 1))
    assert blocked_tile(spec, host_cpu()) is not None
    assert split(*blocked_tasks(spec, host_cpu()))
    x, wt, b = randn(n, c, h, w), randn(k, c, 3, 3), randn(k)
    assert_close(op(x, wt, b, [1, 1], [1, 1]), reference(x, wt, b, 1, 1), k=c * 9)
    # a weight with a non-contiguous layout is read as the same values
    wt_t = wt.transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(op(x, wt_t, b, [1, 1], [1, 1]), op(x, wt, b, [1, 1], [1, 1]))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_weight_packed_once_a_call_when_a_block_has_several_tasks(n):
    # The blocked kernel packs its weight in each task, or once a call where a block of
    # output channels has tasks for several chunks of images (cpu_conv2d.weight_pack): one
    # kernel per choice, both exact. 40 -> 24 channels: two blocks, one image a task.
    from torch_tvm_gemm.kernels.conv2d import Conv2dSpec
    from torch_tvm_gemm.ops.conv_ops import conv2d_spec
    from torch_tvm_gemm.schedules.cpu_conv2d import blocked_tasks, weight_pack
    from torch_tvm_gemm.target import host_cpu

    x, w, b = randn(n, 40, 7, 9), randn(24, 40, 3, 3), randn(24)
    spec = conv2d_spec(x, w, b, (1, 1), (1, 1), (1, 1), 1, True)
    images = blocked_tasks(spec, host_cpu())[0]
    assert spec.weight_pack == ("call" if n > images else "task") == weight_pack(spec, n)
    assert (spec.weight_pack == "call") == (n > 1)  # (here: one image a task)
    assert spec.key().get("weight_pack") == ("call" if n > 1 else None)  # older keys kept
    depthwise = Conv2dSpec("float32", 8, 8, 3, 3, 9, 9, padding=(1, 1), groups=8)
    assert weight_pack(depthwise, n) == "task"  # (no blocked kernel, one spec)
    assert_close(tg.conv2d_bias_relu(x, w, b, 1, 1), reference(x, w, b, 1, 1), k=40 * 9)
