"""LLVM CPU schedule of the channels-last depthwise conv (``kernels/conv2d_depthwise_nhwc.py``).

For a channels_last input the NCHW kernels need the input copied to NCHW and the output
back: those two copies cost 3-16x the conv (MobileNetV2 in channels_last at batch 8, 2
threads, AMD EPYC Zen 5: 40% of the converted model's time in copies, 0.58x eager). Here
the vector runs along the channels: parallel over (image, output row), a tile of
``_width_tile`` output pixels by one vector of channels in registers, the R x S taps unrolled,
each tap in the padding read as zero by a condition (no padded copy). Against torch's
channels_last conv (oneDNN; 2 threads, AMD EPYC Zen 5, + SiLU): 3x3 at 1.2-1.9x, 5x5 at
0.5-0.96x (25 conditions a pixel: a padded copy of each task's rows would remove them).
"""

from __future__ import annotations

from ..kernels.conv2d import Conv2dSpec
from ..kernels.conv2d_depthwise_nhwc import depthwise_nhwc_compute
from ..target import CpuInfo

SCHEDULE_VERSION = 3  # bump when the schedule changes the binary: it is part of the cache key


def applies(spec: Conv2dSpec, cpu: CpuInfo) -> bool:
    """Whether a channels_last depthwise ``spec`` runs here: float32, one output channel per
    input channel, whole vectors of channels."""
    vec = cpu.vector_bytes // 4
    return (
        spec.device == "cpu"
        and spec.dtype == "float32"
        and spec.groups == spec.c == spec.k
        and spec.c % vec == 0
    )


def _width_tile(out_w: int) -> int:
    """Output pixels per register tile: a row of 7 whole (the last stage at 224x224), else 4.
    Measured (2 threads, AMD EPYC Zen 5, against torch's channels_last conv + SiLU): 3x3 at
    56x56, 144 channels, batch 8, tiles of 8 -> 4: 1.29 -> 1.88x; 5x5 at 14x14, 672
    channels 0.47 -> 0.52x; at 7x7, 1152 channels, a row of 7 0.90x, tiles of 4 0.68x."""
    return 7 if out_w == 7 else 4


def schedule_depthwise_nhwc(spec: Conv2dSpec, cpu: CpuInfo):
    """The scheduled IRModule of ``spec`` (layout "nhwc")."""
    from tvm import s_tir

    sch = s_tir.Schedule(depthwise_nhwc_compute(spec))
    out = sch.get_sblock("out")
    b, i, j, c = sch.get_loops(out)
    jo, ji = sch.split(j, [None, _width_tile(spec.out_w)])
    co, ci = sch.split(c, [None, cpu.vector_bytes // 4])
    sch.reorder(b, i, jo, co, ji, ci)
    sch.parallel(sch.fuse(b, i))
    sch.unroll(ji)
    sch.vectorize(ci)
    acc = sch.get_sblock("acc")  # the tile's sums, in registers
    sch.compute_at(acc, co)
    sch.set_scope(acc, 0, "local")
    ai, aj = sch.get_loops(acc)[-2:]
    sch.unroll(ai)
    sch.vectorize(aj)
    return sch.mod
