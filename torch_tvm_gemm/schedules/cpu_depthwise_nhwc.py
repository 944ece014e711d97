"""LLVM CPU schedule of the channels-last depthwise conv (``kernels/conv2d_depthwise_nhwc.py``).

For a channels_last input the NCHW kernels need the input copied to NCHW and the output
back: those two copies cost 3-16x the conv (MobileNetV2 in channels_last at batch 8, 2
threads, AMD EPYC Zen 5: 40% of the converted model's time in copies, 0.58x eager). Here
the vector runs along the channels: parallel over (image, output row), a tile of
``_width_tile`` output pixels by one vector of channels in registers, the R x S taps unrolled
(for a 5x5, and in bf16, on a padded float32 copy of the task's input rows: ``_row_block``).
"""

from __future__ import annotations

from ..kernels.conv2d import Conv2dSpec
from ..kernels.conv2d_depthwise_nhwc import depthwise_nhwc_compute
from ..target import CpuInfo

SCHEDULE_VERSION = 5  # bump when the schedule changes the binary: it is part of the cache key


def applies(spec: Conv2dSpec, cpu: CpuInfo) -> bool:
    """Whether a channels_last depthwise ``spec`` runs here: float32 or bfloat16, one output
    channel per input channel, whole (float32) vectors of channels, or half vectors."""
    return (
        spec.device == "cpu"
        and spec.dtype in ("float32", "bfloat16")
        and spec.groups == spec.c == spec.k
        and channel_lanes(spec, cpu) is not None
    )


def channel_lanes(spec: Conv2dSpec, cpu: CpuInfo) -> int | None:
    """The kernel's vector of channels: a whole register of float32 where the channels are a
    multiple of it, else half of one (MobileNetV3's 72, 120, 184 and 200 channels on
    AVX-512, which went through NCHW copies: 0.77x channels_last eager at batch 8), else
    None."""
    lanes = cpu.vector_bytes // 4
    for vec in (lanes, lanes // 2):
        if vec >= 4 and spec.c % vec == 0:
            return vec
    return None


def _width_tile(out_w: int) -> int:
    """Output pixels per register tile: a row of 7 whole (the last stage at 224x224), else 4.
    Measured (2 threads, AMD EPYC Zen 5, against torch's channels_last conv + SiLU): 3x3 at
    56x56, 144 channels, batch 8, tiles of 8 -> 4: 1.29 -> 1.88x; 5x5 at 14x14, 672
    channels 0.47 -> 0.52x; at 7x7, 1152 channels, a row of 7 0.90x, tiles of 4 0.68x."""
    return 7 if out_w == 7 else 4


# Taps above a 3x3's 9 read a copy of each task's input rows with their zero border, made
# per task (ROW_BLOCK output rows): no condition per tap. Kernels alone against torch's
# channels_last conv + SiLU (2 threads, AMD EPYC Zen 5), conditions -> padded rows: 5x5 at
# 28x28, 240 channels, batch 1 / 8 0.68 / 0.47x -> 1.29 / 1.02x; 14x14, 672 channels 0.86 /
# 0.54x -> 1.27 / 0.89x; 7x7, 1152 channels 1.44x -> 2.36x. A 3x3 loses a little to the copy
# (56x56, 144 channels, batch 8: 1.92x -> 1.57x) and keeps the conditions. bfloat16 always
# reads the copy, converted to float32 once per element there: its taps' bf16 loads in place
# were not vectorized (0.26-0.40x torch's bf16 conv; with the copy 3x3 1.05-1.12x, 5x5
# 0.58-0.96x).
PAD_STAGE_MIN_TAPS = 10
ROW_BLOCK = 4
LOCAL_MAX_BYTES = 512 << 10  # the padded rows of a task, in its thread's local buffer


def _padded_rows(spec: Conv2dSpec, rows: int) -> int:
    return (rows - 1) * spec.stride[0] + (spec.r - 1) * spec.dilation[0] + 1


def _row_block(spec: Conv2dSpec) -> int | None:
    """Output rows per task with a padded copy of their input rows, or None (conditions)."""
    few_taps = spec.r * spec.s < PAD_STAGE_MIN_TAPS or spec.padding == (0, 0)
    if spec.dtype == "float32" and few_taps:
        return None
    row_bytes = (spec.w + 2 * spec.padding[1]) * spec.c * 4
    for rows in (min(ROW_BLOCK, spec.out_h), 1):
        if _padded_rows(spec, rows) * row_bytes <= LOCAL_MAX_BYTES:
            return rows
    return None


def schedule_depthwise_nhwc(spec: Conv2dSpec, cpu: CpuInfo):
    """The scheduled IRModule of ``spec`` (layout "nhwc")."""
    from tvm import s_tir

    rows = _row_block(spec)
    vec = channel_lanes(spec, cpu)
    sch = s_tir.Schedule(depthwise_nhwc_compute(spec, pad_stage=rows is not None))
    out = sch.get_sblock("out")
    b, i, j, c = sch.get_loops(out)
    io, ii = sch.split(i, [None, rows or 1])
    jo, ji = sch.split(j, [None, _width_tile(spec.out_w)])
    co, ci = sch.split(c, [None, vec])
    sch.reorder(b, io, ii, jo, co, ji, ci)
    task = sch.fuse(b, io)
    sch.parallel(task)
    sch.unroll(ji)
    sch.vectorize(ci)
    acc = sch.get_sblock("acc")  # the tile's sums, in registers
    sch.compute_at(acc, co)
    sch.set_scope(acc, 0, "local")
    ai, aj = sch.get_loops(acc)[-2:]
    sch.unroll(ai)
    sch.vectorize(aj)
    if rows is not None:  # the task's rows, padded, in a local buffer; vectors of channels
        x_pad = sch.get_sblock("x_pad")
        sch.compute_at(x_pad, sch.get_loops(out)[0])
        sch.set_scope(x_pad, 0, "local")
        sch.vectorize(sch.split(sch.get_loops(x_pad)[-1], [None, vec])[1])
    return sch.mod
