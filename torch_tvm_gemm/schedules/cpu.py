"""LLVM CPU schedules for the GEMM math of ``kernels/gemm.py``.

"gemm" (any M): the GotoBLAS idea in TensorIR. M is padded to a multiple of MR and N to a
multiple of NR (``pad_einsum``), B is packed into panels ``[N/NR, K, NR]`` so the inner loop
streams it contiguously, and an MR x NR accumulator tile lives in vector registers while the
whole K loop runs: per k, MR broadcasts of A and NR/VEC vector loads of B feed MR*NR/VEC FMAs.
Padding M matters: a predicate on M inside the micro-kernel stops LLVM from keeping the
accumulators in registers (measured: 0.45x torch with the predicate, 1.15x without).

"gemv" (small M, e.g. batch-1 inference): memory-bound on B, so B is read in place, never
packed (packing would double the traffic). Layout "nk" (a Linear weight) is a set of dot
products vectorised along K; layout "kn" streams whole rows of B, each row read once for all
rows of A (``_schedule_gemv_kn``); at M <= 4 and N >= 1024 the float32 "ksplit" variant splits
K instead of N among the tasks, each reading whole rows (``cpu_gemv.py``).

"dot" (layout "nk", 2 <= M <= DOT_MAX_M: a Linear at a few tokens): the weight read in place
too, as dot products along K, register-blocked: a tile of 4 rows of A by 6 rows of the weight
keeps 24 vector accumulators, fed per K step by 10 vector loads, and the VEC lanes of each are
summed once at the end. At these M, packing the weight on every call costs as much as the math
(docs/inference-shapes.md has the measurements). "dot2" is the same kernel with a 2-row tile,
for M = 2.

"swap" (layout "nk", float32, static K, M from 56 to 64 rows): the product as
(W @ x^T)^T. Here the weight takes A's place: its rows are read in place by broadcasts, six at
a time, and the activations are packed instead, into panels of 64 rows ``[M/64, K, 64]``,
which the vector loads stream. The packed kernel packs the weight, N x K values, on every
call; this one packs x, M x K: at M = 64, N = K = 4096, 1/64 of it. Its output tiles are 6
columns by 64 rows of the result; M is padded to whole panels, so an M far from a multiple
of 64 wastes rows (M = 96 computes 128: 0.82-0.91x torch, where the packed kernel is at 1.0x),
and from two panels on the packed kernel is as fast or faster (M = 120, 128: 0.85-1.05x
torch against 0.95-1.10x). "swap32" (M from 24 to 32) and "swap48" (M from 40 to 48) are the
same kernel with one panel of 32 / 48 rows and tiles of 12 / 8 columns by the panel's rows.

"rows" (float32, static K, M from 512 on): the packed kernel with its parallel tasks
split by rows instead: each thread takes half of the rows of A (M padded to two register
tiles, so the halves are whole tiles) and every panel of B, which it packs itself
(``ROWS_MIN_M``).

A static K past the L2 threshold (``k_chunk``) runs the packed kernel over K chunks
(``kernels/gemm_kblocked.py``).

bfloat16 on a CPU with AMX tiles: the "gemm" and "dot" variants run ``cpu_amx.py`` instead,
its "dot" up to AMX_DOT_MAX_M rows (``amx_dot_limits``).
"""

from __future__ import annotations

from ..kernels.gemm import GemmSpec, batched_gemm_compute, gemm_compute
from ..kernels.gemm_kblocked import kblocked_gemm_compute
from ..target import CpuInfo, host_cpu
from . import (
    cpu_amx,
    cpu_avx512_bf16,
    cpu_gemv,
    cpu_pack_prefetch,
    cpu_tail_tile,
    cpu_tile_store,
    cpu_transpose,
)
from .cpu_gemv import KSPLIT_MAX_M, KSPLIT_MIN_N, KSPLIT_N_MULTIPLE

SCHEDULE_VERSION = 53  # bump when a schedule changes the binary: it is part of the cache key
# ops/gemm_ops.py (and csrc/, given these numbers) picks the "gemv" variant for M at or below
# GEMV_MAX_M when B has at least GEMV_MIN_B_ELEMENTS: then reading B once is the cost. For a
# smaller B the packed kernel is faster even at M=1..16, its 6-row tiles keeping several
# FMA chains in flight (16x16x16: 0.66 us per kernel call against 1.7 us for the gemv).
GEMV_MAX_M = 16
GEMV_MIN_B_ELEMENTS = 1 << 12
# CPU, layout "nk": from M=2 to DOT_MAX_M the "dot" variant beats both the gemv (which reads
# the weight once per row of A) and the packed kernel (measured, 1 thread, 768x768: M=8 1.6x
# torch against 1.0x and 0.9x; M=48 and up the packed kernel is ahead).
DOT_MAX_M = 32
DOT_TILE = (4, 6)  # rows of A, rows of the weight: 24 accumulators of the 32 registers
# Each output of the dot kernel ends in a sum across its vector's lanes, which short rows
# do not pay for: float32 "dot" takes K of at least DOT_K_PER_ROW * M (DOT_MIN_K_CAP at
# most; ``dot_min_k``), else the packed kernel. Measured (2 threads, AMD EPYC Zen 5, kernels
# alone, time dot / packed, N = 384 and 1152): M = 4 K <= 128 1.0-2.2, K = 256 0.72-0.92;
# M = 8 K <= 256 1.06-4.1, K = 384 0.81-1.03, K = 512 0.75-0.81; M = 16 K <= 384 1.4-7.7,
# K = 512 1.12-1.34 (the squeeze-and-excitation convs' 48 -> 1152 at M = 8: 39.5 us against
# 9.9 us, F.linear 10.8 us). The "dot2" kernel (M = 2) was ahead at every K.
DOT_K_PER_ROW = 48
DOT_MIN_K_CAP = 768
# On an Intel Xeon with AVX-512 (model 167, 2 MB L2, 2 threads, kernels alone, dot time /
# packed time) the packed kernel's pack costs more against the dot kernel's sums than on the
# AMD EPYC, for weights of DOT_WIDE_MIN_N rows or more (N = 512 / 768 / 1152 / 2000 / 3072):
# M = 8 K = 256 0.74 / 0.78 / 0.73 / 0.50 / 0.73, M = 12 K = 384 0.79 / 0.82 / 0.80 / 0.58 /
# 0.81, M = 16 K = 384 0.95 / 0.99 / 0.96 / 0.64 / 0.88 and K = 512 0.82 / 0.81 / 0.82 / 0.69 /
# 0.85, M = 20 K = 512 0.83 / 0.91 / 0.90 / 0.78 / 0.91, M = 24 K = 512 1.05 / 0.97 / 0.98 /
# 0.87 / 1.00: there the rows' least length is DOT_K_PER_ROW_INTEL a row from M = 8, and at
# least DOT_WIDE_SHORT_K (M = 8, K = 192: 1.24 / 0.88 / 0.85 / 0.53 / 0.78). Below M = 8 the
# 4-row tile runs twice (M = 5-7, K = 96-160: 0.93-2.6), and narrower weights lose with it
# (N = 128 / 256 / 384 at M = 12 K = 384: 1.26 / 1.32 / 0.84, at M = 16: 1.47 / 1.43 / 0.95;
# N = 256 / 384 at M = 8 K = 256: 1.20 / 1.21): both keep the rule above.
DOT_K_PER_ROW_INTEL = 24
DOT_WIDE_MIN_N = 512
DOT_WIDE_SHORT_K = 256


def dot_min_k(m: int, n: int, cpu: CpuInfo | None = None) -> int:
    """The least K of a float32 "dot" product of M rows by an N x K weight (shorter rows: the
    packed kernel)."""
    cpu = cpu or host_cpu()
    least = min(DOT_K_PER_ROW * m, DOT_MIN_K_CAP)
    if "Intel" in cpu.model and cpu.vector_bytes == 64 and n >= DOT_WIDE_MIN_N and m >= 8:
        least = min(max(DOT_K_PER_ROW_INTEL * m, DOT_WIDE_SHORT_K), least)
    return least


# The dot kernels vectorise along K: a K off whole vectors (a multiple of DOT_K_MULTIPLE, the
# fp32 lanes of AVX-512) carried a bounds test into their vector loop, which then ran a lane
# at a time. Such a K took the gemv up to KTAIL_GEMV_MAX_M rows (bf16: KTAIL_BF16_GEMV_MAX_M)
# and the packed kernel past them; bf16 still does. float32 takes the dot kernels again past
# one vector of K: they now sum K's last values in a loop of their own (``_schedule_dot_nk``).
# Kernels alone, 2 threads, Intel Xeon, against F.linear, M = 2, gemv / packed / dot2: N x K =
# 1000 x 33 0.46 / 0.63 / 0.89x, 1000 x 100 0.45 / 0.47 / 0.53x, 768 x 300 0.45 / 0.34 /
# 0.99x, 512 x 33 0.63 / 0.56 / 1.09x; M = 4, packed / dot: 1000 x 33 0.78 / 0.50x (short
# rows: packed, DOT_K_PER_ROW), 768 x 300 0.56 / 1.14x. Before that change (2 threads, AMD
# EPYC Zen 5, kernels alone against F.linear, dot2 / dot / gemv / packed): fp32 512 x 33
# M = 2 0.33 / 0.18 / 1.56 / 0.77, M = 4 0.12 / 0.11 / 0.56 / 0.76, M = 16 0.05 / 0.06 / 0.26
# / 0.85; 1024 x 100 M = 2 0.59 / 0.28 / 0.84 / 0.63, M = 16 0.10 / 0.11 / 0.17 / 1.01; bf16
# 512 x 33 M = 2 0.53 / 0.29 / 0.70 / 2.06, M = 16 0.06 / 0.06 / 0.08 / 1.80; bf16 768 x 300
# M = 2 1.10 / 0.58 / 0.44 / 2.68, M = 4 0.58 / 0.68 / 0.23 / 2.63.
DOT_K_MULTIPLE = 16
KTAIL_GEMV_MAX_M = 2
KTAIL_BF16_GEMV_MAX_M = 1
# Up to DOT2_MAX_M rows the "dot2" variant: the dot kernel with a 2-row tile (the 4-row one
# computes 4 rows for 2; measured at M=2, 768x768, 2 threads: 1.06x torch against 0.72x; at
# M=4 and 8 the 4-row tile is ahead, 1.18-1.21x against 1.07-1.08x). 10 rows of the weight
# at a time: where the weight streams from memory, more rows in flight read it faster
# (kernels alone, 2 threads, quiet Intel Xeon, two runs, 2 x 8 -> 2 x 10 against F.linear:
# N=11008 K=4096 0.93-0.94x -> 0.98-1.00x, N=4096 K=11008 0.95x -> 1.02-1.07x, 4096 x 4096
# 0.99-1.01x -> 1.01-1.02x; 768 x 3072, 3072 x 768, 768 x 768 within 1% either way; 2 x 12:
# 0.91x at 768 x 768).
DOT2_MAX_M = 2
DOT2_TILE = (2, 10)
# The "swap" variant: M within SWAP_SLACK rows of one panel of SWAP_PANEL rows, K at most
# swap_max_k (the panel of x, K x 64 floats, in half the L2, as for the packed kernel's panel
# of B). Measured through the op (bench-inference, 2 threads, quiet Intel Xeon at ~3.5 GHz,
# two runs each, torch = 1), packed kernel -> swap: M=64 1.00-1.03 -> 1.27-1.37x at
# 4096x4096, 1.06-1.15 -> 1.45-1.52x at N=11008 K=4096, 1.10-1.22 -> 1.16-1.31x at 768x768;
# M=56 0.96-1.04 -> 1.17-1.24x at 4096x4096. M=48 (16 rows short) was mixed. On a 2.0 GHz
# Intel Xeon of the same family (FMA probe 247 GFLOPS on 2 threads, no turbo), kernels alone,
# the same comparison is 1.08-1.18 -> 0.95-1.25x (M=56-64, seven BERT/LLaMA shapes); on an
# Emerald Rapids Xeon, weights cycled through 64 MB, it lost wherever K <= 2048 (768x768 M=56
# 1.09 -> 0.82x, 512x512 M=64 1.15 -> 0.85x, N=3072 K=768 1.05 -> 0.94x) and won at K >= 3072
# (N=768 K=3072 1.08 -> 1.20x, 4096x4096 1.02 -> 1.30x); the one-panel swaps below the same
# (768x768 M=24 1.10 -> 0.86x, 512x512 M=32 1.40 -> 1.13x; 1024x1024 M=32 1.12 -> 1.41x). So
# every swap variant stands for a choice made on the machine itself at first use, per weight
# shape, between its kernel and the packed kernel (runtime/variant_choice.py, swap_rows).
# Two panels (M=120-128, the weight read once per panel) won on the 3.5 GHz machine for long K
# (N=768 K=3072 1.05 -> 1.13x, 4096x4096 1.02 -> 1.15x) and for vocabulary projections (GPT-2's
# lm_head 0.92-0.96 -> 1.04-1.05x), but lost on the 2.0 GHz one, kernels alone, packed -> two
# panels: N=768 K=3072 1.06-1.07 -> 0.84x, 4096x4096 1.07-1.14 -> 0.71-0.79x, N=50257 K=768
# 1.00 -> 0.83x, N=32000 K=768 (M=120) 0.98 -> 0.80x. So no fixed rule holds on both (the
# measured choice above).
SWAP_PANEL = 64
SWAP_SLACK = 8
SWAP_MIN_M, SWAP_MAX_M = SWAP_PANEL - SWAP_SLACK, SWAP_PANEL
SWAP_TILE = (6, 8)  # columns of the result per register tile (6 x 64 accumulators), tiles per task
# "swap2": M within SWAP_SLACK rows of two panels, N >= SWAP2_MIN_N, K <= swap_max_k. Where
# the weight is re-read from memory, as in a model, the swap kernel's in-place reads of it lose
# at BERT's and LLaMA's layer widths (kernels alone, 2 threads, this Intel Xeon, packed / swap:
# 768 x 768 1.02-1.04x with the weights in L3, 0.95x from memory; in a converted BERT 0.89x,
# 1376 x 512 in a LLaMA-style stack 0.91x); vocabulary projections gain: 1.03-1.12x at N =
# 16384..50257, K = 768..4096.
SWAP2_MIN_M, SWAP2_MAX_M = 2 * SWAP_PANEL - SWAP_SLACK, 2 * SWAP_PANEL
SWAP2_MIN_N = 16384
# The one-panel swap variants: the swap kernel for M within SWAP_SLACK rows of one panel of 32
# or 48 rows of x, its tile the panel's rows by 12 / 8 columns of the result (24 accumulators:
# 12 broadcasts of the weight and 2 vector loads of the panel, or 8 and 3, a step), where the
# dot kernel reads x again for every 6 rows of the weight and the packed kernel packs the
# weight. The panel (rows x K floats) within the L2: K <= one_panel_swap_max_k. Kernels alone,
# bias + relu, 2 threads, quiet Intel Xeon, F.linear = 1, dot -> swap32: M=32 768x768 0.98 ->
# 1.26x, N=3072 K=768 1.07 -> 1.46x, 4096x4096 1.09 -> 1.67x, N=4096 K=11008 (packed kernel)
# 1.15 -> 1.85x; M=24 768x768 1.07 -> 1.06x, N=3072 K=768 1.05 -> 1.23x, N=768 K=3072 1.31 ->
# 1.39x; M=20 4096x4096 1.18 -> 1.36x; lost at M <= 17 with small weights (768x768 M=17 1.07 ->
# 0.92x, M=16 1.23 -> 0.85x, M=8 1.04 -> 0.36x). Packed kernel -> swap48: M=48 768x768 1.07 ->
# 1.18x, N=3072 K=768 1.10 -> 1.22x, N=768 K=3072 1.26 -> 1.49x, 4096x4096 1.14 -> 1.53x, N=1376
# K=512 1.31 -> 1.47x, 512x512 1.36 -> 1.22x; M=40 768x768 1.15 -> 1.11x, N=11008 K=4096 1.28 ->
# 1.46x. (Two panels of 32 rows at M = 40-48 lost: 0.93-1.05x against 1.08-1.11x.) Through the
# op, same run, packed -> swap48 at M=48: 768x768 1.12 -> 1.21x, 4096x4096 1.05 -> 1.36x, N=1376
# K=512 1.26 -> 1.44x, but N=512 (11 tasks of 48 rows for 2 threads) 1.16-1.24 -> 1.06-1.12x:
# hence a least N.
# variant: (rows of x, SWAP_TILE, least N)
ONE_PANEL_SWAPS = {"swap32": (32, (12, 4), 0), "swap48": (48, (8, 6), 768)}


# bfloat16 on AMX tiles: the "dot" variant (cpu_amx.py: the weight's rows loaded as tiles in
# place, x packed) up to AMX_DOT_MAX_M rows while x (M x K bf16) fits in the L2, where the
# packed kernel packs the whole weight for a few blocks of x. Measured (kernels alone, 2
# threads, Intel Xeon, against F.linear), dot / packed: M = 64: 1.96x / 1.45x (N=768 K=3072),
# 1.82x / 0.88x (4096 x 4096); M = 128: 1.60x / 1.40x, 1.42x / 0.90x; from M = 256 the packed
# kernel is ahead (0.88-0.93x / 0.94-0.98x). With a long K x outgrows the L2 sooner: N=4096
# K=11008 at M = 64 1.08x / 0.99x, 96 0.92x / 0.96x, 128 0.86x / 1.01x; K = 8192 at M = 128
# 0.93x / 0.88x (x: 1.4, 2.1, 2.8, 2 MB).
AMX_DOT_MAX_M = 128


# bfloat16 on vdpbf16ps (cpu_avx512_bf16.py: CPUs with AVX512-BF16 and no AMX): the packed
# kernel from M = 5, where it beats the "dot" kernel (fp32 math on converted operands): its
# time hardly grows from M = 2 to 12 (one block of rows; the weight's pack is the cost), the
# dot kernel's does. Measured through the op, 2 threads, AMD EPYC (Zen 5), 64-128 MB of
# weights cycled (from memory, as in a model), against F.linear bf16 in the same run, dot /
# packed (768x768, N=3072 K=768, N=768 K=3072, 4096x4096, N=1376 K=512, N=512 K=1376):
# M = 4 1.06 / 1.05, 0.99 / 0.93, 0.94 / 0.91, 1.07 / 0.90, 0.82 / 0.95, 0.99 / 1.05; M = 6
# 0.74 / 1.06, 0.67 / 0.97, 0.77 / 0.96, 0.82 / 0.86, 0.55 / 1.06, 0.76 / 1.08; M = 12 0.69 /
# 1.17, 0.61 / 1.10, 0.75 / 1.08, 0.90 / 1.14, 0.58 / 1.27, 0.70 / 1.18.
BF16_DOT_MAX_M = 4


def bf16_dot_max_m(cpu: CpuInfo | None = None) -> int:
    """The largest M of the "dot" variant for a bf16 "nk" product with a static, even K on
    this CPU (ops/impls.py hands it to csrc/ too)."""
    return BF16_DOT_MAX_M if cpu_avx512_bf16.available(cpu or host_cpu()) else DOT_MAX_M


# bfloat16 with B (K, N) on vdpbf16ps (a product of two activations, or a Conv1D weight, its
# K symbolic or even): the gemv (fp32 math) up to this M, then the packed kernel, where the
# gemv ran at 0.33-0.58x torch.matmul from M = 8. Measured (2 threads, AMD EPYC Zen 5, K
# symbolic, kernels alone against torch.matmul bf16, gemv / packed; N x K = 3072 x 768, 768 x
# 3072, 768 x 768, 4096 x 4096): M = 2 1.69 / 0.93, 1.34 / 0.92, 2.18 / 1.63, 2.86 / 1.00;
# M = 3 1.00 / 0.90, 0.82 / 0.89, 1.48 / 1.62, 3.48 / 1.07; M = 4 0.86 / 1.00, 0.71 / 0.92,
# 1.14 / 1.57, 1.77 / 1.06; M = 8 0.58 / 1.00, 0.48 / 1.01, 0.71 / 1.68; M = 16 0.38 / 0.95,
# 0.33 / 0.93, 0.46 / 1.36. The same on AMX tiles (the packed kernel of cpu_amx; 2 threads,
# Intel Xeon Emerald Rapids, K static (a Conv1D weight), against torch.addmm bf16, N x K =
# 2304 x 768, 768 x 768, 3072 x 768, 768 x 3072): M = 2 1.90 / 1.28, 1.86 / 1.38, 2.01 /
# 1.41, 2.01 / 1.17; M = 4 1.19 / 1.25, 1.13 / 1.25, 1.32 / 1.44, 1.23 / 1.15; M = 8 0.67 /
# 1.21, 0.68 / 1.33, 0.73 / 1.34, 0.62 / 1.02; M = 16 0.41 / 1.31, 0.43 / 1.41, 0.46 / 1.43,
# 0.39 / 1.12.
BF16_GEMV_MAX_M = 3


def bf16_gemv_max_m(cpu: CpuInfo | None = None) -> int:
    """The largest M of the "gemv" variant for a bf16 "kn" product with a symbolic or even K
    on this CPU (ops/impls.py hands it to csrc/ too): BF16_GEMV_MAX_M where the packed kernel
    computes in bf16 (AMX tiles or vdpbf16ps), else GEMV_MAX_M."""
    cpu = cpu or host_cpu()
    native = cpu.amx_bf16 or cpu_avx512_bf16.available(cpu)
    return BF16_GEMV_MAX_M if native else GEMV_MAX_M


def amx_dot_limits(cpu: CpuInfo | None = None) -> tuple[int, int]:
    """(largest M, largest M x K x 2 bytes of x) of the bf16 "dot" variant past DOT_MAX_M
    on this CPU, (0, 0) without AMX tiles (ops/impls.py hands them to csrc/ too)."""
    cpu = cpu or host_cpu()
    return (AMX_DOT_MAX_M, cpu.l2_bytes) if cpu.amx_bf16 else (0, 0)


def one_panel_swap_max_k(variant: str, cpu: CpuInfo | None = None) -> int:
    """The longest K of a one-panel swap variant on this CPU (ops/impls.py hands it to csrc/
    too): its panel of x in the L2 (measured at K = 11008 with 32 rows, 1.4 MB of a 2 MB L2:
    1.85x F.linear against 1.15x for the packed kernel); 0 without AVX-512."""
    rows = ONE_PANEL_SWAPS[variant][0]
    return 2 * swap_max_k(cpu) * SWAP_PANEL // rows


def swap_rows(variant: str) -> tuple[int, int]:
    """(least, largest) M of a swap variant ("swap", "swap2", "swap32", "swap48")."""
    if variant == "swap":
        return SWAP_MIN_M, SWAP_MAX_M
    if variant == "swap2":
        return SWAP2_MIN_M, SWAP2_MAX_M
    rows = ONE_PANEL_SWAPS[variant][0]
    return rows - SWAP_SLACK, rows


def swap_max_k(cpu: CpuInfo | None = None) -> int:
    """The longest K of the "swap" variant on this CPU (ops/impls.py hands it to csrc/ too):
    0, no swap, without AVX-512, whose 6 x 4 vectors of accumulators the tile needs."""
    cpu = cpu or host_cpu()
    if cpu.vector_bytes != 64:
        return 0
    return cpu.l2_bytes // 2 // (SWAP_PANEL * 4)


def gemm_variant(
    m: int,
    n: int,
    k: int,
    b_layout: str = "kn",
    device: str = "cpu",
    dtype: str = "float32",
    static_k: bool = True,
    threads: int | None = None,
) -> str:
    """The schedule variant for an (M, N, K) product on ``threads`` threads (default:
    torch's): "gemv", "ksplit", "dot2", "dot", "swap32", "swap48", "swap", "swap2" (its kernel
    or the packed one, whichever runs faster here: runtime/variant_choice.py), "rows" or
    "gemm"."""
    big_b = n * k >= GEMV_MIN_B_ELEMENTS
    nk = device == "cpu" and b_layout == "nk" and big_b
    # ("rows" for a symbolic K too, by the call's K: a matmul of two activations)
    fp32_cpu = device == "cpu" and big_b and dtype == "float32"
    if fp32_cpu and _rows_fits(m, n, k, threads):
        return "rows"
    if nk and dtype == "float32" and static_k:
        for variant in ONE_PANEL_SWAPS:
            if _one_panel_swap_fits(variant, m, n, k):
                return variant
    bf16_pairs = dtype == "bfloat16" and static_k and k % 2 == 0  # vdpbf16ps / AMX operands
    whole_k = static_k and k % DOT_K_MULTIPLE == 0
    dot_k = whole_k or (dtype == "float32" and static_k and k > DOT_K_MULTIPLE)  # (K's tail apart)
    if nk and dot_k and 2 <= m <= (bf16_dot_max_m() if bf16_pairs else DOT_MAX_M):
        short_rows = dtype == "float32" and k < dot_min_k(m, n)
        if m <= DOT2_MAX_M or not short_rows:
            return "dot2" if m <= DOT2_MAX_M else "dot"
        return "gemm"
    # (AMX tiles read a weight in 32-bit pairs: a static, even K; cpu_amx.applies)
    if nk and bf16_pairs and _amx_dot_fits(m, k):
        return "dot"
    if nk and bf16_pairs and m >= 2:  # past bf16_dot_max_m: the packed kernel, even at M <= 16
        return "gemm"
    if nk and dtype == "float32" and static_k and _swap_fits(m, n, k):
        return "swap"
    if nk and dtype == "float32" and static_k and _swap2_fits(m, n, k):
        return "swap2"
    kn = device == "cpu" and b_layout == "kn" and big_b
    if kn and dtype == "float32" and static_k and _ksplit_fits(m, n):
        return "ksplit"
    if nk and not whole_k:  # (see DOT_K_MULTIPLE)
        tail_max_m = KTAIL_BF16_GEMV_MAX_M if dtype == "bfloat16" else KTAIL_GEMV_MAX_M
        return "gemv" if m <= tail_max_m else "gemm"
    bf16_packed = dtype == "bfloat16" and (not static_k or k % 2 == 0)  # (vdpbf16ps takes it)
    gemv_max_m = bf16_gemv_max_m() if b_layout == "kn" and bf16_packed else GEMV_MAX_M
    return "gemv" if m <= gemv_max_m and big_b else "gemm"


def _ksplit_fits(m: int, n: int) -> bool:
    return 1 <= m <= KSPLIT_MAX_M and n >= KSPLIT_MIN_N and n % KSPLIT_N_MULTIPLE == 0


def _amx_dot_fits(m: int, k: int) -> bool:
    max_m, max_x_bytes = amx_dot_limits()
    return 2 <= m <= max_m and m * k * 2 <= max_x_bytes


def _one_panel_swap_fits(variant: str, m: int, n: int, k: int) -> bool:
    least_m, most_m = swap_rows(variant)
    min_n = ONE_PANEL_SWAPS[variant][2]
    return least_m <= m <= most_m and n >= min_n and k <= one_panel_swap_max_k(variant)


def _swap_fits(m: int, n: int, k: int) -> bool:
    return SWAP_MIN_M <= m <= SWAP_MAX_M and k <= swap_max_k()


def _swap2_fits(m: int, n: int, k: int) -> bool:
    return SWAP2_MIN_M <= m <= SWAP2_MAX_M and n >= SWAP2_MIN_N and k <= swap_max_k()


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _rows_fits(m: int, n: int, k: int, threads: int | None) -> bool:
    if n > ROWS_MAX_N or k > rows_max_k():
        return False
    if m >= ROWS_MIN_M:
        return True
    return m > DOT_MAX_M and rows_split_wins(m, n, threads or _torch_threads())


def rows_split_wins(m: int, n: int, threads: int) -> bool:
    """Below ROWS_MIN_M: whether tasks of (half of the rows, panel) end before tasks of whole
    panels, a panel's pack costing ROWS_PACK_ROWS rows of its tiles (see ROWS_PACK_ROWS)."""
    panels = -(-n // ROWS_PANEL)
    whole_panels = -(-panels // threads) * (2 * ROWS_PACK_ROWS + 2 * m)  # (both sides x 2)
    halves = -(-2 * panels // threads) * (2 * ROWS_PACK_ROWS + m)
    return halves < whole_panels


def rows_max_k(cpu: CpuInfo | None = None) -> int:
    """The longest K of the "rows" variant: one pass over K with the 6 x 4-vector tile
    (``one_pass_max_k``); 0 (never) on a CPU with fewer than 32 vector registers (not
    measured there)."""
    cpu = cpu or host_cpu()
    return one_pass_max_k(cpu) if cpu.vector_registers >= 32 else 0


# The packed kernel sums all of K in one pass while a 4-vector-wide panel of B (K x 64 float32
# values on AVX-512) takes less than half of the L2; from half on, it runs over chunks of K
# (``k_chunk``). At exactly half (K = 4096 on a 2 MB L2, a 1 MB panel) the chunks won: kernels
# alone, x fresh from F.rms_norm at each call, two 4096 x 4096 weights in turn (from memory),
# 2 threads, Intel Xeon (KVM model 167), against torch.mm, three runs (two in reverse order),
# the "rows" one pass -> chunks of 1024: M = 512 0.91-1.01 -> 0.98-1.02x, 1024 0.95-0.98 ->
# 1.00x, 2048 0.96-1.02 -> 1.00-1.04x; the weight hot, M = 128 / 256 the plain one pass
# 0.88-1.05 / 0.99x -> 1.03-1.05 / 1.03x. Through the op (bench-inference, 4096 x 4096 and
# 11008 x 4096, relu and plain, M = 128 to 2048: 20 rows), two runs before and three after,
# alternating: geometric mean 1.03 / 1.04x -> 1.08 / 1.06 / 1.06x torch, lowest row 0.98 /
# 0.96x -> 1.01 / 0.99 / 0.99x. At K = 3072 (768 x 3072) chunks were even with the one pass
# (M = 128-2048, within 3%): the bound stays at half. (Not measured on a 1 MB L2, where it
# moves K = 2048 to chunks.)
def one_pass_max_k(cpu: CpuInfo) -> int:
    """The longest static K that the packed kernel sums in one pass (see above); a row of
    its panel is 4 vectors of the accumulation dtype, whichever it is."""
    return (cpu.l2_bytes // 2 - 1) // (4 * cpu.vector_bytes)


def register_tile(spec: GemmSpec, cpu: CpuInfo) -> tuple[int, int, int]:
    """(MR, NR, VEC): the register tile for the accumulation dtype on this CPU."""
    acc_bytes = 8 if spec.acc_dtype == "float64" else 4
    vec = cpu.vector_bytes // acc_bytes
    # Accumulators + B vectors + one broadcast must fit the register file.
    if cpu.vector_registers >= 32:
        # A packed panel of B (K x NR) is streamed once per MR rows of A, so it must stay in
        # the core's L2. From half of it on the tile turns to 12 x 2 vectors: the same 24
        # accumulators, panels half as wide (12 broadcasts per 2 vector loads). Measured:
        # K = 11008 on a 2 MB L2, 64-wide panels of 2.8 MB ran at 0.34-0.39x torch from M = 64.
        if spec.k is not None and spec.k > one_pass_max_k(cpu):
            return 12, 2 * vec, vec
        return 6, 4 * vec, vec  # 24 accumulators, 4 B loads, 1 broadcast
    return 6, 2 * vec, vec  # 12 + 2 + 1 of 16


# A batched "kn" B of at most this many whole vectors that is no whole number of panels is one
# panel exactly as wide (batched_tile).
ONE_PANEL_MAX_VECTORS = 6


def batched_tile(spec: GemmSpec, cpu: CpuInfo) -> tuple[int, int, int]:
    """(MR, NR, VEC) of the batched kernel: ``register_tile``'s, except for a "kn" B (P @ V:
    attention's V, N its head dim) of whole vectors, at most ONE_PANEL_MAX_VECTORS, that is no
    whole number of panels: one panel of exactly N columns, read in place, its rows as many
    as keep 24 accumulators (at most 12). A head dim of 80 or 96 was two 64-wide panels, the
    second mostly padding, and 32 or 48 one such panel. P @ V, S = 128, 12 products, 2
    threads, Intel Xeon (KVM model 167), against torch.bmm, 64-wide panels -> one panel:
    head dim 32 0.53 -> 1.05x, 48 0.68 -> 1.00x, 80 0.57 -> 1.03x (96 products 0.64 ->
    1.02x; S = 77 0.53 -> 1.00x), 96 0.67 -> 0.98x (S = 197 0.67 -> 0.91x); 96 as panels of
    2 or 3 vectors 0.91-0.94x."""
    mr, nr, vec = register_tile(spec, cpu)
    vectors = spec.n // vec
    whole_vectors = spec.n % vec == 0 and spec.n % nr != 0
    if spec.b_layout == "kn" and cpu.vector_registers >= 32 and whole_vectors:
        if vectors <= ONE_PANEL_MAX_VECTORS:
            return min(12, 24 // vectors), spec.n, vec
    return mr, nr, vec


# K blocking of the packed kernel (a static K whose 64-wide panel of B fills half the L2 or
# more, ``one_pass_max_k``):
# chunks of K, each chunk's panel packed and used while it is in cache, partial sums added up
# in memory. A chunk is at most ``k_chunk_max`` values (or a little fewer, to divide K): a
# panel's piece of it an eighth of the L2, 1024 values on a 2 MB L2, 512 on 1 MB. Chunks of
# 256 (the rule before) cost the large M: each chunk adds the task's partial sums into its
# accumulator panel in memory (M x 128 values) and reads M short rows of A. Through the op,
# linear + relu against F.relu(F.linear), 2 threads, Intel Xeon (KVM model 167, 2 MB L2 a
# core), two runs each, chunks of 256 -> 688 at N = 4096, K = 11008: M = 64 1.03-1.06 ->
# 1.04-1.10x, 128 0.98 -> 0.94-1.00x, 256 0.97-0.99 -> 1.01-1.03x, 512 0.93 -> 0.99-1.00x,
# 1024 0.85-0.89 -> 0.97-0.99x, 2048 0.85 -> 0.93-0.99x (chunks of 1376: 0.96-0.97x at 2048,
# 0.96-0.98x at 512); 256 -> 704 at N = 2048, K = 5632: M = 128 0.97-1.03 -> 0.97-0.99x, 256
# 0.97-0.98 -> 1.01-1.02x, 512 0.95-0.97 -> 0.99x, 1024 0.91 -> 0.97-0.99x.
# docs/inference-shapes.md, section 39.
K_CHUNK_L2_SHARE = 8

# The K-blocked kernel asks for the weight's next chunk while the tiles of this one run
# (``cpu_pack_prefetch.prefetch_next_chunk``) only on CPUs with an L2 of at most this size: it
# was measured to gain on an AMD EPYC (Zen 5, 1 MB L2) and to lose on an Intel Xeon with 2 MB
# (KVM model 167). There, kernels alone, linear + relu against torch, 2 threads, medians of 9
# alternating rounds, N = 4096, K = 11008 (chunks of 688), with -> without the prefetch: M =
# 17 1.16 -> 1.42x, 32 1.17 -> 1.46x, 64 1.11 -> 1.32x, 96 1.05 -> 1.16x, 126 1.01 -> 1.10x,
# 128 1.01 -> 1.11-1.14x, 192 1.06 -> 1.03-1.12x, 248 0.99 -> 1.04x; with four such weights
# cycled (720 MB, past the L3) M = 32 1.08 -> 1.41x, 128 1.11 -> 1.24x; with chunks of 256
# (the earlier rule) M = 32 1.08 -> 1.29x, 128 1.20 -> 1.25x; N = 2048, K = 5632: M = 32 0.97
# -> 1.15x, 96 0.98 -> 1.06x, 128 0.95 -> 1.04x, 192 0.99 -> 1.03x. (From 42 tiles of A on,
# M >= 253 here, the prefetch was off already.)
NEXT_CHUNK_PREFETCH_MAX_L2 = 1 << 20


def k_chunk_max(cpu: CpuInfo) -> int:
    """The longest K chunk: a panel's piece of it (4 vectors wide, any dtype) an eighth of
    the L2, in whole vectors of float32, 128 at least."""
    per_value = 4 * cpu.vector_bytes
    return max(128, cpu.l2_bytes // K_CHUNK_L2_SHARE // per_value // 16 * 16)


# A float32 Linear weight stored (K, N) (transformers' Conv1D) runs the K-blocked kernel at
# any K from KN_MIN_K: chunks of KN_CHUNK values of K, each task KN_MAX_PANELS_PER_TASK panels
# wide or fewer (``kn_panels_per_task``). Its copy of a chunk then reads runs of up to 384
# values from each row of the weight, where the one-pass kernel's copy of one panel reads 64
# from each of K rows N values apart. Kernels alone, linear + relu against torch.addmm on the
# same (K, N) weight, 2 threads, Intel Xeon (KVM model 167), medians of 7 alternating rounds,
# one pass -> chunks of 256: N x K = 768 x 3072 (GPT-2's MLP output) M = 8 / 16 / 32 / 128 /
# 256 / 384 0.77 / 1.02 / 0.72-0.73 / 0.88 / 0.96 / 0.98x -> 1.07 / 1.24 / 0.89-0.90 /
# 0.99-1.00 / 1.00 / 1.00x, 3072 x 768 M = 32 / 128 0.84 / 0.94x -> 0.98 / 1.00x, 768 x 768
# M = 32 / 128 / 256 0.95 / 0.98 / 1.01x -> 1.01 / 1.00 / 1.02x, 2304 x 768 the same either
# way; 1280 x 5120 (GPT-2 large, chunks of 1024 before) M = 32 / 128 / 1024 0.78 / 0.93 /
# 0.99x -> 0.91 / 1.00 / 1.00x. Tasks narrower than 6 panels read shorter runs and gained
# less (768 x 3072, M = 32 / 128: 3 panels 0.80 / 0.92x, 2 0.77 / 0.90x, 1 0.75 / 0.86x), and
# tasks that the threads do not share evenly lost (1280 x 5120 with 4 panels, 5 tasks:
# 0.75 / 0.79x). Nor for an N off whole panels (1000 x 768, M = 32 / 128 / 256: 0.82 / 0.93 /
# 0.98x -> 0.72 / 0.81 / 0.85x) or with thousands of them, where the one-pass kernel copies A
# into tiles (``packs_a``; 50257 x 768: 0.51 / 0.76 / 1.21x -> 0.32 / 0.52 / 0.97x). The "nk"
# weights gained nothing from it (768 x 3072: 1.57 / 1.06x -> 1.51 / 1.02x). The 1x1 convs'
# GEMMs with a per-row bias are not measured with it and keep the one-pass kernel.
KN_CHUNK, KN_MIN_K, KN_MAX_PANELS_PER_TASK = 256, 512, 6


def kn_panels_per_task(spec: GemmSpec, cpu: CpuInfo) -> int | None:
    """The panels of each task of the K-blocked kernel for a float32 "kn" Linear weight (see
    KN_CHUNK): the most, up to KN_MAX_PANELS_PER_TASK, whose tasks the cores share evenly;
    None where that rule does not apply (then the one-pass or L2-chunked kernel runs)."""
    if (
        spec.b_layout != "kn"
        or spec.dtype != "float32"
        or spec.variant != "gemm"
        or spec.batched
        or spec.k is None
        or spec.k < KN_MIN_K
        or (spec.bias and spec.bias_axis != "n")
        or cpu.vector_registers < 32
    ):
        return None
    nr = 4 * (cpu.vector_bytes // 4)  # the float32 tile's panel
    if spec.n % nr or spec.n > ROWS_MAX_N:  # (whole panels, and not a vocabulary's thousands)
        return None
    panels = spec.n // nr
    for width in range(KN_MAX_PANELS_PER_TASK, 1, -1):
        if panels % width == 0 and (panels // width) % cpu.cores == 0:
            return width
    return None


def k_chunk(spec: GemmSpec, cpu: CpuInfo) -> int | None:
    """The K chunk of the packed kernel for ``spec``, or None for one pass over all of K."""
    if spec.batched or spec.variant != "gemm" or spec.k is None or cpu.vector_registers < 32:
        return None
    if kn_panels_per_task(spec, cpu):
        # A "kn" chunk has no vectors along K (its pack copies rows): any length that divides
        # K, which leaves no padding. With padding, A read in place is tested against K at
        # every step of the tiles (kernels alone, M = 128, N = 512, 2 threads, Intel Xeon:
        # K = 1376 in chunks of 176, padded to 1408, 0.58-0.61x torch.mm; K = 1344 and 1408,
        # in whole chunks, 1.01x and 0.93x).
        for kc in range(KN_CHUNK, KN_CHUNK // 2 - 1, -1):
            if spec.k % kc == 0:
                return kc
        most = KN_CHUNK
    else:
        if spec.k <= one_pass_max_k(cpu):
            return None
        most = k_chunk_max(cpu)
    # The fewest padded values of K over chunks that are whole vectors (ties: the longer).
    return min(range(most, most // 2 - 1, -16), key=lambda kc: -(-spec.k // kc) * kc)


def schedule_gemm(spec: GemmSpec, cpu: CpuInfo | None = None):
    """The scheduled IRModule for ``spec`` on this CPU."""
    from tvm import s_tir

    cpu = cpu or host_cpu()
    if cpu_amx.applies(spec, cpu):
        return cpu_amx.schedule_gemm_amx(spec)
    if cpu_avx512_bf16.applies(spec, cpu):
        return cpu_avx512_bf16.schedule_gemm_dp(spec)
    mr, nr, vec = register_tile(spec, cpu)
    kc = k_chunk(spec, cpu)
    if kc is not None:
        mr, nr = 6, 4 * vec  # the panel is short now: the widest tile
        sch = s_tir.Schedule(kblocked_gemm_compute(spec, mr, nr, kc, column_granule(spec, nr, vec)))
        loops = _schedule_packed_kblocked(sch, spec, mr, nr, vec, cpu)
        loops = [sch.get(loop).loop_var for loop in loops]
        chunks, width = -(-spec.k // kc), _panels_per_task(spec, nr, cpu) * nr
        mod = sch.mod
        if cpu.l2_bytes <= NEXT_CHUNK_PREFETCH_MAX_L2:
            # while a chunk of A (tiles x MR x kc values) takes at most a third of the L2
            max_tiles = cpu.l2_bytes // 3 // (mr * kc * (8 if spec.acc_dtype == "float64" else 4))
            mod = cpu_pack_prefetch.prefetch_next_chunk(mod, loops, chunks, width, kc,
                                                        spec.b_layout == "nk", max_tiles)  # fmt: skip
        return cpu_tail_tile.cut_last_tiles(mod, mr, ("partial_init", "partial_update"))
    elif spec.batched:
        mr, nr, vec = batched_tile(spec, cpu)
        sch = s_tir.Schedule(batched_gemm_compute(spec, mr, nr, column_granule(spec, nr, vec)))
        pack_loops = _schedule_packed_batched(sch, spec, mr, nr, vec)
        mod = cpu_pack_prefetch.with_pack_prefetch(sch, spec, pack_loops, nr, vec)
        if spec.n % vec and spec.dtype == spec.acc_dtype:  # (as below: task_order)
            mod = cpu_tile_store.split_full_panels(mod, spec.n, nr)
        return cpu_tail_tile.cut_last_tiles(mod, mr)
    elif spec.variant in ("dot", "dot2"):
        if spec.b_layout != "nk":
            raise ValueError(f"bad GemmSpec {spec}: the dot variant reads a (N, K) weight")
        tile = DOT2_TILE if spec.variant == "dot2" else DOT_TILE
        sch = s_tir.Schedule(gemm_compute(spec, *tile))
        _schedule_dot_nk(sch, spec, vec, tile)
    elif spec.variant in ("swap", "swap2") or spec.variant in ONE_PANEL_SWAPS:
        if spec.b_layout != "nk" or spec.dtype != "float32" or spec.k is None:
            raise ValueError(f"bad GemmSpec {spec}: the swap variant is float32 x (N, K) weight")
        panel, (rows, tiles), _ = ONE_PANEL_SWAPS.get(spec.variant, (SWAP_PANEL, SWAP_TILE, 0))
        sch = s_tir.Schedule(gemm_compute(spec, panel, rows * tiles, padded_epilogue=True))
        _schedule_swapped(sch, panel, rows, tiles, vec)
    elif spec.variant == "ksplit":
        tasks = -(-spec.k // cpu_gemv.ksplit_rows(spec.k))
        return cpu_gemv.gemv_kn_ksplit_module(spec, vec, _gemv_parallel(spec, tasks))
    elif spec.variant == "gemv":
        if spec.b_layout == "kn":
            span = gemv_kn_span(spec.n, vec)
            # (N padded to whole vectors only: the last task skips the vectors past them)
            sch = s_tir.Schedule(gemm_compute(spec, 1, vec))
            tasks = _schedule_gemv_kn(sch, spec, span, vec)
            if spec.n % span and spec.n > span:  # (else a single task)
                return whole_tasks_apart(sch.mod, sch.get(tasks).loop_var, spec.n // span)
        elif cpu_gemv.applies(spec):
            tasks = -(-spec.n // GEMV_NK_ROWS)
            return cpu_gemv.gemv_nk_module(spec, vec, GEMV_NK_ROWS, _gemv_parallel(spec, tasks))
        else:
            sch = s_tir.Schedule(gemm_compute(spec, 1, GEMV_NK_ROWS))
            _schedule_gemv_nk(sch, spec, vec)
    else:
        m_pad = 2 * mr if spec.variant == "rows" else mr  # (see _schedule_packed)
        sch = s_tir.Schedule(gemm_compute(spec, m_pad, nr, granule=column_granule(spec, nr, vec)))
        pack_loops = _schedule_packed(sch, spec, mr, nr, vec)
        mod = cpu_pack_prefetch.with_pack_prefetch(sch, spec, pack_loops, nr, vec)
        # (see task_order; the "rows" variant's tile stores too)
        if spec.n % vec and (spec.variant == "rows" or task_order(spec, nr, vec)[0] > 1):
            mod = cpu_tile_store.split_full_panels(mod, spec.n, nr)
        return cpu_tail_tile.cut_last_tiles(mod, mr)
    return sch.mod


def column_granule(spec: GemmSpec, nr: int, vec: int) -> int:
    """How the packed kernels' computes clamp the padded columns of the last panel of a "kn"
    B (``kernels/gemm.py`` ``padded_column``): by whole vectors where N is whole vectors but
    not whole panels, else value by value (whole panels: no clamp; N off the vectors: the
    tile store splits the last panel off, ``cpu_tile_store``). The pack copies a "kn" panel
    in vectors along N, which a clamp by value turned into a copy value by value. Through the
    op, "kn" weights, 2 threads, Intel Xeon (KVM model 167), against torch.mm, by value -> by
    vectors: M = 128, N x K = 1376 x 512 0.75 -> 0.93x, 1376 x 256 0.71 -> 0.88x, 688 x 512
    0.56 -> 0.87x, 1376 x 1376 0.76 -> 0.87x; M = 1024, 1376 x 512 0.92 -> 1.00x, 688 x 4096
    0.91 -> 1.03x. (A "nk" B clamps its rows, copied along K: nothing to gain there.)"""
    return vec if spec.b_layout == "kn" and spec.n % nr and spec.n % vec == 0 else 1


def _pad_operands(sch, spec: GemmSpec, nr: int, mr: int | None = None):
    """The packed schedules' operands. A: with ``mr``, copied first (in parallel) into tiles
    of MR rows laid out [Mp/MR, K, MR] (``_pack_a_in_tiles``); without, read in place
    (fp32/fp64: the clamp is hoisted out of the k loop) or, narrow dtypes, copied so that
    each element is converted once rather than N/NR times. B's copy laid out as panels
    [Np/NR, K, NR] in the accumulation dtype. Returns B's copy ("B_pad"), which each schedule
    places itself."""
    a_pad, b_pad = sch.get_sblock("A_pad"), sch.get_sblock("B_pad")
    if mr is not None:
        _pack_a_in_tiles(sch, a_pad, mr)
    elif spec.dtype == spec.acc_dtype:
        sch.compute_inline(a_pad)
    else:
        sch.parallel(sch.get_loops(a_pad)[0])
    if spec.b_layout == "kn":
        sch.transform_layout(b_pad, ("write", 0), lambda k, n: (n // nr, k, n % nr))
    else:
        sch.transform_layout(b_pad, ("write", 0), lambda n, k: (n // nr, k, n % nr))
    return b_pad


# The packed kernel copies A into tiles (``_pack_a_in_tiles``) only for a static K, a weight
# of at least A_PACK_MIN_B_ELEMENTS and A_PACK_MIN_PANELS panels or more (a vocabulary
# projection): elsewhere it reads A in place. The copy is a parallel loop of its own, a pass
# over A and a workspace of its size; it pays where each row of A is read again for hundreds
# of panels. Small products never won the copy back (kernels alone, 2 threads, a 2.0 GHz Intel
# Xeon, A read in place -> copied: 16 x 16 x 16 0.76x -> 0.51x torch.matmul, 64 x 64 x 64
# 1.11x -> 0.82x, N x K = 128 x 128 at M = 128 1.03x -> 0.94x). On that host the copy gained
# at 256 x 256 to 768 x 768 from M = 256 on (M = 1024: 0.87-0.91x -> 0.96-1.00x F.linear);
# on a ~3.4 GHz Xeon of the same model (FMA probe ~480 GFLOPS on 2 threads) reading A in
# place wins instead: the kernel built both ways and loaded in one process, called in turn
# on a ring of 4-8 inputs, against F.linear / torch.addmm (= 1), copied -> in place:
# M = 1024, N x K = 768 x 768 0.94-0.97x -> 0.99-1.06x, 3072 x 768 1.00x -> 1.04x, 768 x 3072
# 0.91-0.94x -> 1.02-1.03x, 512 x 512 0.96x -> 1.04-1.05x, 512 x 1376 0.92-0.94x ->
# 1.05-1.07x, 1376 x 512 (no whole panels) 0.95-0.96x -> 0.97x (M = 128-2048: within 2%
# either way); M = 128 / 256 / 512 / 2048 at 768 x 768 0.99 /
# 1.01 / 1.04 / 0.94x -> 1.05 / 1.08 / 1.01 / 1.02x; "kn" (GPT-2's Conv1D) M = 1024, 2304 x
# 768 0.89x -> 0.98x, 768 x 3072 0.88x -> 1.02x; 1024^3 0.93x -> 1.01x, 2048^3 0.93x -> 0.99x;
# 4096 x 4096 at M = 128 / 512 / 2048 1.00 / 1.03 / 0.91x -> 1.02 / 1.06 / 0.95x; N = 11008,
# K = 4096 (172 panels) at M = 128 / 512 1.04 / 1.05x -> 1.06 / 1.07x. With hundreds of
# panels the copy still wins at M = 128: N = 50257, K = 768 (786 panels) 1.06x -> 1.00x,
# N = 32000 (500 panels) 1.03x -> 1.02x (M = 1024: 1.03 / 1.21x -> 1.09 / 1.20x). Without
# the copy the A operand of a tile is six rows of A read K values apart (the hardware
# prefetchers follow six streams); the copy's own pass was 3.5-4% of a 768 x 768 call at
# M = 1026 (115 of ~3,300 us). (docs/inference-shapes.md, section 18.)
A_PACK_MIN_B_ELEMENTS = 1 << 16
A_PACK_MIN_PANELS = 256


def packs_a(spec: GemmSpec, nr: int) -> bool:
    """Whether the packed kernel for ``spec`` copies A into tiles first (see above)."""
    if spec.k is None or -(-spec.n // nr) < A_PACK_MIN_PANELS:
        return False
    return spec.n * spec.k >= A_PACK_MIN_B_ELEMENTS


def _pack_a_in_tiles(sch, a_pad, mr: int) -> None:
    """A copied, before the products and in parallel, into tiles of MR rows with the rows
    last ([Mp/MR, K, MR]): the tile loop's MR broadcasts a step then read MR consecutive
    values, one stream, where A read in place is MR streams K values apart. Kernels alone
    (2 threads, Intel Xeon, against F.linear / torch.matmul, a ring of 8 inputs), A read in
    place -> copied: M = 1032, N x K = 768 x 768 0.88-0.90x -> 0.94-0.96x, 3072 x 768
    0.87-0.88x -> 0.92-0.93x, 768 x 3072 0.94-0.99x -> 0.96-0.97x; M = 2064 0.83-0.87x ->
    0.90-0.95x; M = 128 to 512 +1% to +15%; 1024^3 "kn" 0.83x -> 0.96x. The copy is a
    workspace of M x K accumulation values per call. (With the chunks of A as the only tasks,
    each packing its own A, 516 rows: about the same, but 2 tasks at M = 1032 leave any more
    threads idle.)"""
    i, k = sch.get_loops(a_pad)
    sch.transform_layout(a_pad, ("write", 0), lambda i, k: (i // mr, k, i % mr))
    tile, row = sch.split(i, [None, mr])
    sch.reorder(tile, k, row)
    sch.unroll(row)
    sch.parallel(tile)


# The packed kernel's parallel tasks are (chunk of rows of A, panel of B), the
# chunks outer: a thread runs the panels over the same chunk of A, which stays in L2, where
# with tasks of whole panels it read all of A from L3 once per panel. Kernels alone, against
# F.linear (2 threads, Intel Xeon, a ring of 8 inputs as in a model), tasks of whole panels
# -> chunks of 258 rows: M = 2048, N x K = 512 x 512 0.64 -> 0.90x, 768 x 768 0.74 -> 0.95x,
# 3072 x 768 0.63 -> 0.89x, 768 x 3072 0.97 -> 0.94x; M = 1024, 512 x 512 0.71 -> 0.90x,
# 1376 x 512 0.78 -> 1.01x; M = 512 0.75-0.97x -> 0.87-1.07x.
#
# The tasks run in the order (half of the panels, chunk, panel): TVM hands each thread an
# equal run of consecutive tasks, so with two threads each takes half of the panels of every
# chunk, whatever M. In the order (chunk, panel) a thread took whole chunks: at M = 600
# (chunks of 258, 258 and 84 rows) one thread did 1.8 times the other's work, 0.77x F.linear
# (0.88-1.00x now). Each chunk is then read by both threads, each for its half of the panels.
# With that order, chunks of 516 rows against 258 (kernels alone, 2 threads): M = 1024,
# N x K = 768 x 768 0.92-0.96x -> 0.99x, 3072 x 768 0.95-0.99x -> 1.02-1.06x, 768 x 3072
# 0.96x -> 0.99x, 4096 x 4096 1.03x -> 1.14x; M = 2048 0.91-1.03x -> 0.94-1.01x; M = 512
# +1% to +7% (fewer packs of the weight: one per chunk). Chunks of 1032 rows where K <= 2048
# (A's copy is read as one stream, so a chunk of up to 8 MB still pays): M = 1024, 768 x 768
# 0.94x -> 0.99x, 512 x 512 0.95-0.97x -> 0.99x, 1376 x 512 0.99x -> 1.00-1.02x; M = 2048
# +0 to +9%; 2048^3 "kn" 0.92x -> 0.95x. At K = 3072 within +-3%, at K = 4096 worse
# (M = 2048: 1.04x -> 0.87x).
#
# Where N is not a multiple of the vector width (GPT-2's vocabulary, 50257; a 1000-class
# head), the output's column bound depends on the lane, and with the halves' task index
# (divided by the symbolic chunk count) TVM no longer split off the vector stores: every
# tile was stored one float at a time (M = 128, N x K = 1000 x 768: 0.74x against 1.07x;
# 50257 x 768: 0.65x against 1.08x). ``cpu_tile_store`` now gives each tile a store without
# the column bound for the panels below N, so those N take the halves too (float32 and
# float64, whose tiles are stored from registers). Kernels alone (2 threads, Intel Xeon at
# ~3.4 GHz, linear + relu against torch.addmm + relu_), the order (chunk, panel) with
# chunks of SHORT_CHUNK_ROWS -> halves: 50257 x 768 M = 128 +10%, M = 600 +43%, M = 1024 +8%,
# M = 2100 +28%; 1000 x 768 -0.5%, +26%, +2%, +15%. Narrower dtypes keep the order (chunk,
# panel) and chunks of SHORT_CHUNK_ROWS, which bounds what one thread can have over the
# other. The batched kernel (no halves) had the same value-by-value stores at such N:
# attention's `Q @ K^T` at S = 197 (ViT) and 77 (CLIP's text), B*H = 12 / 96, against
# torch.bmm: 0.64 / 0.67x -> 0.90 / 0.93x and 0.48 / 0.54x -> 0.67 / 0.74x with the split.
M_CHUNK_ROWS = 516
LONG_CHUNK_ROWS, LONG_CHUNK_MAX_K = 1032, 2048
SHORT_CHUNK_ROWS = 258

# The "rows" variant: from ROWS_MIN_M rows the tasks are (half of the rows of A, panel), a
# thread each half, every thread packing all of B for itself. In a model, A is the output of
# the op before (a LayerNorm, an RMSNorm), written half by each thread; with half of the panels
# each, a thread reads the other thread's half of A from the other core. Kernels alone, A
# fresh from F.rms_norm at each call, 2 threads, Intel Xeon (Emerald Rapids), against F.linear
# (= 1), halves of the panels -> halves of the rows: M = 1024, N x K = 512 x 512 0.81-0.85x ->
# 0.97-1.03x, 768 x 768 0.89-0.94x -> 0.95-1.04x, 1376 x 512 0.89-0.96x -> 0.92-0.96x,
# 512 x 1376 0.94-1.02x -> 0.95-1.04x, 768 x 3072 0.81x -> 0.99x, 3072 x 768 0.94x -> 0.98x,
# 4096 x 4096 0.95x either way; M = 512 and 600: 512 x 512 0.92 / 0.88x -> 1.00 / 1.03x,
# 768 x 768 0.90 / 0.94x -> 1.10 / 1.06x; M = 1536 and 2048 +2% to +15%; "kn" (GPT-2's
# Conv1D) M = 512-1024 +0 to +9%. Where A stays hot (one input, no op before): within -3% to
# +5%. Not below ROWS_MIN_M: each thread packs the whole weight, which at M = 128-256 costs
# more than it wins (M = 128: 768 x 3072 0.96x -> 0.87x, 4096 x 4096 1.01x -> 0.80x). Nor for
# vocabulary projections, whose copy of A wins (``packs_a``: N = 50257, K = 768, M = 600 /
# 1024 0.92 / 1.09x -> 0.80 / 1.00x): N up to ROWS_MAX_N. Past the chunked kernel's 1032-row
# chunks the halves still win, though a half of A no longer stays in the L2 (its rows are
# read again for each panel from L3 either way): M = 2560 / 3000 / 4096, 512 x 512 0.86 /
# 0.85 / 0.86x -> 0.97 / 0.94 / 0.94x, 768 x 768 0.83 / - / 0.90x -> 0.88 / - / 0.98x,
# 768 x 3072 M = 2560 / 4096 / 8192 1.01 / 1.01 / 1.05x -> 1.10 / 1.10 / 1.04x, 4096 x 4096 at
# M = 8192 0.99x either way; ResNet's 1x1 convs as GEMMs over the pixels, M = 3136 / 25088:
# N x K = 256 x 64 0.90-0.93 / 0.92x -> 1.16-1.25 / 0.96x, 64 x 256 1.08-1.19 / 1.16x ->
# 1.05-1.27 / 1.20x, 128 x 512 0.92 / 0.88x -> 0.98 / 0.96x, 512 x 128 0.91 / 0.92x -> 1.00 /
# 0.91x.
ROWS_MIN_M = 512
ROWS_PANEL = 64  # (the AVX-512 panel: "rows" needs 32 vector registers)
ROWS_MAX_N = (A_PACK_MIN_PANELS - 1) * ROWS_PANEL
# Below ROWS_MIN_M the halves still win where whole panels do not share out evenly: with two
# threads and an odd number of panels one thread runs a panel more (N = 192: 2 panels
# against 1). Each thread packing the whole weight pays once M covers the packs of the extra
# panels, a pack costing about ROWS_PACK_ROWS rows of a panel's tiles (``rows_split_wins``):
# M > 8 (panels - 1) for two threads. Through the op, weights cycled through 32 MB, 2 threads,
# Intel Xeon (Emerald Rapids), F.linear = 1, packed -> rows: N x K = 64 x 256 (one panel) M =
# 40 / 64 / 128 / 256 0.80 / 0.90 / 0.84 / 0.77x -> 0.99 / 1.21 / 1.27 / 1.30x; 192 x 192 M = 33
# / 50 / 128 / 197 0.80-1.06 / 0.82 / 0.97 / 0.88x -> 1.03-1.11 / 0.99 / 1.22 / 1.12x; 192 x 768
# (ViT-Tiny's second MLP layer) 0.80 / 0.83 / 0.81 / 0.80x -> 0.93 / 1.00 / 1.05 / 1.00x at M =
# 33 / 80 / 128 / 197; 320 x 320 0.86 / 0.88 / 0.90x -> 0.95 / 1.02 / 1.05x (M = 33 / 80 /
# 128); 448 x 448 (7 panels) M = 128 / 256 0.89 / 0.94x -> 0.97 / 1.01x; 576 x 192 (9) M = 128
# / 197 / 256 0.91 / 0.93 / 1.00x -> 0.99 / 1.02 / 1.07x but M = 50 0.93x -> 0.94x; 704 x 704
# (11) M = 128 / 256 0.91 / 0.97x -> 0.93 / 1.01x. An even number of panels keeps whole ones
# (512 x 512 M = 128 1.06x -> 0.97x). At M = 56-64 the halves also beat the swap kernels
# for these weights (64 x 256: swap 0.49-0.54x, packed 0.90-0.93x, rows 1.20-1.24x; 320 x 320
# 0.74-0.80x, 0.86-0.92x, 0.93-1.04x); at M <= DOT_MAX_M the dot and swap32 kernels keep them.
# A matmul of two activations (K symbolic in the kernel) takes the same rule by the call's K
# (Intel Xeon, KVM model 167, 2 threads, `tg.matmul` against torch.matmul, two alternating
# runs each, whole panels -> rows): M x N x K = 100 x 64 x 256 0.72 -> 1.15-1.19x, 600 x 192 x
# 300 0.74-0.79 -> 1.06-1.08x; 2048^3 0.96-0.97 -> 0.97-0.99x, 768 x 768 x 2048 0.90-0.94 ->
# 0.94x, 1024^3 and 768 x 3072 x 512 within the runs' spread (0.92-0.96x either way).
ROWS_PACK_ROWS = 8


def task_order(spec: GemmSpec, nr: int, vec: int) -> tuple[int, int]:
    """(halves, rows of A per chunk) of the packed kernel's tasks (see above)."""
    if -(-spec.n // nr) < 2 or (spec.n % vec and spec.dtype != spec.acc_dtype):
        return 1, SHORT_CHUNK_ROWS
    short_k = spec.k is not None and spec.k <= LONG_CHUNK_MAX_K
    return 2, LONG_CHUNK_ROWS if short_k else M_CHUNK_ROWS


def _schedule_packed(sch, spec: GemmSpec, mr: int, nr: int, vec: int):
    """Returns the pack's loops for ``cpu_pack_prefetch``: (K tiles, rows of a tile) where it
    transposes a "nk" B, (rows, columns) where it copies a "kn" one; None at K = 1. The
    "rows" variant's tasks are (half of the rows, panel), its M padded to 2 x MR rows by
    ``gemm_compute``; the other tasks follow ``task_order``."""
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    b_pad = _pad_operands(sch, spec, nr, mr if packs_a(spec, nr) else None)
    i, j, k = sch.get_loops(acc)
    io, ii = sch.split(i, [None, mr])
    jo, ji = sch.split(j, [None, nr])
    jio, jii = sch.split(ji, [None, vec])
    if spec.variant == "rows":
        halves = 1  # (of the panels)
        # M padded to 2 x MR rows: the tiles split evenly in two, so no bound test is needed
        # (TVM cannot prove that for a symbolic M and would test it in the K loop).
        mh, io = sch.split(io, [2, None], disable_predication=True)
        sch.reorder(mh, jo, io, k, ii, jio, jii)
        outer = [mh, jo]
    else:
        halves, rows = task_order(spec, nr, vec)
        mo, io = sch.split(io, [None, max(1, rows // mr)])
        jh, jo = sch.split(jo, [halves, None])
        sch.reorder(jh, mo, jo, io, k, ii, jio, jii)
        outer = [jh, mo, jo]
    sch.reverse_compute_at(out, io)
    _store_tile_from_registers(sch, spec, out, vec)
    sch.set_scope(acc, 0, "local")
    sch.unroll(ii)
    sch.unroll(jio)
    sch.vectorize(jii)
    task = sch.fuse(*outer)
    sch.parallel(task)
    # Pack each panel right before its use, by the thread that uses it, while it is in
    # cache (measured +5-10% at M=256 over packing all of B first); once per chunk of A.
    sch.compute_at(b_pad, task)
    pack_loops = None
    # (At K = 1, compute_at leaves the pack no K loop: a plain copy then.)
    if spec.b_layout == "nk" and spec.k != 1:
        in_registers = transposes_in_registers(spec, nr, vec, halves)
        pack_loops = _transpose_in_tiles(sch, b_pad, vec, in_registers)
    elif spec.k != 1:
        # A "kn" panel: each row's NR values copied in vectors (as a plain loop, vectorized by
        # LLVM, the copy alone ran 11% slower; through the op, GPT-2's Conv1D shapes against
        # torch.addmm: M = 32 and 128 the same, M = 1024 +2-6%).
        k_rows, columns = sch.get_loops(b_pad)[-2:]
        vectors, lanes = sch.split(columns, [None, vec])
        sch.unroll(vectors)
        sch.vectorize(lanes)
        pack_loops = (k_rows, vectors, lanes)
    sch.decompose_reduction(acc, k)
    return pack_loops


def _schedule_swapped(sch, panel: int, rows: int, tiles: int, vec: int) -> None:
    """The "swap" variants: per parallel task ``tiles`` x ``rows`` rows of the weight; for each
    panel of ``panel`` rows of x, each ``rows`` x ``panel`` tile of the transposed result sums
    in registers over all of K (``rows`` broadcasts of the weight, ``panel / vec`` vector loads
    of the panel a step). x is packed into panels first, all of it, in parallel, by 16 x 16
    transposes. The rule calls it with one panel of x, or two for "swap2" (``gemm_variant``),
    which each task runs one after the other."""
    a_pad, acc, out = sch.get_sblock("A_pad"), sch.get_sblock("acc"), sch.get_sblock("out")
    epi = sch.get_sblock("epi")
    sch.compute_inline(sch.get_sblock("B_pad"))  # the weight, read in place (rows clamped)
    sch.transform_layout(a_pad, ("write", 0), lambda i, k: (i // panel, k, i % panel))
    # The tile's accumulators with the rows of x last: contiguous vectors; bias and activation
    # on them in registers, vectorized the same way ("epi"), before the transposed store.
    sch.transform_layout(acc, ("write", 0), lambda i, j: (j, i))
    sch.transform_layout(epi, ("write", 0), lambda i, j: (j, i))
    i, j, k = sch.get_loops(acc)
    io, iv, ii = sch.split(i, [None, panel // vec, vec])
    jo, jt, ji = sch.split(j, [None, tiles, rows])
    sch.reorder(jo, io, jt, k, ji, iv, ii)
    sch.reverse_compute_at(epi, jt)
    ei, ej = sch.get_loops(epi)[-2:]
    eiv, eii = sch.split(ei, [None, vec])
    sch.reorder(ej, eiv, eii)
    sch.unroll(ej)
    sch.unroll(eiv)
    sch.vectorize(eii)
    sch.set_scope(epi, 0, "local")
    sch.reverse_compute_at(out, jt)
    sch.set_scope(acc, 0, "local")
    sch.unroll(ji)
    sch.unroll(iv)
    sch.vectorize(ii)
    sch.parallel(jo)
    pi, pk = sch.get_loops(a_pad)
    po, pv, pr = sch.split(pi, [None, panel // vec, vec])
    k0, k1 = sch.split(pk, [None, vec])
    sch.reorder(po, k0, pv, pr, k1)
    sch.parallel(po)
    sch.unroll(pr)
    sch.vectorize(k1)
    sch.decompose_reduction(acc, k)


def _schedule_packed_kblocked(sch, spec: GemmSpec, mr: int, nr: int, vec: int, cpu: CpuInfo):
    """The packed schedule over K chunks: per parallel task (a few N panels), for each chunk
    its piece of the B panels is packed, then every MR x NR tile of that chunk is summed in
    registers and added into the task's accumulator panel; "out" (bias, activation, cast)
    runs once per task after the last chunk."""
    partial, acc, out = sch.get_sblock("partial"), sch.get_sblock("acc"), sch.get_sblock("out")
    # Where the chunks pad K, A is copied into tiles first, its padding zeros: read in place,
    # it would be tested against K at every step of the tiles (see ``k_chunk``).
    padded = spec.k % k_chunk(spec, cpu) != 0
    b_pad = _pad_operands(sch, spec, nr, mr if padded else None)
    i, j, c = sch.get_loops(acc)
    io, ii = sch.split(i, [None, mr])
    jo, jw, ji = sch.split(j, [None, _panels_per_task(spec, nr, cpu), nr])
    jio, jii = sch.split(ji, [None, vec])
    # A tile of A (MR x chunk) is read from L1 by every panel of the task.
    sch.reorder(jo, c, io, jw, ii, jio, jii)
    sch.parallel(jo)
    sch.reverse_compute_at(out, jo)
    sch.compute_at(partial, jw)
    sch.set_scope(partial, 0, "local")
    pi, pj, pk = sch.get_loops(partial)[-3:]
    pjo, pji = sch.split(pj, [None, vec])
    sch.reorder(pk, pi, pjo, pji)
    sch.unroll(pi)
    sch.unroll(pjo)
    sch.vectorize(pji)
    sch.decompose_reduction(partial, pk)
    sch.compute_at(b_pad, c)
    if spec.b_layout == "nk":
        # (rows of the weight 16 at a time along the whole chunk: 1.05x against 0.94x torch
        # with the chunk's rows all in flight). LLVM's transpose: ``cpu_transpose`` measured
        # +5-6% at M = 128 but -4 to -6% at M = 512 here (N = 4096, K = 11008).
        _transpose_in_tiles(sch, b_pad, vec)
    else:
        # A "kn" chunk: each row's run of the task's columns copied in vectors, NR values to
        # each panel. (As one loop over the columns, the panel index j // NR kept LLVM to a
        # copy value by value: the pack of 1280 x 5120 ran at a quarter of the "nk" one's rate.)
        _, columns = sch.get_loops(b_pad)[-2:]
        _, vectors, lanes = sch.split(columns, [None, nr // vec, vec])
        sch.unroll(vectors)
        sch.vectorize(lanes)
    sch.unroll(ii)
    sch.unroll(jio)
    sch.vectorize(jii)
    sch.decompose_reduction(acc, c)
    o_in = sch.split(sch.get_loops(out)[-1], [None, vec])[1]
    sch.vectorize(o_in)
    return jo, c, io


def _panels_per_task(spec: GemmSpec, nr: int, cpu: CpuInfo) -> int:
    """N panels per parallel task of the K-blocked kernel: ``kn_panels_per_task``'s for a
    "kn" Linear weight, else the most (up to PANELS_PER_TASK) that still leave 8 tasks or
    more, so that two threads get even shares."""
    kn_width = kn_panels_per_task(spec, cpu)
    if kn_width:
        return kn_width
    panels = -(-spec.n // nr)
    for w in range(PANELS_PER_TASK, 1, -1):
        if panels % w == 0 and panels // w >= 8:
            return w
    return 1


PANELS_PER_TASK = 2


def _store_tile_from_registers(sch, spec: GemmSpec, out, vec: int) -> None:
    """The "out" stage of one MR x NR register tile, unrolled by rows and vectorized by VEC:
    every access then has a constant offset, so LLVM stores the accumulator registers
    straight to the output. Left as a loop nest, the tile went through a workspace buffer
    on every tile (zeroed by a memset, stored, copied back in 256-bit pieces): at attention's
    K = 64 and 128 the round trip cost 4-9% of the kernel, at K >= 768 within noise. (bf16
    and fp16 kernels keep the loop nest: not measured with it.)"""
    rows, cols = sch.get_loops(out)[-2:]
    extents = [_const_extent(sch, loop) for loop in (rows, cols)]
    # A tile narrower than N's own width (N < NR) or M < MR: bounds TVM leaves symbolic.
    if spec.dtype != spec.acc_dtype or None in extents or extents[1] % vec:
        return
    cols_o, cols_i = sch.split(cols, [None, vec])
    sch.unroll(rows)
    sch.unroll(cols_o)
    sch.vectorize(cols_i)


def _const_extent(sch, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if hasattr(extent, "value") else None


# The pack of a "nk" B transposes each 16 x 16 tile with ``cpu_transpose``'s shuffles (4
# two-input shuffles and one full store per 16 values) where LLVM, given the tile as 16
# vector loads, took it apart in 128-bit pieces (~12 shuffles and 4 narrow stores per 16
# values): float32 on AVX-512, a static K of whole tiles, N of whole panels (no clamped
# columns), and as many panels for each half of the tasks (else the halves' bound is a
# predicate on the tile, which the intrinsic cannot take). Kernels alone, 2 threads, Intel
# Xeon at ~3.4 GHz, a ring of 8 weights, against torch.addmm / torch.bmm, LLVM's transpose ->
# these shuffles: the pack alone (M = 6-7) +3% to +7%; M = 128 +1.4% to +5.4% (BERT, GPT-2 and
# LLaMA-style shapes, 512 x 512 to 4096 x 4096); M = 256 +1% to +5%; M = 512 +0.4% to +3%;
# M = 1024 -1.8% to +5.7% (five readings of eight above 0); `Q @ K^T`, B*H = 12 and 96,
# S = 128, D = 64, +1.6% to +3.4% (docs/inference-shapes.md section 15). (The pack reads the
# weight from L3 at about the core's rate either way: the gain is the instructions.)
def transposes_in_registers(spec: GemmSpec, nr: int, vec: int, halves: int = 1) -> bool:
    """Whether the packed kernel's pack of a "nk" B uses ``cpu_transpose`` (see above)."""
    if spec.dtype != "float32" or vec != cpu_transpose.SIZE or spec.k is None:
        return False
    panels, exact = divmod(spec.n, nr)
    return spec.k % vec == 0 and exact == 0 and panels % halves == 0


def _transpose_in_tiles(sch, b_pad, vec: int, in_registers: bool = False):
    """Pack a "nk" B (a Linear weight, read along K) into N-contiguous panels by VEC x VEC
    tiles: per tile, VEC vector loads along K, unrolled over VEC rows, which LLVM turns into an
    in-register transpose, or with ``in_registers`` the tile as one ``cpu_transpose`` block.
    Left as one (n, k) loop nest, the pack wrote one float per cache line per step and cost
    four times the math at M=32 (docs/inference-shapes.md).

    VEC rows of the weight at a time, each read along all of K: with a panel's 64 rows all in
    flight at once the prefetchers lost track of them once the weight came from L3, as it
    does in a model (measured in situ, 2 threads, converted/eager: BERT-style encoder batch 1
    0.93-0.97x -> 1.03-1.07x, LLaMA-style stack 0.95-0.97x -> 1.02x; the same kernels timed
    alone on a weight kept hot in L2, within noise of each other).

    A static K off whole vectors packs its whole tiles so and its last K % VEC values apart,
    one value at a time: with one loop for all of K, the bounds test of the last tile sat in
    every tile's vector loop, which then ran a lane at a time (kernels alone, 2 threads, Intel
    Xeon, against F.linear, before -> after: N x K = 1000 x 33 at M = 4 / 8 / 16 / 64 0.28 /
    0.56 / 0.81 / 0.97x -> 0.45 / 0.85 / 1.22 / 1.24x, 768 x 300 0.31 / 0.41 / 0.63 / 0.69x
    -> 0.54 / 0.70 / 0.99 / 0.87x, 1000 x 100 at M = 16 0.72x -> 1.13x).

    Returns the (tiles along K, rows of a tile) loops; the second None with ``in_registers``;
    None where K's last values are packed apart (no prefetch then: ``cpu_pack_prefetch``)."""
    n, k = sch.get_loops(b_pad)[-2:]
    k_extent = _const_extent(sch, k)
    k0, k1 = sch.split(k, [None, vec])
    n0, n1 = sch.split(n, [None, vec])
    sch.reorder(n0, k0, n1, k1)
    if in_registers:
        sch.tensorize(n1, cpu_transpose.intrinsic())
        return k0, None
    if k_extent is not None and k_extent > vec and k_extent % vec:
        whole = _tail_apart(sch, k0, k_extent, vec)
        rows, lanes = sch.get_loops(sch.get_child_blocks(whole)[-1])[-2:]
        sch.unroll(rows)
        sch.vectorize(lanes)
        return None
    sch.unroll(n1)
    sch.vectorize(k1)
    return k0, n1


# The "kn" gemv: per task GEMV_KN_SPAN columns (24 vectors, 1.5 KB of a float32 row of B),
# the K loop outside the rows of A, sums kept in memory (L1) and K unrolled by
# GEMV_KN_K_UNROLL so that each sum is loaded and stored once per 16 values of K. Each row
# of B is then read once, for all rows of A, in pieces long enough for the prefetchers.
# The 64-column panels it had before read B once per row of A, 256 bytes per row of B.
# Measured through the op (TVMConv1D's call: GPT-2's 768 x 2304, 768 x 768, 768 x 3072 and
# 3072 x 768 weights, cycling through 256 MB so that they come from memory), 2 threads,
# Intel Xeon, against torch.addmm, before -> after: M=1 0.65-0.86x -> 0.86-0.91x, M=4
# 0.43-0.98x -> 1.00-1.51x, M=8 0.29-0.86x -> 1.04-1.32x, M=16 0.21-0.78x -> 0.92-1.18x.
# A symbolic K (matmul of two activations) keeps K rolled (a predicated unroll was slower):
# 0.09-0.28x -> 0.56-0.84x torch.matmul at M = 4..16.
GEMV_KN_SPAN = 384
GEMV_KN_K_UNROLL = 16
GEMV_KN_VECTOR_UNROLL = 2


# Few tasks of the "kn" gemv must come in an even count: with 3 or 5 tasks one of two threads
# ran twice the other's share (kernels alone, 2 threads, Intel Xeon, B 768 x 960, M = 1, spans
# of 320 / 240 / 192 / 160 columns, i.e. 3 / 4 / 5 / 6 tasks: 49 / 31 / 43 / 29 us,
# torch.matmul 24 us). From GEMV_KN_EVEN_TASKS_BELOW tasks on the odd one out is a small part.
# The 17 N up to 8000 whose span this changes, K = 768 symbolic, against torch.matmul, old ->
# new span, M = 1 / 4: N = 800 0.78 / 0.97x -> 0.97 / 1.25x, 960 0.47 / 0.71x -> 0.82 /
# 1.08x, 1152 0.54 / 0.62x -> 0.93 / 0.96x, 1440 0.63 / 0.67x -> 0.82 / 0.85x, 1920 0.67 /
# 1.04x -> 0.86 / 1.60x, 2688 0.77 / 1.07x -> 0.87 / 1.42x.
GEMV_KN_EVEN_TASKS_BELOW = 8


def gemv_kn_span(n: int, vec: int) -> int:
    """Columns per task of the "kn" gemv: the most whole vectors, up to GEMV_KN_SPAN columns,
    that divide N's whole vectors, into an even count of tasks if that costs at most half
    the span. An N off the vectors has one more task, for its last few columns, which reads
    them clamped, gathered a lane at a time (``whole_tasks_apart`` keeps the clamp out of the
    other tasks)."""
    vectors, most = max(n // vec, 1), GEMV_KN_SPAN // vec
    spans = [d for d in range(1, most + 1) if vectors % d == 0]
    balanced = [d for d in spans if _balanced_tasks(vectors // d)]
    if balanced and 2 * max(balanced) >= max(spans):
        return max(balanced) * vec
    return max(spans) * vec


def _balanced_tasks(tasks: int) -> bool:
    return tasks <= 2 or tasks % 2 == 0 or tasks >= GEMV_KN_EVEN_TASKS_BELOW


def _schedule_gemv_kn(sch, spec: GemmSpec, span: int, vec: int):
    """acc[i, j:j+span] += A[i, k] * B[k, j:j+span] for each k, then each i: one pass over
    the task's columns of B, whole rows of them at a time. Returns the loop over the tasks."""
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    sch.compute_inline(sch.get_sblock("A_pad"))
    sch.compute_inline(sch.get_sblock("B_pad"))
    i, j, k = sch.get_loops(acc)
    jo, ji = sch.split(j, [None, span])
    pairs = GEMV_KN_VECTOR_UNROLL if span // vec % GEMV_KN_VECTOR_UNROLL == 0 else 1
    jv, ju, jl = sch.split(ji, [None, pairs, vec])
    unroll = 1  # a symbolic K: a plain loop; a static one: the largest unroll dividing it
    if spec.k is not None:
        unroll = next(u for u in (GEMV_KN_K_UNROLL, 8, 4, 2, 1) if spec.k % u == 0)
    ko, ki = sch.split(k, [None, unroll])
    sch.reorder(jo, ko, i, jv, ki, ju, jl)
    sch.reverse_compute_at(out, jo)
    sch.unroll(ki)
    sch.unroll(ju)
    sch.vectorize(jl)
    if _gemv_parallel(spec, -(-spec.n // span)):
        sch.parallel(jo)
    sch.decompose_reduction(acc, ko)
    sch.vectorize(sch.split(sch.get_loops(out)[-1], [None, vec])[1])
    return jo


def whole_tasks_apart(mod, task, whole: int):
    """``mod`` with the body of its loop over ``task`` in two copies: one for the first
    ``whole`` tasks, whose columns all lie below N, one for the rest. In the first TVM's
    simplifier drops the clamp of the column index (``min(j, N - 1)``, which keeps the last
    task's reads inside B) and the stores' column test, and its loads and stores are vectors
    again: with the clamp in every task each vector was gathered a lane at a time. Kernels
    alone, 2 threads, AMD EPYC (Zen 5), against torch.matmul, before -> after: B 768 x 50257
    at M = 1 / 4 / 16 0.76 / 0.62 / 0.23x -> 1.68 / 2.68 / 1.72x. (The task's buffers are
    first placed inside the task, so that each copy has its own.)"""
    from tvm import s_tir, tirx

    from .tir_rewrite import fresh_copy, replace_loops, with_body

    def split(loop):
        if not loop.loop_var.same_as(task):
            return None
        first = task < whole  # (the constant takes the loop variable's type)
        return with_body(loop, tirx.IfThenElse(first, fresh_copy(loop.body), loop.body))

    mod = s_tir.transform.PlanAndUpdateBufferAllocationLocation()(mod)
    mod, split_made = replace_loops(mod, split)
    assert split_made, "the task loop is not in the module"
    return mod


# Below this many B elements a small-M product takes about a microsecond on one core, and
# waking TVM's other workers costs as much: run it on the calling thread (measured:
# linear M=1, N=K=256 through the C++ path, 4.3-4.5 us -> 3.9 us per call).
GEMV_PARALLEL_MIN_ELEMENTS = 1 << 17


def _gemv_parallel(spec: GemmSpec, tasks: int) -> bool:
    """Whether a gemv's outer loop (``tasks`` iterations) is worth TVM's parallel launch."""
    if tasks <= 1:
        return False
    return spec.k is None or spec.n * spec.k >= GEMV_PARALLEL_MIN_ELEMENTS


# The "nk" gemv computes GEMV_NK_ROWS outputs together, sharing each load of A; N is padded to
# a whole number of them (the padded rows read the weight's last row, and are not stored):
# split unevenly, every group carried a bounds check, and at N = 50257 (GPT-2's vocabulary)
# the kernel ran at 0.31-0.38x F.linear, against 0.84x at N = 50256 (M=1, K=768, 2 threads).
GEMV_NK_ROWS = 4


def _schedule_gemv_nk(sch, spec: GemmSpec, vec: int) -> None:
    """Dot products along K; rfactor keeps VEC partial sums per output in one vector."""
    rows = GEMV_NK_ROWS
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    sch.compute_inline(sch.get_sblock("A_pad"))
    sch.compute_inline(sch.get_sblock("B_pad"))
    i, j, k = sch.get_loops(acc)
    ko, ki = sch.split(k, [None, vec])
    rf = sch.rfactor(ki, 0)
    i, j, ko, ki = sch.get_loops(rf)
    jo, ji = sch.split(j, [None, rows])
    sch.reorder(jo, i, ko, ji, ki)
    sch.reverse_compute_at(acc, i)
    sch.reverse_compute_at(out, i)
    sch.set_scope(rf, 0, "local")
    sch.unroll(ji)
    sch.vectorize(ki)
    if _gemv_parallel(spec, -(-spec.n // rows)):
        sch.parallel(jo)
    sch.decompose_reduction(rf, ko)


def _schedule_dot_nk(sch, spec: GemmSpec, vec: int, tile: tuple[int, int]) -> None:
    """MR x NR dot products along K in registers (rfactor: VEC partial sums per output)."""
    mr, nr = tile
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    sch.compute_inline(sch.get_sblock("A_pad"))
    sch.compute_inline(sch.get_sblock("B_pad"))
    i, j, k = sch.get_loops(acc)
    ko, ki = sch.split(k, [None, vec])
    # The lanes last in the partial-sum buffer (factor_axis 2), so that each accumulator is
    # one contiguous vector: with them first LLVM kept the sums in memory, gathered (0.5 GF/s).
    rf = sch.rfactor(ki, 2)
    i, j, ko, ki = sch.get_loops(rf)
    io, ii = sch.split(i, [None, mr])
    jo, ji = sch.split(j, [None, nr])
    sch.reorder(jo, io, ko, ii, ji, ki)
    sch.reverse_compute_at(acc, io)
    parallel = _gemv_parallel(spec, -(-spec.n // nr))
    vector_epilogue = spec.activation in VECTOR_EPILOGUES
    if not vector_epilogue:
        sch.reverse_compute_at(out, io)
    sch.set_scope(rf, 0, "local")
    sch.unroll(ii)
    sch.unroll(ji)
    sch.vectorize(ki)
    if parallel:
        sch.parallel(jo)
    sch.decompose_reduction(rf, ko)
    if spec.k is not None and spec.k > vec and spec.k % vec:  # (see DOT_K_MULTIPLE)
        _tail_apart(sch, sch.get_loops(rf)[-4], spec.k, vec)  # (rf: the update block now)
    if vector_epilogue:
        _epilogue_in_vectors(sch, spec, out, vec, parallel)


# The dot kernels' activations that run as a loop of their own (``_epilogue_in_vectors``):
# the polynomial ones.
VECTOR_EPILOGUES = ("gelu", "gelu_tanh", "silu", "sigmoid")


def _epilogue_in_vectors(sch, spec: GemmSpec, out, vec: int, parallel: bool) -> None:
    """The dot kernels' "out" (bias, activation, cast) as a loop of its own after the
    products, each row's whole vectors vectorized, its last N % VEC values a value a step.
    At each MR x NR tile (NR = 6 columns) it ran a value at a time, and an activation's
    polynomial cost as much as the product: kernels alone, 2 threads, Intel Xeon (Emerald
    Rapids), M = 8, N = 3072 K = 768: 303 us without activation, 556 us with gelu, 444 with
    silu; as a loop of its own gelu 705 -> 436 us, 1376 x 512 at M = 17 651 -> 296 us (the
    sums go through a workspace of M x N values: a write and a read of each, and a second
    parallel loop, which a ReLU does not pay back: 325 -> 352 us)."""
    rows, cols = sch.get_loops(out)
    vectors, lanes = sch.split(cols, [None, vec])
    if spec.n < vec:  # a row shorter than a vector: no whole one to split off
        sch.loop_partition(lanes, [spec.n, None])  # (lanes past N: a false test)
    elif spec.n % vec:
        whole = _tail_apart(sch, vectors, spec.n, vec)
        sch.vectorize(sch.get_loops(sch.get_child_blocks(whole)[-1])[-1])
    else:
        sch.vectorize(lanes)
    if parallel:
        sch.parallel(rows)


def _tail_apart(sch, vectors, extent: int, vec: int):
    """Split ``vectors``, a loop over the vectors of a static extent (K, or a row's N; VEC
    lanes, the innermost loop of its body), into the whole vectors and the last extent % VEC
    values, a value a step: with one loop the last vector's bounds test sat in every
    vector's loop, which then ran a lane at a time. Returns the whole vectors' loop (a
    loop_partition drops its loop's annotations)."""
    whole, last = sch.loop_partition(vectors, [extent // vec, None])
    lanes = sch.get_loops(sch.get_child_blocks(last)[-1])[-1]
    sch.loop_partition(lanes, [extent % vec, None])  # (lanes past the extent: a false test)
    return whole


def _schedule_packed_batched(sch, spec: GemmSpec, mr: int, nr: int, vec: int):
    """The packed schedule per batch entry, (batch, N panel) fused into one parallel loop: one
    launch for the whole batch, each task packing and using its own panel. Returns the
    transposing pack's loops of a "nk" B (for ``cpu_pack_prefetch``), else None."""
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    a_pad, b_pad = sch.get_sblock("A_pad"), sch.get_sblock("B_pad")
    if spec.dtype == spec.acc_dtype:
        sch.compute_inline(a_pad)
    else:
        sch.parallel(sch.fuse(*sch.get_loops(a_pad)[:2]))
    # A "kn" B exactly one panel wide (attention's V, N = head dim 64) is already in the
    # panel layout: read in place (P @ V, S=128: 0.96x -> 1.05x torch.bmm on 1 thread).
    in_place = spec.b_layout == "kn" and spec.n == nr and spec.dtype == spec.acc_dtype
    if in_place:
        sch.compute_inline(b_pad)
    elif spec.b_layout == "kn":
        sch.transform_layout(b_pad, ("write", 0), lambda b, k, n: (b, n // nr, k, n % nr))
    else:
        sch.transform_layout(b_pad, ("write", 0), lambda b, n, k: (b, n // nr, k, n % nr))
    b, i, j, k = sch.get_loops(acc)
    io, ii = sch.split(i, [None, mr])
    jo, ji = sch.split(j, [None, nr])
    jio, jii = sch.split(ji, [None, vec])
    sch.reorder(b, jo, io, k, ii, jio, jii)
    task = sch.fuse(b, jo)
    sch.reverse_compute_at(out, io)
    _store_tile_from_registers(sch, spec, out, vec)
    sch.set_scope(acc, 0, "local")
    sch.unroll(ii)
    sch.unroll(jio)
    sch.vectorize(jii)
    sch.parallel(task)
    if not in_place:
        sch.compute_at(b_pad, task)
    pack_loops = None
    if spec.b_layout == "nk" and spec.k != 1:  # (as in _schedule_packed)
        in_registers = transposes_in_registers(spec, nr, vec)
        pack_loops = _transpose_in_tiles(sch, b_pad, vec, in_registers)
    sch.decompose_reduction(acc, k)
    return pack_loops
