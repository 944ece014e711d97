"""The math of the conv2d kernels: ``out = act(conv2d(x, weight) + bias)``, in TensorIR (TE).

``act`` is one of ``ACTIVATIONS`` (``relu`` by default, as the op's name says), or a leaky
ReLU of another slope, ``leaky_relu_<slope>`` (see ``leaky_relu_slope``).

No schedule here (see ``schedules/cpu_conv2d.py``). Layouts are torch's: ``x (N, C, H, W)``,
``weight (K, C/groups, R, S)``, ``bias (K,)``, ``out (N, K, OH, OW)``, all contiguous; or,
for the "blocked" variant with ``Conv2dSpec.layout`` "nhwc", those of a channels_last model
as they lie in memory: ``x (N, H, W, C)``, ``weight (K, R, S, C/groups)``, ``out (N, OH, OW,
K)`` (the reduction then runs over (r, s, c), c innermost, and the output tile is stored as
the vectors it is computed in).

What is static and what is symbolic: the batch ``N`` is symbolic (one kernel for every batch
size); everything else (C, K, R, S, H, W, stride, padding, dilation, groups) is static. A
static output width lets the schedule tile it in registers without a bounds check, and a
static H keeps the padded input copy a fixed size per image; in a CNN every layer sees one
resolution, so this costs one build per (layer shape, input resolution).

Two variants of the math, chosen by the schedule:

* "blocked" (``k_block`` set): NCHWc-style. The kernel packs the weight into
  ``[ceil(K/kb), C/groups, R, S, kb]`` in the accumulation dtype (stage "w_pack"), so a
  block of ``kb`` output channels is one run of vectors; the accumulator is laid out
  ``(N, K/kb, OH, OW, kb)``. Needs each block of ``kb`` output channels to lie inside one
  group (``kb`` divides ``K/groups``, or groups == 1). The pack is a stage of the kernel, at
  every call (a pack kept across calls would go stale on writes that no version counter
  sees): the schedule packs one block per parallel task into a buffer that stays in cache.
* "direct" (``k_block`` None): one output channel at a time, any groups (e.g. depthwise).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from . import epilogue

DTYPES = ("float32", "float64", "bfloat16", "float16")
# The conv's epilogues: ReLU, and those of MobileNetV2 (relu6), MobileNetV3 (hardswish),
# EfficientNet (silu), CSPNet / DarkNet (leaky_relu: torch's default slope, 0.01) and the
# gates of squeeze-and-excitation blocks (sigmoid; hardsigmoid in MobileNetV3). A leaky
# ReLU of another slope >= 0 is named "leaky_relu_<slope>" (YOLO's 0.1: "leaky_relu_0.1"),
# the slope written as Python writes the float, so that one slope has one name (and kernel).
ACTIVATIONS = ("none", "relu", "relu6", "hardswish", "silu", "leaky_relu", "sigmoid", "hardsigmoid")
_LEAKY_PREFIX = "leaky_relu_"


def leaky_relu_slope(name: str) -> float | None:
    """The negative slope of the leaky ReLU epilogue ``name`` ("leaky_relu": 0.01,
    "leaky_relu_0.1": 0.1), or None when ``name`` is no such epilogue or not in its one
    spelling. Slopes are finite and >= 0: the gradient is then read from the output's sign."""
    if name == "leaky_relu":
        return epilogue.LEAKY_RELU_SLOPE
    if not isinstance(name, str) or not name.startswith(_LEAKY_PREFIX):
        return None
    try:
        slope = float(name[len(_LEAKY_PREFIX) :])
    except ValueError:
        return None
    usable = math.isfinite(slope) and slope >= 0
    return slope if usable and leaky_relu_name(slope) == name else None


def leaky_relu_name(slope: float) -> str:
    """The epilogue name of a leaky ReLU with ``slope`` (no check of the slope)."""
    slope = float(slope)
    return "leaky_relu" if slope == epilogue.LEAKY_RELU_SLOPE else f"{_LEAKY_PREFIX}{slope!r}"


def is_activation(name: str) -> bool:
    """Whether ``name`` is a conv epilogue: one of ACTIVATIONS or a leaky ReLU's name."""
    return name in ACTIVATIONS or leaky_relu_slope(name) is not None


def torch_activation(name: str):
    """The torch function of a conv epilogue (the reference of tests, autograd's formulas)."""
    import torch
    import torch.nn.functional as F

    slope = leaky_relu_slope(name)
    if slope is not None:
        return lambda t: F.leaky_relu(t, slope)
    return {
        "none": lambda t: t,
        "relu": F.relu,
        "relu6": F.relu6,
        "hardswish": F.hardswish,
        "silu": F.silu,
        "sigmoid": torch.sigmoid,
        "hardsigmoid": F.hardsigmoid,
    }[name]


def activate(name: str, v, dtype: str, device: str):
    """The epilogue ``name`` on the TIR value ``v`` (applied once, to the final sum)."""
    slope = leaky_relu_slope(name)
    if slope is not None:
        return epilogue.leaky_relu(v, dtype, slope)
    if name == "relu":
        return epilogue.relu(v, dtype)
    if name == "relu6":
        return epilogue.relu6(v, dtype)
    if name == "hardswish":
        return epilogue.hardswish(v, dtype)
    if name == "silu":
        return epilogue.silu(v, dtype, device)
    if name == "sigmoid":
        return epilogue.sigmoid(v, dtype, device)
    if name == "hardsigmoid":
        return epilogue.hardsigmoid(v, dtype)
    return v


@dataclass(frozen=True)
class Conv2dSpec:
    """Everything that changes a compiled conv2d binary (the target aside)."""

    dtype: str
    c: int  # input channels
    k: int  # output channels
    r: int  # kernel height
    s: int  # kernel width
    h: int  # input height
    w: int  # input width
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = True
    relu: bool = True  # the epilogue when ``activation`` is None: "relu" or "none"
    device: str = "cpu"
    activation: str | None = None  # is_activation(); replaces ``relu`` when given
    # "nchw" (torch's layouts, above), or "nhwc": a kernel over channels-last pixels, the
    # blocked one (above) or, for a depthwise spec, ``kernels/conv2d_depthwise_nhwc.py``
    layout: str = "nchw"
    # The CPU blocked kernel's weight pack: "task" (each parallel task packs its block of
    # output channels) or "call" (the whole weight once a call, before the tasks: where a
    # block's tasks are several, ``schedules/cpu_conv2d.weight_pack`` says when)
    weight_pack: str = "task"

    family = "conv2d"

    def __post_init__(self) -> None:
        # Internal invariants: user input is validated in ops/checks.py before a spec is made.
        if self.activation is None:  # (frozen: normalized here, so that equal specs are equal)
            object.__setattr__(self, "activation", "relu" if self.relu else "none")
        object.__setattr__(self, "relu", self.activation == "relu")
        if self.dtype not in DTYPES or self.c % self.groups or self.k % self.groups:
            raise ValueError(f"bad Conv2dSpec {self}")
        if not is_activation(self.activation) or self.layout not in ("nchw", "nhwc"):
            raise ValueError(f"bad Conv2dSpec {self}")
        if self.weight_pack not in ("task", "call"):
            raise ValueError(f"bad Conv2dSpec {self}")
        if self.out_h < 1 or self.out_w < 1:
            raise ValueError(f"bad Conv2dSpec {self} (empty output)")

    @property
    def acc_dtype(self) -> str:
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def out_h(self) -> int:
        return _out_size(self.h, self.r, self.stride[0], self.padding[0], self.dilation[0])

    @property
    def out_w(self) -> int:
        return _out_size(self.w, self.s, self.stride[1], self.padding[1], self.dilation[1])

    def key(self) -> dict:
        key = {"family": self.family, **asdict(self)}
        # (Fields at the defaults they were added with: the keys of the kernels before them.)
        if self.layout == "nchw":
            del key["layout"]
        if self.weight_pack == "task":
            del key["weight_pack"]
        return key

    def name(self) -> str:
        geo = "_".join(
            f"{tag}{a}x{b}"
            for tag, (a, b) in (("s", self.stride), ("p", self.padding), ("d", self.dilation))
        )
        epi = ("_bias" if self.bias else "") + (
            "" if self.activation == "none" else f"_{self.activation}"
        )
        g = f"_g{self.groups}" if self.groups != 1 else ""
        layout = "" if self.layout == "nchw" else f"_{self.layout}"
        pack = "" if self.weight_pack == "task" else "_pack_per_call"
        return (
            f"conv2d_{self.dtype}_c{self.c}_k{self.k}_{self.r}x{self.s}_in{self.h}x{self.w}"
            f"_{geo}{g}{epi}{layout}{pack}"
        )


def _out_size(size: int, kernel: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (kernel - 1) - 1) // stride + 1


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_input_width(spec: Conv2dSpec, ow_tile: int) -> int:
    """Width of the input the reduction reads when the output width is padded to ``ow_tile``."""
    owp = _ceil_to(spec.out_w, ow_tile)
    return (owp - 1) * spec.stride[1] + (spec.s - 1) * spec.dilation[1] + 1


def conv2d_compute(spec: Conv2dSpec, ow_tile: int = 1, k_block: int | None = None):
    """Return the unscheduled PrimFunc ``main(x, weight, [bias,] out)`` for ``spec``.

    ``ow_tile``: the output width is computed over a domain rounded up to a multiple of it
    (the schedule's register tile), so the micro-kernel has no bounds check; the extra
    columns read the zero-padded input and are never stored. ``k_block``: see the module doc.

    Arguments: ``(x, weight, [bias,] out)``, all in torch's layouts. Stages: "x_pad" is the
    input in the accumulation dtype, zero-padded (the schedule inlines it when there is
    nothing to pad or convert); "w_pack" the weight in the accumulation dtype (for
    "blocked", packed by channel blocks, zeros past K); "acc" the reduction over (c, r, s) from zero;
    "out" adds the bias once, applies the activation once to the final sum and casts back. The bias is
    not the reduction's init because TVM 0.27 drops non-constant inits in some schedule
    primitives (see ``kernels/gemm.py``).
    """
    from tvm import te, tirx

    acc = spec.acc_dtype
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    cg, kg = spec.c // spec.groups, spec.k // spec.groups
    oh, ow = spec.out_h, spec.out_w
    owp = _ceil_to(ow, ow_tile)
    # The padded input covers every row / column the (width-padded) reduction reads.
    hp = (oh - 1) * sh + (spec.r - 1) * dh + 1
    wp = padded_input_width(spec, ow_tile)

    nhwc = spec.layout == "nhwc"  # (the blocked variant only)
    if nhwc and k_block is None:
        raise ValueError(f"the conv over channels-last pixels is blocked only: {spec}")
    n = tirx.Var("N", "int64")
    x_shape = (n, spec.h, spec.w, spec.c) if nhwc else (n, spec.c, spec.h, spec.w)
    x = te.placeholder(x_shape, spec.dtype, name="x")
    # (channels last, the weight too: (K, R, S, C/groups), as a channels_last model keeps it)
    w_shape = (spec.k, spec.r, spec.s, cg) if nhwc else (spec.k, cg, spec.r, spec.s)
    weight = te.placeholder(w_shape, spec.dtype, name="weight")
    bias = te.placeholder((spec.k,), spec.dtype, name="bias")

    def w_read(k, c, i, j):
        return (weight[k, i, j, c] if nhwc else weight[k, c, i, j]).astype(acc)

    def x_read(b, c, i, j):
        return (x[b, i, j, c] if nhwc else x[b, c, i, j]).astype(acc)

    def x_at(b, c, i, j):
        if ph == 0 and pw == 0 and wp <= spec.w:  # nothing to pad: a plain read
            return x_read(b, c, i, j)
        inside = tirx.all(i >= ph, i < spec.h + ph, j >= pw, j < spec.w + pw)
        # Clamped indices keep the (masked) read in bounds.
        ii = te.max(te.min(i - ph, spec.h - 1), 0)
        jj = te.max(te.min(j - pw, spec.w - 1), 0)
        return tirx.if_then_else(inside, x_read(b, c, ii, jj), tirx.const(0, acc))

    if nhwc:  # the padded copy keeps the channels last too
        x_pad_nhwc = te.compute((n, hp, wp, spec.c), lambda b, i, j, c: x_at(b, c, i, j),
                                name="x_pad")  # fmt: skip

        def x_padded(b, c, i, j):
            return x_pad_nhwc[b, i, j, c]

    else:
        x_pad = te.compute((n, spec.c, hp, wp), x_at, name="x_pad")

        def x_padded(b, c, i, j):
            return x_pad[b, c, i, j]

    rc = te.reduce_axis((0, cg), name="rc")
    rr = te.reduce_axis((0, spec.r), name="rr")
    rs = te.reduce_axis((0, spec.s), name="rs")

    if k_block is None:
        w_pack = te.compute(weight.shape, lambda *i: weight[i].astype(acc), name="w_pack")
        acc_t = te.compute(
            (n, spec.k, oh, owp),
            lambda b, k, i, j: te.sum(
                x_padded(b, (k // kg) * cg + rc, i * sh + rr * dh, j * sw + rs * dw)
                * w_pack[k, rc, rr, rs],
                axis=[rc, rr, rs],
            ),
            name="acc",
        )

        def acc_at(b, k, i, j):
            return acc_t[b, k, i, j]

    else:
        kb = k_block
        kp = _ceil_to(spec.k, kb)
        if spec.groups > 1 and kg % kb:
            raise ValueError(f"k_block {kb} must divide K/groups = {kg}")
        blocks_per_group = kg // kb if spec.groups > 1 else 1

        # The packed weight is a stage of the kernel, read from torch's layout at every
        # call; the schedule packs one block of ``kb`` output channels per parallel task.
        def packed(ko, c, i, j, ki):
            k = ko * kb + ki
            if kp == spec.k:
                return w_read(k, c, i, j)
            kk = te.min(k, spec.k - 1)  # clamped: the masked read stays in bounds
            return tirx.if_then_else(k < spec.k, w_read(kk, c, i, j), tirx.const(0, acc))

        # Channels last, the reduction runs over (r, s, c), c innermost: each step reads
        # the next channel of the same pixels, as the input and the weight lie in memory.
        if nhwc:
            w_pack_rsc = te.compute((kp // kb, spec.r, spec.s, cg, kb),
                                    lambda ko, i, j, c, ki: packed(ko, c, i, j, ki),
                                    name="w_pack")  # fmt: skip

            def w_packed(ko, c, i, j, ki):
                return w_pack_rsc[ko, i, j, c, ki]

            reduction = [rr, rs, rc]
        else:
            w_pack = te.compute((kp // kb, cg, spec.r, spec.s, kb), packed, name="w_pack")

            def w_packed(ko, c, i, j, ki):
                return w_pack[ko, c, i, j, ki]

            reduction = [rc, rr, rs]

        def chan(ko, c):  # the input channel of reduction step c for output block ko
            if spec.groups == 1:
                return c
            return (ko // blocks_per_group) * cg + c

        acc_t = te.compute(
            (n, kp // kb, oh, owp, kb),
            lambda b, ko, i, j, ki: te.sum(
                x_padded(b, chan(ko, rc), i * sh + rr * dh, j * sw + rs * dw)
                * w_packed(ko, rc, rr, rs, ki),
                axis=reduction,
            ),
            name="acc",
        )

        # Bias and activation on the accumulator tile, whose vectors run along the channels
        # (the schedule vectorizes it), before "out" transposes the tile into NCHW: applied in
        # that lane-by-lane write-back, a SiLU's polynomial ran as scalar code and made the
        # conv up to 4x slower than with ReLU.
        def epilogue(b, ko, i, j, ki):
            v = acc_t[b, ko, i, j, ki]
            if spec.bias:
                k = ko * kb + ki
                v = v + bias[k if kp == spec.k else te.min(k, spec.k - 1)].astype(acc)
            return activate(spec.activation, v, acc, spec.device)

        epi_t = te.compute(acc_t.shape, epilogue, name="epi")

        def acc_at(b, k, i, j):
            return epi_t[b, k // kb, i, j, k % kb]

    def final(b, k, i, j):
        v = acc_at(b, k, i, j)
        if k_block is None:
            if spec.bias:
                v = v + bias[k].astype(acc)
            v = activate(spec.activation, v, acc, spec.device)
        return v.astype(spec.dtype)

    if nhwc:
        out = te.compute((n, oh, ow, spec.k), lambda b, i, j, k: final(b, k, i, j), name="out")
    else:
        out = te.compute((n, spec.k, oh, ow), final, name="out")
    args = [x, weight] + ([bias] if spec.bias else []) + [out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")
