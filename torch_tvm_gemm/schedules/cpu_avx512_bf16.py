"""bfloat16 GEMM on AVX512-BF16's ``vdpbf16ps``: CPUs with that extension and no AMX tiles
(AMD Zen 4 and 5, Intel Cooper Lake), written in TensorIR.

Without it a bf16 GEMM here runs the fp32 micro-kernel on converted operands, at the fp32
rate, while torch's bf16 linear (oneDNN) runs ``vdpbf16ps`` at twice that: converted models
ran at 0.56-0.78x eager in bf16 on an AMD EPYC (Zen 5), against 1.9-2.6x in fp32.

``vdpbf16ps`` adds to 16 fp32 lanes the products of 16 bf16 pairs, lane ``j`` +=
``a[2j] b[2j] + a[2j+1] b[2j+1]``. With B packed in pairs per panel of 32 columns
(``cpu_amx.pack_nk`` / ``pack_kn``: row ``k2`` holds ``(B[2 k2, n], B[2 k2 + 1, n])`` for the
32 columns ``n``, two vectors) and A's pair ``(A[m, 2 k2], A[m, 2 k2 + 1])``, one 32-bit
word read in place, broadcast to the 16 lanes, one instruction is 16 columns x 2 values of
K for one row. The register tile: MR rows x 32 columns, 2 MR accumulators, 2 vector loads
of the panel and MR broadcasts per pair of K (the last block of rows a tail tile of 4 or 8
rows where that covers it: ``TAIL_ROWS``). Parallel over the panels: each task packs its
panel once, then runs every MR-row block of A over it, a chunk of K at a time where the
panel outgrows the L1 (the sums kept in memory between chunks), while the next panel of B
is prefetched.

TVM 0.27 legalises every bf16 vector expression to fp32 and its LLVM code generator has no
bfloat type, while the instruction's LLVM intrinsic takes ``<32 x bfloat>`` operands. So the
kernel calls a three-line LLVM IR function, imported into its module
(``pragma_import_llvm``) and inlined, that bitcasts 16 32-bit words to 32 bf16 values.
Sums are fp32 throughout; the epilogue adds the bias, applies the activation and rounds to
bf16 (round to nearest even, as torch).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from ..kernels.gemm import GemmSpec, apply_activation
from ..target import CpuInfo, host_cpu
from . import cpu_amx

SCHEDULE_VERSION = 11  # (9: matmul of activations, batched; 10: the CPU rounds; 11: K unchunked)

PANEL = cpu_amx.BLOCK  # columns of B per task: 2 vectors of 16 fp32 lanes
MR = 12  # rows of A per register tile: 24 accumulators + 2 panel vectors + 1 broadcast of 32
# K in chunks: a chunk's pairs of the panel (128 bytes a pair of K) stay in the L1 while every
# block of A's rows runs over them; a panel that fits the L1 whole (L1_PAIRS: 48 KB) is not
# chunked. Measured: docs/inference-shapes.md section 20.
CHUNK_PAIRS = 256
L1_PAIRS = 384

DOT_FUNCTION = "tvm_gemm_dpbf16"
# The 32 outputs of a panel's row rounded to bf16 by the CPU (vcvtne2ps2bf16: to nearest even,
# NaN kept, and, unlike a cast in code, values below bf16's normal range flushed to zero, as
# vdpbf16ps and torch's own bf16 matmul on oneDNN do). TVM's cast is ~10 integer instructions
# a vector; the plain sums of a product (no bias, no activation) take this instead: +2-4% at K =
# 64 (attention's products), where the epilogue weighs most. See _block_epilogue.
CVT_FUNCTION = "tvm_gemm_cvt2bf16"
# acc (16 fp32) + a . b, a and b 16 words of bf16 pairs each; (lo, hi) fp32 to 32 bf16 words.
DOT_LLVM_IR = f"""
define internal <16 x float> @{DOT_FUNCTION}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) #0 {{
  %a16 = bitcast <16 x i32> %a to <32 x bfloat>
  %b16 = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %a16, <32 x bfloat> %b16)
  ret <16 x float> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define internal <32 x i16> @{CVT_FUNCTION}(<16 x float> %hi, <16 x float> %lo) #0 {{
  %r = call <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float> %hi, <16 x float> %lo)
  %w = bitcast <32 x bfloat> %r to <32 x i16>
  ret <32 x i16> %w
}}
declare <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float>, <16 x float>)
attributes #0 = {{ alwaysinline nounwind readnone "target-features"="+avx512bf16,+avx512f" }}
"""


def applies(spec: GemmSpec, cpu: CpuInfo) -> bool:
    """Whether ``spec`` runs here: a bf16 GEMM of the packed variant ("gemm"), on a CPU with
    AVX512-BF16 and no usable AMX tiles (those run ``cpu_amx``). A static K (a Linear's, or
    attention's ``Q @ K^T`` batched) must be even: a weight's rows are read in 32-bit pairs;
    a product of two activations (K symbolic) takes any K (``_matmul_func``)."""
    if spec.dtype != "bfloat16" or spec.device != "cpu" or spec.variant != "gemm":
        return False
    if spec.k is not None and spec.k % 2:
        return False
    return available(cpu)


def available(cpu: CpuInfo) -> bool:
    """Whether bf16 GEMMs and convs run on vdpbf16ps here: AVX512-BF16 and no usable AMX
    tiles (those run ``cpu_amx``)."""
    return "avx512_bf16" in cpu.features and cpu.arch == "x86_64" and not cpu.amx_bf16


def schedule_gemm_dp(spec: GemmSpec):
    """The IRModule ``main(A, B[, bias], out)`` of ``spec`` on ``vdpbf16ps``."""
    import tvm

    if spec.k is None or spec.batched:
        return tvm.IRModule({"main": _matmul_func(spec)})
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    half_k = spec.k // 2
    with IRBuilder() as ib:
        with T.prim_func():
            M, A, B, bias, out = cpu_amx.gemm_buffers(T, spec)
            a_words = T.decl_buffer((M * half_k,), "int32", data=A.data)

            output = Output.of(spec, bias, out)
            taps = linear_taps(half_k)
            panel_gemm(T, tirx, M, spec.n, spec.k, B, spec.b_layout == "nk", a_words,
                       lambda row: row * half_k, taps, output.finish, output)  # fmt: skip
    return tvm.IRModule({"main": ib.get()})


@dataclasses.dataclass(frozen=True)
class Output:
    """Where a GEMM's sums go (inside ``T.prim_func()``): ``value(row, col, sum)`` is the
    output in fp32 (bias, activation; None: the sum itself), stored into ``out`` (at the batch
    entry ``entry``, None: 2-D) one value at a time by ``finish``, or a panel's 32 values of a
    row at a time by ``store_panel`` as the CPU rounds them (CVT_FUNCTION)."""

    value: Callable | None
    out: object
    entry: object = None

    @staticmethod
    def of(spec: GemmSpec, bias, out, entry=None) -> Output:
        def value(row, col, value):
            if spec.bias:
                value = value + bias[row if spec.bias_axis == "m" else col].astype("float32")
            return apply_activation(value, spec.activation, "float32", "cpu")

        plain = not spec.bias and spec.activation == "none"
        return Output(None if plain else value, out, entry)

    def finish(self, row, col, value) -> None:
        from tvm.script.ir_builder import tirx as T

        if self.value is not None:
            value = self.value(row, col, value)
        at = [row, col] if self.entry is None else [self.entry, row, col]
        T.buffer_store(self.out, value.astype("bfloat16"), at)

    def store_panel(self, row, col, lo, hi) -> None:
        """Outputs ``col`` to ``col + 31`` of ``row`` from their fp32 values (two vectors)."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        M, N = self.out.shape[-2], self.out.shape[-1]
        rows = M * (1 if self.entry is None else self.out.shape[0])
        words = T.decl_buffer((rows * N,), "int16", data=self.out.data)
        first = (row if self.entry is None else self.entry * M + row) * N + col
        value = tirx.call_pure_extern("int16x32", CVT_FUNCTION, hi, lo)
        T.buffer_store(words, value, [tirx.Ramp(first, tirx.const(1, "int64"), 32)])


# A Linear's panel whole in a quarter of the L2 (K up to 4096 on a 1 MB L2) is not chunked:
# its pass over A's rows is then one, the sums never leave the registers, and the panel
# streams from the L2. Kernels alone, weights cycled, both builds in one process (AMD EPYC,
# Zen 5, 2 threads), GFLOPS chunks of 256 -> one pass: 768 x 3072 at M = 128 / 512 / 1024
# 827 / 882 / 843-934 -> 860 / 946 / 963-976, 512 x 1376 at M = 128 / 256 / 1024 902 / 924 /
# 865-914 -> 921 / 951 / 952-983, 4096 x 4096 at M = 128 / 256 / 1024 813 / 893 / 960 -> 870
# / 904 / 986 (torch 725-949). A longer K (11008) keeps chunks of 256: of 768 pairs 0.98x.
def whole_k_pairs() -> int:
    """The most pairs of K a Linear's panel holds unchunked on this CPU."""
    return host_cpu().l2_bytes // 4 // (PANEL * 4)


def linear_taps(pairs: int) -> Taps:
    """A matrix row's K/2 pairs as equal runs ("taps") of at most CHUNK_PAIRS, where some
    run of 64 or more divides them (else one run), or one run where the panel is small
    enough (``whole_k_pairs``): the chunks of ``panel_gemm``."""
    runs = [r for r in range(64, CHUNK_PAIRS + 1) if pairs % r == 0]
    run = max(runs) if runs and pairs > max(L1_PAIRS, whole_k_pairs()) else pairs
    return Taps(pairs // run, lambda tap: tap * run, run)


@dataclasses.dataclass(frozen=True)
class Taps:
    """How a row of A lies in memory: ``count`` runs of ``pairs`` 32-bit words (bf16 pairs),
    run ``t`` at word ``offset(t)`` from the row's base; K = 2 x count x pairs. A matrix's
    row is one run; a conv's row (an output pixel's patch) is a run of channels per filter
    tap, read in place from the NHWC input."""

    count: int
    offset: Callable
    pairs: int


def panel_gemm(T, tirx, M, N: int, K: int, B, nk: bool, a_words, row_base, taps: Taps, finish,
               output: Output | None = None):  # fmt: skip
    """Inside ``T.prim_func()``: the GEMM of A (M rows, row ``p`` from word ``row_base(p)``
    of ``a_words`` as ``taps`` says) and B (N, K) if ``nk`` else (K, N), its outputs through
    ``finish(row, col, value)`` (or, given ``output``, whole panels through it); parallel
    over B's panels of 32 columns, each packed once, then used a chunk of its taps at a time
    (``chunk_taps``) by every block of A's rows, the sums kept between chunks in the task's
    buffer; the task's next panel of B is prefetched meanwhile."""
    import tvm

    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    steps = -(-K // cpu_amx.K_STEP)  # the packs pad K to whole steps of 32 values
    panel_words = steps * cpu_amx.TILE_ROWS * PANEL
    per_chunk = chunk_taps(taps)
    chunks = taps.count // per_chunk
    blocks = (M + MR - 1) // MR
    with T.attr(i64(0), "pragma_import_llvm", tvm.ir.StringImm(DOT_LLVM_IR)):
        with T.parallel(i64(0), i64(-(-N // PANEL))) as panel:
            b_pairs = T.alloc_buffer((panel_words,), "float32", align=64)
            b_halves = T.decl_buffer((N * K,), "uint16", data=B.data)  # B's bf16 values
            if nk:
                b_words = T.decl_buffer((N * (K // 2),), "float32", data=B.data)
                cpu_amx.pack_nk(T, tirx, b_words, b_pairs, i64(0), panel, i64(K), N, steps)
            else:
                pairs16 = T.decl_buffer((panel_words * 2,), "uint16", data=b_pairs.data)
                cpu_amx.pack_kn(T, tirx, b_halves, pairs16, panel_words, panel, 1,
                                lambda task, g: task, K, N, steps)  # fmt: skip
            panel_pairs = T.decl_buffer((panel_words,), "int32", data=b_pairs.data)
            # One buffer a vector, in the "global" scope: TVM puts those under 1 KB on the
            # stack, where LLVM keeps them in registers; a "local" or larger one is a heap
            # workspace, and the loop stored every sum at every step.
            acc = [T.alloc_buffer((16,), "float32", align=64) for _ in range(2 * MR)]
            # the sums between chunks (one MR x 32 tile a block), and for the epilogue
            sums = T.alloc_buffer(((blocks if chunks > 1 else 1) * MR * PANEL,), "float32",
                                  align=64)  # fmt: skip
            with T.serial(i64(0), i64(chunks)) as chunk:
                with T.serial(i64(0), blocks) as block:
                    with T.If(panel + 1 < -(-N // PANEL)):
                        with T.Then():
                            step = chunk * blocks + block
                            _prefetch_next_panel(T, tirx, b_halves, nk, N, K, panel, step,
                                                 chunks * blocks)  # fmt: skip
                    tile = (block if chunks > 1 else 0) * (MR * PANEL)
                    # rows past M read row M - 1; their sums are not stored
                    bases = [row_base(tirx.min(block * MR + r, M - 1)) for r in range(MR)]
                    _load_sums(T, tirx, acc, sums, tile, chunk if chunks > 1 else None)
                    product = functools.partial(_block_product, T, tirx, a_words, taps=taps,
                                                first=chunk * per_chunk, count=per_chunk,
                                                panel_pairs=panel_pairs, acc=acc)  # fmt: skip
                    _by_rows_left(T, M - block * MR, bases, product)
                    _store_sums(T, tirx, acc, sums, tile)
                    with T.If(chunk == chunks - 1):
                        with T.Then():
                            _block_epilogue(T, tirx, M, N, sums, tile, block, panel, finish,
                                            output)  # fmt: skip


# The last block of A's rows runs only as many rows as a tail tile needs (TAIL_ROWS): M = 64
# is five blocks of 12 and one of 4, where twelve rows cost a sixth block's whole time. Each
# block runs at the vdpbf16ps rate (~1.1 ms a block for 4096 x 11008 on 2 threads of an AMD
# EPYC, Zen 5, after a ~2.3 ms pass over the weight), so a padded block cost up to 11 rows'
# time. Kernels alone, weights cycled through 192 MB, both kernels in one process called in
# turn, time with the tails / without (LLaMA-7B's 4096 x 11008, 4096 x 4096, 11008 x 4096 and
# BERT's 768 x 3072): M = 8 0.90-0.98, M = 17 0.89-0.96, M = 32 0.92-0.96, M = 40 0.90-0.94,
# M = 64 0.92-0.95, M = 100 0.93-0.97, M = 128 0.95-1.01.
TAIL_ROWS = (4, 8)


def _by_rows_left(T, rows_left, bases, product) -> None:
    """``product(bases=...)`` with the fewest of the block's rows that cover ``rows_left``
    (the last block: a tail tile of TAIL_ROWS rows where they are enough)."""
    tails = [rows for rows in TAIL_ROWS if rows < len(bases)]
    if not tails:
        product(bases=bases)
        return
    with T.If(rows_left > tails[-1]):
        with T.Then():
            product(bases=bases)
        with T.Else():
            _by_rows_left(T, rows_left, bases[: tails[-1]], product)


def _prefetch_next_panel(T, tirx, b_halves, nk: bool, N: int, K: int, panel, step, steps):
    """Asks for the task's next panel of B (the parallel loop gives each thread a run of
    consecutive panels) to be fetched into the L2 while this one is in use, its K lines (32
    rows x K bf16 of a (N, K) weight, or 64 bytes of each of K rows of a (K, N) B) spread
    over the ``steps`` (chunk, block of A) of the panel. A model's weights come from memory,
    where the pack of each panel waited for them: 768 x 3072 at M = 128 ran at 0.73x
    F.linear with 64 weights cycled through 96 MB, 0.98x on one weight in cache. (Over the
    first chunk's blocks only, the prefetches queued up behind each other: 768 x 3072 at
    M = 24 / 64 / 128 1.08 / 0.98 / 1.02x F.linear, against 1.17 / 1.04 / 1.04x spread.)"""
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    per_step = (K + steps - 1) // steps
    read, into_l2, data = (tirx.const(v, "int32") for v in (0, 2, 1))
    with T.serial(i64(0), per_step) as i:
        line = step * per_step + i
        with T.If(line < K):
            with T.Then():
                if nk:  # the next 32 rows are one run of 32 x K values: 32 values a line
                    at = tirx.min((panel + 1) * (PANEL * K) + line * 32, i64(N * K - 1))
                else:
                    at = line * N + tirx.min((panel + 1) * PANEL, i64(N - 1))
                address = tirx.address_of(b_halves[at])
                T.evaluate(
                    tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, read, into_l2, data)
                )


def chunk_taps(taps: Taps) -> int:
    """The taps of a chunk: all where the panel fits the L1, else the most that divide
    ``taps.count`` and fit CHUNK_PAIRS pairs (at least one)."""
    if taps.count * taps.pairs <= L1_PAIRS:
        return taps.count
    fits = [d for d in range(1, taps.count + 1) if taps.count % d == 0]
    return max((d for d in fits if d * taps.pairs <= CHUNK_PAIRS), default=1)


def _load_sums(T, tirx, acc, sums, tile, chunk) -> None:
    """The accumulators at a chunk's start: zero, or (``chunk`` past the first) the tile's
    sums so far."""
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    lanes = [tirx.Ramp(i64(0), i64(1), 16)]

    def zero():
        for buffer in acc:
            T.buffer_store(buffer, tirx.Broadcast(tirx.const(0, "float32"), 16), lanes)

    if chunk is None:
        zero()
        return
    with T.If(chunk == 0):
        with T.Then():
            zero()
        with T.Else():
            for i, buffer in enumerate(acc):
                T.buffer_store(buffer, sums.vload([tile + i * 16], "float32x16"), lanes)


def _store_sums(T, tirx, acc, sums, tile) -> None:
    for i, buffer in enumerate(acc):
        T.buffer_store(sums, buffer.vload([tirx.const(0, "int64")], "float32x16"),
                       [tirx.Ramp(tile + i * 16, tirx.const(1, "int64"), 16)])  # fmt: skip


def _block_product(T, tirx, a_words, taps: Taps, first, count: int, panel_pairs, acc, bases):
    """``acc`` (row r's columns in ``acc[2 r]`` and ``acc[2 r + 1]``) += the len(bases) x 32
    product of the rows of A at ``bases`` and the packed panel over ``count`` taps from
    ``first``: the real pairs of K only (past them a row's words are the next row's: the
    panel's zero padding would not cancel a NaN). The accumulators of rows past ``bases``
    keep what they held; the epilogue never reads rows past M."""
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    with T.serial(first, first + count) as tap:
        with T.serial(i64(0), i64(taps.pairs)) as c2:
            words = [a_words[base + taps.offset(tap) + c2] for base in bases]
            _dot_step(T, tirx, panel_pairs, acc, tap * taps.pairs + c2, words)


def _dot_step(T, tirx, panel_pairs, acc, k2, words) -> None:
    """One pair of K: ``acc[2 r]``, ``acc[2 r + 1]`` += row r's pair (``words[r]``, a 32-bit
    word of two bf16) times the panel's pair ``k2`` (32 columns, two vectors)."""
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    vec = 16
    lanes = [tirx.Ramp(i64(0), i64(1), vec)]
    halves = [panel_pairs.vload([k2 * PANEL + h * vec], f"int32x{vec}") for h in range(2)]
    for r, word in enumerate(words):
        a = tirx.Broadcast(word, vec)
        for h, b in enumerate(halves):
            buffer = acc[2 * r + h]
            value = tirx.call_pure_extern(
                f"float32x{vec}", DOT_FUNCTION, buffer.vload([i64(0)], f"float32x{vec}"), a, b
            )
            T.buffer_store(buffer, value, lanes)


def _block_epilogue(T, tirx, M, N: int, sums, tile, block, panel, finish, output=None) -> None:
    """The block's real outputs through ``finish``, a row at a time from its tile of ``sums``
    (the epilogue in a loop, not unrolled MR times, which made a GELU kernel's build 10x
    slower); whole panels as vectors of 32 (the plain sums of an ``Output``: rounded and
    stored by ``output.store_panel``), a partial last panel (N % 32 != 0) element by element.

    With a bias or an activation the values are rounded in code, in the same pass: computed
    into the tile and then stored by the CPU's rounding, a Linear with a bias ran 3-5% slower
    (768 x 768 at M = 1024, 3072 x 768 at M = 128; AMD EPYC, Zen 5); plain sums gain 2-4%."""
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    with T.serial(i64(0), i64(MR)) as r:
        row = block * MR + r
        with T.If(row < M):
            with T.Then():
                at = tile + r * PANEL
                if N % PANEL == 0 and output is not None and output.value is None:
                    lo, hi = (sums.vload([at + h * 16], "float32x16") for h in range(2))
                    output.store_panel(row, panel * PANEL, lo, hi)
                elif N % PANEL == 0:
                    with T.vectorized(i64(0), i64(PANEL)) as j:
                        finish(row, panel * PANEL + j, sums[tile + r * PANEL + j])
                else:
                    with T.serial(i64(0), tirx.min(i64(PANEL), N - panel * PANEL)) as j:
                        finish(row, panel * PANEL + j, sums[tile + r * PANEL + j])


def _matmul_func(spec: GemmSpec):
    """``main(A, B[, bias], out)`` of a product of two activations: K symbolic (any K) and/or
    a batch of matrices (A (batch, M, K), B (batch, K, N), or (batch, N, K) with a static
    even K, out (batch, M, N)). The loop of ``panel_gemm`` without what a static K
    lets it fix in advance: parallel over (batch entry, panel of 32 columns), each task packs
    its panel once, then runs every block of A's rows over it a chunk of CHUNK_PAIRS pairs at
    a time, the sums of every block kept between chunks. Where K is odd, A's rows do not start
    on 32-bit words: its pairs are put together from two 16-bit loads (the last value with a
    zero), in a second copy of the product loop, and a B (N, K) is packed a value at a time."""
    import tvm
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    nk, N = spec.b_layout == "nk", spec.n
    with IRBuilder() as ib:
        with T.prim_func():
            handles = cpu_amx.kernel_args(T, ("A", "B"), spec.bias)
            M = tirx.Var("M", "int64")
            K = i64(spec.k) if spec.k is not None else tirx.Var("K", "int64")
            batch = tirx.Var("batch", "int64") if spec.batched else i64(1)
            lead = (batch,) if spec.batched else ()
            A = T.match_buffer(handles[0], (*lead, M, K), "bfloat16")
            B = T.match_buffer(handles[1], (*lead, *((N, K) if nk else (K, N))), "bfloat16")
            bias_len = M if spec.bias_axis == "m" else N
            bias = T.match_buffer(handles[2], (bias_len,), "bfloat16") if spec.bias else None
            out = T.match_buffer(handles[-1], (*lead, M, N), "bfloat16")
            a_halves = T.decl_buffer((batch * M * K,), "uint16", data=A.data)
            a_words = T.decl_buffer((batch * M * K // 2,), "int32", data=A.data)
            panels = -(-N // PANEL)
            steps = (K + cpu_amx.K_STEP - 1) // cpu_amx.K_STEP  # the packs pad K to whole steps
            panel_words = steps * cpu_amx.TILE_ROWS * PANEL
            half_k = K // 2
            chunks = (half_k + K % 2 + CHUNK_PAIRS - 1) // CHUNK_PAIRS  # an odd K's last value too
            # sums kept between chunks, a tile a block; one tile reused where K is one chunk
            one_chunk = spec.k is not None and spec.k // 2 <= CHUNK_PAIRS
            blocks = (M + MR - 1) // MR
            tiles = i64(1) if one_chunk else tirx.Select(chunks > 1, blocks, i64(1))
            with T.attr(i64(0), "pragma_import_llvm", tvm.ir.StringImm(DOT_LLVM_IR)):
                with T.parallel(i64(0), batch * panels) as task:
                    entry, panel = task // panels, task % panels
                    b_pairs = T.alloc_buffer((panel_words,), "float32", align=64)
                    b_halves = T.decl_buffer((K * N,), "uint16", data=B.data,
                                             elem_offset=entry * (K * N))  # fmt: skip
                    pairs16 = T.decl_buffer((panel_words * 2,), "uint16", data=b_pairs.data)
                    if nk:
                        pairs = N * half_k
                        b_words = T.decl_buffer((pairs,), "float32", data=B.data,
                                                elem_offset=entry * pairs)  # fmt: skip
                        pack = functools.partial(cpu_amx.pack_nk, T, tirx, b_words, b_pairs,
                                                 i64(0), panel, K, N, steps)  # fmt: skip
                        if spec.k is not None:  # (applies: a static K is even)
                            pack()
                        else:
                            with T.If(K % 2 == 0):
                                with T.Then():
                                    pack()
                                with T.Else():
                                    _pack_nk_odd(T, tirx, b_halves, pairs16, panel, K, N, steps)
                    else:
                        cpu_amx.pack_kn(T, tirx, b_halves, pairs16, panel_words, panel, 1,
                                        lambda task, g: task, K, N, steps)  # fmt: skip
                    panel_pairs = T.decl_buffer((panel_words,), "int32", data=b_pairs.data)
                    acc = [T.alloc_buffer((16,), "float32", align=64) for _ in range(2 * MR)]
                    sums = T.alloc_buffer((tiles * MR * PANEL,), "float32", align=64)

                    output = Output.of(spec, bias, out, entry if spec.batched else None)

                    with T.serial(i64(0), i64(1) if one_chunk else chunks) as chunk:
                        with T.serial(i64(0), blocks) as block:
                            tile = tirx.Select(tiles > 1, block * (MR * PANEL), i64(0))
                            # rows past M read row M - 1; their sums are not stored
                            rows = [entry * M + tirx.min(block * MR + r, M - 1) for r in range(MR)]
                            _load_sums(T, tirx, acc, sums, tile, None if one_chunk else chunk)
                            first = chunk * CHUNK_PAIRS
                            last = tirx.min(first + CHUNK_PAIRS, half_k)
                            product = functools.partial(_pairs_product, T, tirx, first=first,
                                                        last=last, panel_pairs=panel_pairs,
                                                        acc=acc)  # fmt: skip
                            last_chunk = chunk == chunks - 1
                            _rows_product(T, K, spec.k is not None, a_words, a_halves, rows,
                                          M - block * MR, product, last_chunk)  # fmt: skip
                            _store_sums(T, tirx, acc, sums, tile)
                            with T.If(last_chunk):
                                with T.Then():
                                    _block_epilogue(T, tirx, M, N, sums, tile, block, panel,
                                                    output.finish, output)  # fmt: skip
    return ib.get()


def _pack_nk_odd(T, tirx, b_halves, pairs16, panel, K, N: int, steps) -> None:
    """``cpu_amx.pack_nk`` for a B (N, K) of an odd K, whose rows do not start on 32-bit
    words: the panel's pairs a 16-bit value at a time (an odd K's last value with zero, then
    the zero padding; a partial last panel reads column N - 1)."""
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    with T.serial(i64(0), steps * cpu_amx.TILE_ROWS) as k2:
        with T.serial(i64(0), i64(2 * PANEL)) as e:
            k, n = 2 * k2 + e % 2, tirx.min(panel * PANEL + e // 2, N - 1)
            value = tirx.if_then_else(
                k < K, b_halves[n * K + tirx.min(k, K - 1)], tirx.const(0, "uint16")
            )
            T.buffer_store(pairs16, value, [k2 * (2 * PANEL) + e])


def _rows_product(T, K, even, a_words, a_halves, rows, left, product, last_chunk) -> None:
    """A block's ``product`` over the rows of A at ``rows`` (``left`` of them real): its
    pairs read as 32-bit words where K is even (``even``: known to be), put together from
    16-bit halves where it is odd (a branch at run time for a symbolic K)."""

    def even_k():
        words = lambda base, k2: a_words[base + k2]  # noqa: E731
        bases = [r * K // 2 for r in rows]
        _by_rows_left(T, left, bases, functools.partial(product, word=words))

    def odd_k():
        word, last_word = _odd_pairs(a_halves)
        odd = functools.partial(product, word=word, tail_word=last_word, tail=last_chunk)
        _by_rows_left(T, left, [r * K for r in rows], odd)

    if even:
        even_k()
        return
    with T.If(K % 2 == 0):
        with T.Then():
            even_k()
        with T.Else():
            odd_k()


def _odd_pairs(a_halves):
    """(``word(base, k2)``, ``last_word(base, k2)``) for a row of A at 16-bit word ``base``
    of an odd K (rows start anywhere): pair ``k2`` from two 16-bit loads; the row's last
    value with zero (the pack's pair for it is (B[K - 1], 0): a value of the next row would
    not cancel a NaN)."""

    def word(base, k2):
        return a_halves[base + 2 * k2].astype("int32") | (
            a_halves[base + 2 * k2 + 1].astype("int32") << 16
        )

    def last_word(base, k2):
        return a_halves[base + 2 * k2].astype("int32")

    return word, last_word


def _pairs_product(T, tirx, bases, word, first, last, panel_pairs, acc, tail=None,
                   tail_word=None):  # fmt: skip
    """``acc`` += the len(bases) x 32 product of A's rows (``word(base, k2)``: the rows'
    pair ``k2``) and the packed panel over pairs ``first`` to ``last``, and where ``tail``
    holds, pair ``last`` too, read by ``tail_word`` (an odd K's last value)."""
    with T.serial(first, last) as k2:
        _dot_step(T, tirx, panel_pairs, acc, k2, [word(base, k2) for base in bases])
    if tail is not None:
        with T.If(tail):
            with T.Then():
                words = [tail_word(base, last) for base in bases]
                _dot_step(T, tirx, panel_pairs, acc, last, words)
