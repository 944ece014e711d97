"""LLVM CPU schedule of the depthwise conv2d math of ``kernels/conv2d_depthwise.py``.

A depthwise conv does R*S FMAs per output and reads each input about once: it is bound by
loads and by whatever runs per element besides the FMAs. So:

- Parallel over output channels, each task running its channel over every image, or over
  (image, channel) pairs, images outermost, on larger images (``images_outside``). Per
  block of output rows, a task zero-pads the input rows it reads into a small local buffer,
  split by column phase (at stride 2 a vector of outputs then reads contiguous input); the
  padding is two vectorized loops (a fill, then the in-bound rows copied), no condition
  per element.
- An output row (up to ``ROW_VECTOR`` columns) is one vector: LLVM splits it into whole
  registers plus one part-register, so no width is padded or masked and every row stays
  in registers for its R*S taps; bias and activation are applied to that row once.
  Wider rows are cut into ``ROW_VECTOR``-column pieces.
"""

from __future__ import annotations

from ..kernels.conv2d import Conv2dSpec
from ..kernels.conv2d_depthwise import depthwise_compute, row_width, tap_phases

SCHEDULE_VERSION = 11  # bump when the schedule changes the binary: it is part of the cache key

ROW_VECTOR = 128  # the widest output row kept as one vector (8 AVX-512 registers of fp32)
LLVM_PHASE_SPLIT_MIN_W = 48  # input width from which LLVM vectorizes the phase split
ROW_BLOCK = 16  # output rows per parallel task: their input rows are padded together
CHANNELS_OUTSIDE_MAX_PIXELS = 14 * 14  # see images_outside


LOCAL_MAX_BYTES = 512 << 10  # a task's padded rows live on its thread's stack


def is_depthwise(spec: Conv2dSpec) -> bool:
    """Whether ``spec`` runs through this schedule: one input channel per group, and the
    padded input rows of one task small enough for the stack (else the "direct" kernel of
    ``cpu_conv2d``, which pads into one buffer on the heap)."""
    return spec.groups > 1 and spec.groups == spec.c and _local_bytes(spec) <= LOCAL_MAX_BYTES


def _local_bytes(spec: Conv2dSpec) -> int:
    (sh, sw), dh = spec.stride, spec.dilation[0]
    rows = (min(ROW_BLOCK, spec.out_h) - 1) * sh + (spec.r - 1) * dh + 1
    cols = (row_width(spec) + (spec.s - 1) * spec.dilation[1] // sw) * sw
    copies = 2 if _split_after_pad(spec) else 1  # the padded row and its phases
    return rows * cols * copies * (8 if spec.acc_dtype == "float64" else 4)


def _split_after_pad(spec: Conv2dSpec) -> bool:
    return spec.stride[1] > 1 and spec.w >= LLVM_PHASE_SPLIT_MIN_W


def _row_tile(ow: int) -> int:
    """The output columns per vector: the whole row, or the widest piece that divides it,
    or (no divisor of at least ``ROW_VECTOR // 4``) pieces of ``ROW_VECTOR // 2`` with a
    clipped last one, whose predicate leaves that loop to LLVM's own vectorizer."""
    if ow <= ROW_VECTOR:
        return ow
    best = max(d for d in range(1, ROW_VECTOR + 1) if ow % d == 0)
    return best if best >= ROW_VECTOR // 4 else ROW_VECTOR // 2


def schedule_depthwise(spec: Conv2dSpec, row_block: int = ROW_BLOCK):
    """The scheduled IRModule of a depthwise ``spec`` (``row_block``: output rows per task)."""
    from tvm import s_tir

    # The phase split (stride > 1) reads the padded row with a stride. TVM's vectorizer
    # loads each lane by itself; LLVM's loop vectorizer, given a serial loop over a padded
    # row, makes whole-vector loads and shuffles, which wins on long rows only (measured,
    # stride 2, 2 threads: 1.1-1.35x faster at 112 and 56 input columns; at 28 and 14 the
    # extra pass made it 0.7-0.8x, there the phases are padded from x directly).
    sw = spec.stride[1]
    split_after_pad = _split_after_pad(spec)
    sch = s_tir.Schedule(depthwise_compute(spec, split_after_pad))
    out = sch.get_sblock("out")
    b, k, i, j = sch.get_loops(out)
    io, ii = sch.split(i, [None, min(row_block, spec.out_h)])
    jo, ji = sch.split(j, [None, _row_tile(spec.out_w)])
    if images_outside(spec):
        sch.parallel(sch.fuse(b, k))
    else:
        sch.reorder(k, b, io)
        sch.parallel(k)
    if row_width(spec) != spec.out_w:  # each row computed wider, its columns copied
        # The task's rows computed together, the row loop unrolled: a row of one register
        # is one chain of R*S dependent FMAs, and the rows' chains now interleave (measured,
        # time against a row at a time: 7 columns 0.84-0.93, 14 columns 0.93-0.99).
        rows = sch.get_sblock("out_row")
        sch.compute_at(rows, io)
        sch.set_scope(rows, 0, "local")
        row_loop, col_loop = sch.get_loops(rows)[-2:]
        sch.vectorize(col_loop)
        sch.unroll(row_loop)
    sch.vectorize(ji)
    if sw > 1:
        for p in tap_phases(spec):
            phase = sch.get_sblock(f"x_phase{p}")
            if split_after_pad:  # serial: LLVM vectorizes it
                _local_at_task(sch, phase, out, spec)
            else:
                _pad_at_task(sch, phase, out, spec)
    if sw == 1 or split_after_pad:
        x_pad = sch.get_sblock("x_pad")
        if spec.padding == (0, 0):  # nothing to pad: a plain read
            sch.compute_inline(x_pad)
        else:
            _pad_at_task(sch, x_pad, out, spec)
    return sch.mod


def images_outside(spec: Conv2dSpec) -> bool:
    """Whether the parallel loop is over (image, channel), images outermost, rather than over
    the channels with each task running its channel over every image. Measured (batch 8,
    + bias + SiLU, time images outside / channels outside, 1 and 2 threads alike): 56x56
    3x3 0.60-0.68, 28x28 5x5 0.97-0.98, 14x14 5x5 1.08-1.21, 14x14 3x3 1.09-1.16, 7x7 5x5
    1.25-1.33. On small images a task of one channel of one image is a few hundred FMAs,
    and one task running a channel over every image keeps that channel's taps in registers.
    On large ones, a thread's tasks writing whole images in order is what the caches and
    prefetchers like best (why it gains this much was not pinned down)."""
    return spec.out_h * spec.out_w > CHANNELS_OUTSIDE_MAX_PIXELS


def _local_at_task(sch, block, out, spec: Conv2dSpec) -> None:
    """Compute ``block`` per parallel task (the row-block loop of ``out``), in a local buffer."""
    row_block_loop = 1 if images_outside(spec) else 2  # (after the task's loop, and b's)
    sch.compute_at(
        block, sch.get_loops(out)[row_block_loop]
    )  # (loop objects change as blocks move)
    sch.set_scope(block, 0, "local")


def _pad_at_task(sch, block, out, spec: Conv2dSpec) -> None:
    """A padding stage per task: a vectorized fill of zeros, then a vectorized copy of the
    in-bound part (no condition per element)."""
    from tvm import s_tir

    _local_at_task(sch, block, out, spec)
    loops = sch.get_loops(block)
    # compute_at leaves no loop for an extent of one: a single padded element stays as it
    # is (with its condition), else the fill and the copy go under its first loop.
    if len(loops) == 3:
        return
    blocks = [block]
    if spec.padding != (0, 0):
        try:
            blocks.append(sch.decompose_padding(block, loops[3]))
        except s_tir.ScheduleError:
            # Tiny images (a row of the block at an extent of one, merged into the task's
            # binding) do not match the pattern: their few elements keep the condition.
            return
    for b in blocks:
        _vectorize_row(sch, sch.get_loops(b)[-1])


def _vectorize_row(sch, loop) -> None:
    """Vectorize a row loop whole, or in ``_row_tile`` pieces when it is wider than
    ``ROW_VECTOR`` (TVM counts a vector's lanes in 16 bits)."""
    extent = sch.get(loop).extent.value
    if extent == 0:  # (a column phase with no input column in bounds: no copy at all)
        return
    if extent > ROW_VECTOR:
        loop = sch.split(loop, [None, _row_tile(extent)])[1]
    sch.vectorize(loop)
