"""LLVM CPU schedules for the conv2d math of ``kernels/conv2d.py``.

"blocked" (groups == 1, or each group a whole number of channel blocks): a direct
convolution, no im2col. A block of ``kb = nvec * VEC`` output channels is computed together:
the kernel packs the weight so that, for one (c, r, s), those ``kb`` weights are ``nvec``
contiguous vectors, and a tile of ``wt`` output positions along the width keeps
``wt * nvec`` accumulator vectors in registers for the whole (c, r, s) reduction. Per step:
``nvec`` vector loads of weights, ``wt`` broadcasts of input values (an AVX-512 FMA takes the
broadcast as a memory operand), ``wt * nvec`` FMAs. The output width is padded to a multiple
of ``wt`` (the extra columns read zeros and are not stored) so the micro-kernel carries no
bounds check.

Parallel over tasks of (a chunk of images, a channel block[, a chunk of rows]), see
``blocked_tasks``: each task first packs its block's weights from torch's ``(K, C, R, S)``
into a task-local buffer (``kb * C * R * S`` values: it stays in L2 while the task runs), so
the pack is spread over the threads and never makes a round trip through memory. Measured
(1 thread, CPU time, Intel Xeon, ResNet-50 layers, batch 1 and 8, against the kernel fed a
weight packed beforehand by torch, the order of before): with the pack inside, -13% to +15%
against that kernel alone (the new task order reuses caches better); with the torch pack
before it, up to +126% (512 -> 512 channels 3x3 at 7x7, batch 1: 1.61 ms with the pack
inside, 1.62 ms for the kernel alone, 3.51 ms with the torch pack).

The blocked kernel over channels-last pixels (``Conv2dSpec.layout`` "nhwc", for a
channels_last input: ``channels_last_blocked``) is the same schedule on those layouts: the
reduction over (r, s, c), and each task's output tile stored as its vectors (no transpose).

"direct" (other groups): one output channel at a time, vectorised along the output width;
correct for any geometry, not tuned. Depthwise convs (one input channel per group) run
the schedule of ``schedules/cpu_depthwise.py`` instead.
"""

from __future__ import annotations

import dataclasses
import functools

from ..kernels.conv2d import Conv2dSpec, conv2d_compute, padded_input_width
from ..target import CpuInfo, host_cpu
from . import cpu_amx_conv, cpu_avx512_bf16, cpu_avx512_bf16_conv, cpu_depthwise_nhwc
from .cpu_depthwise import is_depthwise, schedule_depthwise

SCHEDULE_VERSION = 9  # bump when a schedule changes the binary: it is part of the cache key


def nhwc_kernel(spec: Conv2dSpec, cpu: CpuInfo | None = None):
    """The module of the bf16 implicit GEMM over channels-last pixels that ops/conv_ops.py
    runs ``spec`` as (``cpu_amx_conv`` on AMX tiles, ``cpu_avx512_bf16_conv`` on vdpbf16ps),
    or None (the 1x1 convs that are a GEMM per image stay so)."""
    cpu = cpu or host_cpu()
    if pointwise_as_gemm(spec, cpu):
        return None
    for module in (cpu_amx_conv, cpu_avx512_bf16_conv):
        if module.applies(spec, cpu):
            return module
    return None


# A 1x1, stride-1, unpadded conv is one GEMM per image: out[n] (K x P) = W (K x C) @ x[n]
# (C x P), P = OH * OW, and the GEMM kernel stores whole vectors along P, while the blocked
# kernel below stores its (channels x width) tile transposed, lane by lane, which dominates
# when the reduction over C is short: 56x56 64->256 99-129 vs 203-225 GFLOPS on 1 thread.
# With more channels the GEMM still wins where each image is enough work for the threads:
# its parallel loop runs over 64-wide panels of P, one image after the other, while the
# blocked kernel shares the images out. Measured (2 threads, Intel Xeon, + bias + relu,
# torch = 1, blocked / GEMM): batch 8, 56x56 256->64 0.91 / 1.23x, 144->24 1.26 / 1.61x,
# 28x28 512->128 0.86 / 0.93x, 128->512 1.02 / 1.09x; batch 1, 56x56 256->64 0.98 / 1.37x,
# 28x28 512->128 1.01 / 1.16x; but 28x28 192->32 (4.8 M multiply-adds an image) 1.28 / 0.81x
# and 144->32 1.35 / 0.85x at batch 8; at 14x14 (4 panels) 1024->256 0.87 / 0.78x, 256->1024
# 0.99 / 0.78x.
POINTWISE_GEMM_MAX_C = 64
POINTWISE_GEMM_MIN_P = 1024
POINTWISE_GEMM_MIN_WORK = 1 << 23  # multiply-adds per image (P x C x K), with P >= 784
POINTWISE_GEMM_MIN_WORK_P = 784


def pointwise_as_gemm(spec: Conv2dSpec, cpu: CpuInfo | None = None) -> bool:
    """Whether ops/conv_ops.py runs ``spec`` through the GEMM kernel (per image) instead.
    Every such bf16 conv where the GEMM runs on AMX tiles (``cpu_amx``): measured (1 thread,
    Intel Xeon, batch 1, against oneDNN's AMX conv) 1.8-1.9x at 56x56 256->64 and 14x14
    1024->256, where the fp32 conv kernel ran at 0.5x; and where it runs on vdpbf16ps
    (``cpu_avx512_bf16``), at twice the fp32 conv kernel's rate."""
    pointwise = (
        spec.r == spec.s == 1
        and spec.stride == (1, 1)
        and spec.padding == (0, 0)
        and spec.groups == 1
    )
    cpu = cpu or host_cpu()
    if pointwise and spec.dtype == "bfloat16" and (cpu.amx_bf16 or cpu_avx512_bf16.available(cpu)):
        return True
    p = spec.out_h * spec.out_w
    return pointwise and (
        (spec.c <= POINTWISE_GEMM_MAX_C and p >= POINTWISE_GEMM_MIN_P)
        or (p >= POINTWISE_GEMM_MIN_WORK_P and p * spec.c * spec.k >= POINTWISE_GEMM_MIN_WORK)
    )


# A conv with few output pixels (7x7: ResNet's last stage at 224x224) and much work runs as
# one GEMM over the patches of all images, ``(N*OH*OW, R*S*C) @ W^T`` (ops/conv_ops.py
# copies them): the blocked kernel's tile along the width and the per-image GEMM's 64-wide
# panels of pixels are mostly padding there, and one panel leaves the second thread idle,
# while the GEMM over patches has M = N*OH*OW rows and the weight's K as N. Measured through
# the op (2 threads, AMD EPYC Zen 5, + bias + relu, 8 channels_last weights cycled as in a
# model whose weights outgrow the L3, one process, torch = 1, conv kernel -> patches, the
# copies included): batch 1, 7x7 2048->512 1x1 0.81 -> 1.08x, 512->2048 0.62 -> 0.98x,
# 512->512 3x3 0.88 -> 1.26x; 14x14 -> 7x7 at stride 2 512->512 3x3 0.92 -> 1.28x,
# 1024->2048 1x1 0.77 -> 1.02x; batch 8, 0.61 -> 0.86x, 0.84 -> 0.91x, 0.81 -> 0.96x, 0.72
# -> 1.02x, 0.86 -> 1.06x. One weight, hot in cache: 0.78 -> 0.96x, 0.91 -> 0.89x, 1.21 ->
# 1.23x at batch 1. With less work an image the copies and the short GEMM lose: MobileNetV2's
# 7x7 convs (160->960, 960->160: 7.5 M multiply-adds) 1.08 -> 0.90x, 1.10 -> 0.71x; 3x3
# 128->128 1.19 -> 1.08x; and below 2^25 hot weights lose too (320->1280 1.45 -> 1.29x, 3x3
# 256->256 1.78 -> 1.55x) where cycled ones win (1.15 -> 1.33x, 1.29 -> 1.70x). At 14x14
# (196 pixels) the copies cost what the GEMM gains (a prototype: 1024->256 1.08 -> 0.88x).
PATCHES_GEMM_MAX_P = 64
PATCHES_GEMM_MIN_WORK = 1 << 25  # multiply-adds per image (OH x OW x C x K x R x S)


def patches_as_gemm(spec: Conv2dSpec) -> bool:
    """Whether ops/conv_ops.py may run ``spec`` as one GEMM over its patches: on the CPU,
    fp32, groups 1, at most PATCHES_GEMM_MAX_P output pixels and PATCHES_GEMM_MIN_WORK
    multiply-adds an image (ResNet's last stage)."""
    p = spec.out_h * spec.out_w
    work = p * spec.c * spec.k * spec.r * spec.s
    return (
        spec.device == "cpu"
        and spec.dtype == "float32"
        and spec.groups == 1
        and p <= PATCHES_GEMM_MAX_P
        and work >= PATCHES_GEMM_MIN_WORK
    )


def one_pixel_as_linear(spec: Conv2dSpec) -> bool:
    """Whether ops/conv_ops.py runs ``spec`` as a linear layer over the one pixel it reads: a
    1x1 conv, no padding, groups 1, one output pixel an image (the squeeze-and-excitation
    convs of EfficientNet, MobileNetV3, RegNetY, on pooled 1x1 images), where it is
    ``x[:, :, 0, 0] @ W^T`` exactly. The conv kernel packs its weight into channel blocks at
    every call for one output pixel. Measured in RegNetY-400MF at batch 1 (torchvision, 2
    threads, AMD EPYC Zen 5; hooks around the 16 SE convs, one process): conv kernel 32-65
    us a layer, 680-710 us in all; the linear op 16-24 us, 320-330 us; torch's conv 21-32 us,
    400-420 us."""
    return (
        spec.r == spec.s == 1
        and spec.padding == (0, 0)
        and spec.groups == 1
        and spec.out_h * spec.out_w == 1
    )


def untuned_groups(c: int, k: int, groups: int, dtype: str, cpu: CpuInfo | None = None) -> bool:
    """Whether a grouped conv runs the untuned "direct" kernel here where torch's is faster,
    which the model fusion leaves to torch: grouped, not depthwise, K / groups no whole number
    of MIN_GROUP_LANES-lane vectors (``group_lanes``) and, in float32, more than
    DIRECT_MAX_GROUP_WIDTH channels. Narrower groups are where oneDNN has no good kernel
    either: 3x3, 2 threads, AMD EPYC Zen 5, direct kernel + ReLU against
    ``F.relu(F.conv2d)``, batch 1 / 8: groups of 2
    channels 3.95-6.26x / 3.99-6.05x, of 3 2.09-5.42x / 1.51-3.93x, of 6 1.79-2.98x /
    1.26-2.08x, of 10 1.22x / 1.18x; of 14 0.89x / 0.84x, of 30 0.46x / 0.41x, of 50 0.20x /
    0.14x. (Before the blocked kernel took half vectors, RegNet's groups of 8 ran the direct
    kernel: timm's regnetx_002 converted with them 1.04x / 0.71x eager on an Intel Xeon.)"""
    cpu = cpu or host_cpu()
    if groups in (1, c) or group_lanes(c, k, groups, dtype, cpu) is not None:
        return False
    # (measured in float32 only: other dtypes keep the rule from before, all to torch)
    return dtype != "float32" or k // groups > DIRECT_MAX_GROUP_WIDTH


DIRECT_MAX_GROUP_WIDTH = 10  # see untuned_groups
MIN_GROUP_LANES = 4  # see group_lanes


def _vec(spec: Conv2dSpec, cpu: CpuInfo) -> int:
    return group_lanes(spec.c, spec.k, spec.groups, spec.acc_dtype, cpu) or _lanes(
        spec.acc_dtype, cpu
    )


def _lanes(dtype: str, cpu: CpuInfo) -> int:
    return cpu.vector_bytes // (8 if dtype == "float64" else 4)


def group_lanes(c: int, k: int, groups: int, dtype: str, cpu: CpuInfo) -> int | None:
    """The vector width of a grouped (not depthwise) conv's blocked kernel: the widest of a
    whole vector, half of one or a quarter that divides K / groups (at least MIN_GROUP_LANES
    lanes); None where none does (the "direct" kernel) or the conv is not grouped."""
    if groups == 1 or groups == c:
        return None
    lanes, kg = _lanes(dtype, cpu), k // groups
    while lanes >= MIN_GROUP_LANES and kg % lanes:
        lanes //= 2
    return lanes if lanes >= MIN_GROUP_LANES else None


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@functools.lru_cache(maxsize=4096)  # asked on every call of the op: ~30 us to compute
def blocked_tile(spec: Conv2dSpec, cpu: CpuInfo) -> tuple[int, int] | None:
    """(wt, nvec) for the "blocked" variant, or None when it does not apply.

    Chooses the tile with the most FMAs per loaded vector (``wt * nvec / (wt + nvec)``),
    discounted by the work wasted on padded output columns and channels, with at most
    ``MAX_ACC`` accumulators. Measured on Zen 5 (fp32, ResNet-50 3x3 layers): 14
    accumulators (7 x 2 vectors) beat 21, 24 and 28 (7x3, 12x2, 7x4: 0.45-0.8x the speed),
    which leave LLVM too few registers for weights and addresses. Re-measured single-threaded
    (CPU time of the calling thread, TVM_NUM_THREADS=1, ResNet-50 3x3 layers, batch 1 and 8):
    7x2 245-256 GFLOPS (near this core's FMA peak), 6x3 129-203, 7x3 158-240, 4x4 161-234,
    14x1 123-252; on the 1x1 layers 7x2 also won (199-247 GFLOPS) except 64->256 channels at
    56x56 (14x1: 150 vs 133, the write-back transpose dominates at C=64).
    """
    vec = _vec(spec, cpu)
    max_acc = 14 if cpu.vector_registers >= 32 else 6
    kg = spec.k // spec.groups
    best, best_score = None, 0.0
    for nvec in (2, 1):
        kb = nvec * vec
        if spec.groups > 1 and kg % kb:
            continue
        if spec.layout == "nhwc" and spec.k % kb:  # (its output tile is stored as vectors)
            continue
        for wt in range(1, max_acc // nvec + 1):
            useful = (spec.out_w / _ceil_to(spec.out_w, wt)) * (spec.k / _ceil_to(spec.k, kb))
            score = useful * wt * nvec / (wt + nvec)
            if score > best_score + 1e-9:
                best, best_score = (wt, nvec), score
    return best


# A task of the "blocked" kernel packs one block of output channels' weights and computes
# them over a chunk of images (and, for large images, of output rows) that stays in L2.
TASK_PIXELS = 1024  # output pixels per task at least, when a task is a chunk of rows


MIN_BLOCKS_FOR_IMAGE_CHUNKS = 8  # channel blocks below which each task takes one image


@functools.lru_cache(maxsize=4096)
def blocked_tasks(spec: Conv2dSpec, cpu: CpuInfo) -> tuple[int, int]:
    """(images, rows) per parallel task of the "blocked" kernel.

    ``images``: a power of two (so that usual batch sizes split evenly over the threads)
    such that that many padded input images take at most half of L2: consecutive tasks of
    a thread run the channel blocks over the same images, which then come from L2, and each
    task packs its block's weights once for them. ``rows``: the output rows of one task;
    fewer than the image's when an image has enough pixels to pay for packing a block again
    (more tasks to balance over the threads).
    """
    wt, nvec = blocked_tile(spec, cpu)
    acc_bytes = 8 if spec.acc_dtype == "float64" else 4
    hp = (spec.out_h - 1) * spec.stride[0] + (spec.r - 1) * spec.dilation[0] + 1
    image = spec.c * hp * padded_input_width(spec, wt) * acc_bytes
    images = 1
    # With few channel blocks the images are what the threads share (the batch is not known
    # here): one image per task. Seen: 16 -> 32 channels at 32x32, batch 8, all 8 images in
    # one task of one block ran on one thread, 0.61x torch.
    few_blocks = -(-spec.k // (nvec * _vec(spec, cpu))) < MIN_BLOCKS_FOR_IMAGE_CHUNKS
    while not few_blocks and images * 2 * image <= cpu.l2_bytes // 2 and images < 64:
        images *= 2
    rows = spec.out_h
    if images == 1 and spec.out_h * spec.out_w >= 2 * TASK_PIXELS:
        chunks = spec.out_h * spec.out_w // TASK_PIXELS
        rows = -(-spec.out_h // chunks)
    return images, rows


def schedule_conv2d(spec: Conv2dSpec, cpu: CpuInfo | None = None, tile=None):
    """The scheduled IRModule for ``spec`` on this CPU (``tile`` overrides (wt, nvec))."""
    from tvm import s_tir

    cpu = cpu or host_cpu()
    if spec.layout == "nhwc" and spec.groups == spec.c == spec.k:
        return cpu_depthwise_nhwc.schedule_depthwise_nhwc(spec, cpu)
    nhwc = nhwc_kernel(spec, cpu) if tile is None and spec.layout == "nchw" else None
    if nhwc is cpu_amx_conv:
        return cpu_amx_conv.schedule_conv2d_amx(spec)
    if nhwc is cpu_avx512_bf16_conv:
        return cpu_avx512_bf16_conv.schedule_conv2d_dp(spec)
    vec = _vec(spec, cpu)
    tile = tile or blocked_tile(spec, cpu)
    if tile is None and is_depthwise(spec):
        return schedule_depthwise(spec)
    if tile is None:
        sch = s_tir.Schedule(conv2d_compute(spec, ow_tile=vec))
        _schedule_direct(sch, spec, vec)
    else:
        wt, nvec = tile
        sch = s_tir.Schedule(conv2d_compute(spec, ow_tile=wt, k_block=nvec * vec))
        _schedule_blocked(sch, spec, wt, vec, *blocked_tasks(spec, cpu))
    return sch.mod


def _schedule_x_pad(sch, spec: Conv2dSpec, ow_tile: int) -> None:
    """Inline the input stage when it is a plain read; else a parallel copy before the conv.

    A padded copy costs one pass over the input, against about R*S*K FMAs per input element;
    reading the unpadded input in place would put a bounds check in the micro-kernel.
    """
    x_pad = sch.get_sblock("x_pad")
    plain = (
        spec.padding == (0, 0)
        and spec.dtype == spec.acc_dtype
        and padded_input_width(spec, ow_tile) <= spec.w
    )
    if plain:
        sch.compute_inline(x_pad)
        return
    b, outer, *_ = sch.get_loops(x_pad)  # (b, c, i, j), or (b, i, j, c) channels-last
    sch.parallel(sch.fuse(b, outer))


def _schedule_blocked(sch, spec: Conv2dSpec, wt: int, vec: int, images: int, rows: int) -> None:
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    _schedule_x_pad(sch, spec, wt)

    # (the reduction: over (c, r, s), or (r, s, c) channels-last)
    b, ko, i, j, ki, *reduction = sch.get_loops(acc)
    jo, ji = sch.split(j, [None, wt])
    kio, kii = sch.split(ki, [None, vec])
    bo, bi = sch.split(b, [None, images])
    if rows < spec.out_h:
        io, ii = sch.split(i, [None, rows])
        sch.reorder(bo, ko, io, bi, ii, jo, *reduction, ji, kio, kii)
        task = sch.fuse(bo, ko, io)
    else:
        sch.reorder(bo, ko, bi, i, jo, *reduction, ji, kio, kii)
        task = sch.fuse(bo, ko)
    sch.set_scope(acc, 0, "local")
    epi = sch.get_sblock("epi")
    sch.set_scope(epi, 0, "local")
    sch.reverse_compute_at(epi, jo)
    sch.reverse_compute_at(out, jo)
    sch.parallel(task)
    sch.unroll(ji)
    sch.unroll(kio)
    sch.vectorize(kii)
    sch.decompose_reduction(acc, reduction[0])
    _schedule_vector_epilogue(sch, epi, vec)
    if spec.layout == "nhwc":
        _schedule_vector_epilogue(sch, out, vec)  # channels last: the tile's vectors as they are
    else:
        _schedule_epilogue(sch, out)
    _schedule_pack(sch, task, spec.weight_pack == "call")


@functools.lru_cache(maxsize=4096)  # asked on every call of the op
def channels_last_blocked(spec: Conv2dSpec, cpu: CpuInfo | None = None) -> bool:
    """Whether the blocked kernel runs ``spec`` (an NCHW spec) over channels-last pixels
    (layout "nhwc": input and output read and written as a channels_last model hands them
    over): float32 on the CPU, not depthwise, whole blocks of output channels. Else a
    channels_last input is copied to NCHW and the output back, which cost more than the conv
    on small images. Measured (2 threads, AMD EPYC Zen 5, + bias + relu, against
    ``F.relu(F.conv2d)`` in channels_last; copies and NCHW kernel -> this kernel), batch 1 / 8:
    ResNet-50's 3x3 convs 64 at 56x56 0.87 -> 1.18x / 0.81 -> 1.25x, 128 at 28x28 0.92 ->
    1.12x / 0.83 -> 1.00x, 256 at 14x14 1.19 -> 1.41x / 0.88 -> 0.97x, 128 at 56x56 stride 2
    0.74 -> 1.14x / 0.57 -> 0.93x; its 7x7 stem 0.73 -> 1.27x / 0.66 -> 1.30x."""
    cpu = cpu or host_cpu()
    return (
        spec.device == "cpu"
        and spec.dtype == "float32"
        and spec.groups != spec.c
        and blocked_tile(dataclasses.replace(spec, layout="nhwc"), cpu) is not None
    )


def weight_pack(spec: Conv2dSpec, batch: int, cpu: CpuInfo | None = None) -> str:
    """The ``weight_pack`` of the blocked kernel for ``batch`` images: "call" where a block of
    output channels has tasks for more than one chunk of images (each would pack the block
    again), else "task". Measured (2 threads, AMD EPYC Zen 5, + bias + relu, time per call /
    per task): batch 8, 1x1 at 7x7 1152 -> 192 0.72, 960 -> 160 0.73, 440 -> 440 0.96,
    672 -> 112 at 14x14 0.89, 3x3 512 -> 512 at 7x7 0.91, 256 -> 256 at 14x14 0.94, 64 -> 64
    at 56x56 0.95; batch 1 (one task a block): 1.02-1.10, the packed weight's round trip
    through memory."""
    cpu = cpu or host_cpu()
    blocked = (
        spec.device == "cpu"
        and (spec.layout == "nhwc" or nhwc_kernel(spec, cpu) is None)
        and blocked_tile(spec, cpu) is not None
    )
    if not blocked:
        return "task"
    images, _ = blocked_tasks(spec, cpu)
    return "call" if batch > images else "task"


def _schedule_pack(sch, task, per_call: bool) -> None:
    """Pack the weight by blocks of output channels, by tiles of 16 (c, r, s): each task its
    block at its start, or (``per_call``) all blocks first, in parallel.

    The block is a ``(kb, C*R*S)`` -> ``(C*R*S, kb)`` transpose. Row by row (reading along
    C*R*S) every write lands on another cache line; column by column the ``kb`` reads, a
    multiple of 4 KB apart, fall into a few L1 sets and evict each other. By tiles, the reads
    run along rows and the writes stay in 16 lines. Measured (1 thread, 512 -> 512 channels
    3x3 at 7x7, batch 1): tiles 1.56 ms, rows 4.31 ms, columns 1.69 ms.
    """
    w_pack = sch.get_sblock("w_pack")
    if per_call:
        block, *crs_loops, ki = sch.get_loops(w_pack)
        sch.parallel(block)
    else:
        sch.compute_at(w_pack, task)
        *crs_loops, ki = sch.get_loops(w_pack)[1:]  # (c, r, s, ki) under the task loop
    if not crs_loops:  # (C * R * S = 1, one input channel 1x1: TVM keeps no loop of one)
        return
    crs = sch.fuse(*crs_loops) if len(crs_loops) > 1 else crs_loops[0]
    tile, inner = sch.split(crs, [None, 16])
    sch.reorder(tile, ki, inner)
    sch.unroll(inner)


def _schedule_vector_epilogue(sch, epi, vec: int) -> None:
    """Bias and activation on the (wt x kb) accumulator tile, vectors along the channels."""
    *_, j, ki = sch.get_loops(epi)
    kio, kii = sch.split(ki, [None, vec])
    sch.unroll(j)
    sch.unroll(kio)
    sch.vectorize(kii)


def _schedule_epilogue(sch, out) -> None:
    """Fully unroll the write-back of a (kb x wt) tile.

    The accumulators are vectors along channels, ``out`` is contiguous along the width: the
    write-back is a transpose. Unrolled, LLVM keeps the accumulators in registers and
    extracts lanes; as a loop it spilled them and re-computed indices per element, which
    cost ~16 cycles per output and made convs with small C*R*S 2-5x slower (measured:
    16->32 channels 3x3 at 32x32, 39 -> 195 GFLOPS).
    """
    from tvm import tirx

    for loop in sch.get_loops(out)[-2:]:
        # A clipped tile (K smaller than a block) can have a non-constant extent.
        if isinstance(sch.get(loop).extent, tirx.IntImm):
            sch.unroll(loop)


def _schedule_direct(sch, spec: Conv2dSpec, vec: int) -> None:
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    _schedule_x_pad(sch, spec, vec)
    if spec.dtype == spec.acc_dtype:
        sch.compute_inline(sch.get_sblock("w_pack"))
    else:
        sch.parallel(sch.get_loops(sch.get_sblock("w_pack"))[0])
    b, k, i, j, rc, rr, rs = sch.get_loops(acc)
    jo, ji = sch.split(j, [None, vec])
    sch.reorder(b, k, i, jo, rc, rr, rs, ji)
    sch.set_scope(acc, 0, "local")
    sch.reverse_compute_at(out, jo)
    sch.parallel(sch.fuse(b, k, i))
    sch.vectorize(ji)
    sch.decompose_reduction(acc, rc)
