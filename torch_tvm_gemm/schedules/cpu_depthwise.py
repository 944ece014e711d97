"""LLVM CPU schedule of the depthwise conv2d math of ``kernels/conv2d_depthwise.py``.

A depthwise conv does R*S FMAs per output and reads each input about once: it is bound by
loads and by whatever runs per element besides the FMAs. So:

- Parallel over (image, output channel, block of output rows): each task zero-pads the
  input rows its block reads into a small local buffer, split by column phase (at stride 2
  a vector of outputs then reads contiguous input); the padding is two vectorized loops (a
  fill, then the in-bound rows copied), no condition per element.
- An output row (up to ``ROW_VECTOR`` columns) is one vector: LLVM splits it into whole
  registers plus one part-register, so no width is padded or masked and every row stays
  in registers for its R*S taps; bias and activation are applied to that row once.
  Wider rows are cut into ``ROW_VECTOR``-column pieces.
"""

from __future__ import annotations

from ..kernels.conv2d import Conv2dSpec
from ..kernels.conv2d_depthwise import depthwise_compute

SCHEDULE_VERSION = 1  # bump when the schedule changes the binary: it is part of the cache key

ROW_VECTOR = 128  # the widest output row kept as one vector (8 AVX-512 registers of fp32)
ROW_BLOCK = 4  # output rows per parallel task: their input rows are padded together


def is_depthwise(spec: Conv2dSpec) -> bool:
    """Whether ``spec`` runs through this schedule: one input channel per group."""
    return spec.groups > 1 and spec.groups == spec.c


def _row_tile(ow: int) -> int:
    """The output columns per vector: the whole row, or the widest piece that divides it,
    or (no divisor of at least ``ROW_VECTOR // 4``) pieces of ``ROW_VECTOR // 2`` with a
    clipped last one, whose predicate leaves that loop to LLVM's own vectorizer."""
    if ow <= ROW_VECTOR:
        return ow
    best = max(d for d in range(1, ROW_VECTOR + 1) if ow % d == 0)
    return best if best >= ROW_VECTOR // 4 else ROW_VECTOR // 2


def schedule_depthwise(spec: Conv2dSpec):
    """The scheduled IRModule of a depthwise ``spec``."""
    from tvm import s_tir

    sch = s_tir.Schedule(depthwise_compute(spec))
    out = sch.get_sblock("out")
    b, k, i, j = sch.get_loops(out)
    io, ii = sch.split(i, [None, min(ROW_BLOCK, spec.out_h)])
    jo, ji = sch.split(j, [None, _row_tile(spec.out_w)])
    # Not fused: the padding's rows must stay an affine function of their own loop for
    # decompose_padding, so the parallel loop is the channels' (always many in a depthwise
    # conv), outside the images.
    sch.reorder(k, b, io)
    sch.parallel(k)
    sch.vectorize(ji)
    for p in range(spec.stride[1]):
        x_pad = sch.get_sblock(f"x_pad{p}")
        if spec.padding == (0, 0) and spec.stride[1] == 1:  # a plain read: no copy
            sch.compute_inline(x_pad)
            continue
        task = sch.get_loops(out)[2]  # (the loop objects change with each decomposition)
        sch.compute_at(x_pad, task)
        sch.set_scope(x_pad, 0, "local")
        # compute_at leaves no loop for an extent of one: a single padded element stays
        # as it is (with its condition), else the fill and copy go under its first loop.
        loops = sch.get_loops(x_pad)
        if len(loops) == 3:
            continue
        blocks = [x_pad]
        if spec.padding != (0, 0):
            blocks.append(sch.decompose_padding(x_pad, loops[3]))
        for block in blocks:
            sch.vectorize(sch.get_loops(block)[-1])
    return sch.mod
