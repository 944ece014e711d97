"""Kernels for small M written as TIR: the "gemv" of a Linear weight (layout "nk") with short
rows (float32 and bfloat16), and the float32 "ksplit" variant of a weight stored (K, N) (end
of this file).

At M = 1 (a decoding step at batch 1) the product is a read of the weight: a few outputs at
a time, each a dot product along K in one vector of partial sums, the weight's rows read in
place. The scheduled version of the same loops (``cpu.py``) streamed a weight from memory at
80-93% of MKL's rate; what it lacked is a software prefetch, which a TE compute cannot carry
(no side effects), hence this hand-written loop nest: per VEC values of K, one
``prefetcht0`` PREFETCH_BYTES ahead of each of the rows in flight. Measured through the op
(2 threads, Intel Xeon, against F.linear), scheduled -> this kernel: weights cycling through
256 MB (as in a model, where each weight comes from memory once per token): 512 x 512
0.81x -> 0.95x, 1376 x 512 0.84x -> 0.97x, 3072 x 768 0.83x -> 0.89x, 50257 x 768 (GPT-2's
lm_head) 0.75x -> 0.97x; one weight called again and again (kept in cache): 768 x 768
1.37x -> 1.07x, 3072 x 768 1.16x -> 1.04x, and with rows of 4096 values or more it lost
both ways (4096 x 4096 1.00x -> 0.90x in cache, 0.89x -> 0.87x from memory). So it takes
rows of at most PREFETCH_MAX_K values, with a static K; the rest keep the scheduled kernel.
Rows of 2048 values (8 KB; TinyLlama's and LLaMA-3.2-1B's hidden size), measured later on
an Intel Xeon (Emerald Rapids, 2 threads), weights cycled through 1.5 GB (from DRAM, as a
real model's) and 48 MB (the L3), against F.linear, this kernel -> the scheduled one: 2048 x
2048 0.93-0.94x -> 0.96-0.98x, 5632 x 2048 0.92-0.95x -> 0.95-1.00x, 256 x 2048 0.92-0.93x
-> 0.94-0.97x in alternating processes, while rows of 1536 values kept this kernel ahead
(0.97-1.00x against 0.92-0.95x): float32 rows up to 1536 values here. A prefetch 16 or 32 KB
ahead instead of 8 gained 1-3% at K >= 2048 from DRAM, still behind the scheduled kernel
there; the scheduled kernel's groups of 8 rows ran at 0.46x (2 rows: as 4; 6 rows: within
3%). End to end the change was within the noise: a TinyLlama-shaped stack (4 layers)
decoded at 0.95-0.97x eager either way.

bfloat16 runs the same loops on its fp32 widening (the sums in fp32, the output rounded
once, as the scheduled kernel did). Kernels alone, M = 1, 2 threads, Intel Xeon (Emerald
Rapids), against F.linear bf16, scheduled -> this kernel: weights cycling through 300 MB,
50257 x 768 0.70x -> 1.27x, 32000 x 512 0.85x -> 1.53x, 1376 x 512 1.01x -> 1.60x, 3072 x
768 0.90x -> 1.35x, 512 x 512 1.47x -> 2.22x; through 24 MB (the L3) +3-6%; one weight kept
in cache 4.09x -> 3.03x (512 x 512), 1.96x -> 1.83x (3072 x 768); rows of 3072 or 4096
values from memory within 3% either way, so the same PREFETCH_MAX_K.
"""

from __future__ import annotations

from ..kernels.gemm import GemmSpec, apply_activation
from .cpu_amx import gemm_buffers

SCHEDULE_VERSION = 6  # bump when the kernel changes: it is part of the CPU GEMM cache key
PREFETCH_BYTES = 8192  # how far ahead of each row the prefetch reads
# The longest rows it takes, per dtype (float32: 6 KB rows; measured in the docstring).
PREFETCH_MAX_K = {"float32": 1536, "bfloat16": 2048}
GEMV_DTYPES = ("float32", "bfloat16")  # (bf16: summed in fp32, the result rounded once)


def applies(spec: GemmSpec) -> bool:
    """Whether ``spec`` runs this kernel: the CPU gemv of a (N, K) weight, K static and at
    most its dtype's PREFETCH_MAX_K."""
    return (
        spec.variant == "gemv"
        and spec.b_layout == "nk"
        and spec.dtype in GEMV_DTYPES
        and spec.device == "cpu"
        and spec.bias_axis == "n"
        and not spec.batched
        and spec.k is not None
        and spec.k <= PREFETCH_MAX_K[spec.dtype]
    )


def gemv_nk_module(spec: GemmSpec, vec: int, rows: int, parallel: bool):
    """The IRModule ``main(A, B[, bias], out)`` of ``spec`` (``applies``): ``rows`` outputs at
    a time, VEC lanes a vector, the groups of rows a parallel loop when ``parallel``."""
    import tvm
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    def i64(v):
        return tirx.const(v, "int64")

    N = spec.n
    ahead = PREFETCH_BYTES // (4 if spec.dtype == "float32" else 2)

    def f32(value):  # (a bf16 value: its fp32 widening, exact)
        return value if spec.dtype == "float32" else value.astype("float32")

    with IRBuilder() as ib:
        with T.prim_func():
            M, A, B, bias, out = gemm_buffers(T, spec)
            K = i64(spec.k)
            # The weight as one flat array: the prefetch address runs past a row's end into
            # the next rows (the ones read next), and past the last row (a prefetch never
            # faults).
            flat = T.decl_buffer((N * K,), spec.dtype, data=B.data)
            groups = T.parallel if parallel else T.serial
            with groups(i64(0), i64(-(-N // rows))) as g:
                acc = T.alloc_buffer((rows * vec,), "float32", scope="local")
                total = T.alloc_buffer((1,), "float32", scope="local")
                # Rows past N (the last group) read the last row; their sums are not stored.
                row = [tirx.min(g * rows + r, i64(N - 1)) for r in range(rows)]
                with T.serial(i64(0), M) as i:
                    with T.vectorized(i64(0), i64(rows * vec)) as lane:
                        T.buffer_store(acc, tirx.const(0, "float32"), [lane])
                    with T.serial(i64(0), K // vec) as kv:
                        k0 = kv * vec
                        for r in range(rows):
                            at = tirx.address_of(flat[row[r] * K + k0 + ahead])
                            read, keep_in_l1, data = (tirx.const(v, "int32") for v in (0, 3, 1))
                            prefetch = "llvm.prefetch.p0"
                            T.evaluate(
                                tirx.call_llvm_intrin("void", prefetch, at, read, keep_in_l1, data)
                            )
                        for r in range(rows):
                            with T.vectorized(i64(0), i64(vec)) as lane:
                                at = r * vec + lane
                                value = acc[at] + f32(A[i, k0 + lane]) * f32(B[row[r], k0 + lane])
                                T.buffer_store(acc, value, [at])
                    with T.serial(i64(0), K % vec) as t:  # the last K % VEC values, in lane 0
                        k = K // vec * vec + t
                        for r in range(rows):
                            value = acc[r * vec] + f32(A[i, k]) * f32(B[row[r], k])
                            T.buffer_store(acc, value, [r * vec])
                    for r in range(rows):
                        T.buffer_store(total, tirx.const(0, "float32"), [0])
                        with T.serial(i64(0), i64(vec)) as lane:
                            T.buffer_store(total, total[0] + acc[r * vec + lane], [0])
                        col = g * rows + r
                        with T.If(col < N):
                            with T.Then():
                                value = total[0]
                                if spec.bias:
                                    value = value + f32(bias[col])
                                value = apply_activation(value, spec.activation, "float32", "cpu")
                                T.buffer_store(out, value.astype(spec.dtype), [i, col])
    return tvm.IRModule({"main": ib.get()})


# The "ksplit" variant (schedules/cpu.py gemm_variant): a float32 weight stored (K, N) (GPT-2's
# Conv1D; a 1x1 conv's pixels) at M <= KSPLIT_MAX_M, N >= KSPLIT_MIN_N. The "kn" gemv splits
# N into column spans, each task reading a piece of every row of B; here each task reads whole
# rows of B (contiguous memory, which the prefetchers stream best) for a range of K, into
# partial sums of all N outputs, and a second parallel loop adds the partial sums up.
# Measured, kernels alone, 2 threads, Intel Xeon, weights from memory, GFLOPS (column spans /
# this kernel / MKL): M = 1, 768 x 3072 14.3 / 15.7 / 16.8, 1024 x 4096 13.6 / 16.0 / 16.6;
# M = 2, 768 x 3072 21.8 / 25.5 / 15.6; M = 4, 768 x 2304 47.2 / 54.4 / 30.0, 1024 x 4096
# 36.5 / 49.8 / 32.7. It loses at N = 768 (M = 4: 42.6 / 30.5 / 39.9, 768 x 768; the column
# spans are half rows there, and the second pass is extra) and at M = 8, 16 (0.6-0.9x the
# column spans). The 16 rows of B a step unrolled: 4 rows 41.0-44.8 at M = 4, 2 rows 36-38.
KSPLIT_MAX_M = 4
KSPLIT_MIN_N = 1024
KSPLIT_N_MULTIPLE = 16  # N in whole vectors (of 16 or 8 lanes)
KSPLIT_TASKS = 16  # ranges of K: partial sums of N outputs each (enough for 16 threads)
KSPLIT_K_UNROLL = 16  # rows of B per load and store of a vector of partial sums


def ksplit_rows(k: int) -> int:
    """Rows of B per task of the "ksplit" kernel: whole unrolls, KSPLIT_TASKS tasks or fewer."""
    unroll = KSPLIT_K_UNROLL
    return -(-k // (KSPLIT_TASKS * unroll)) * unroll


def gemv_kn_ksplit_module(spec: GemmSpec, vec: int, parallel: bool):
    """The IRModule ``main(A, B[, bias], out)`` of a float32 "ksplit" ``spec`` (N a multiple
    of ``vec``, K static): partial sums over ranges of K, then their sum, bias, activation."""
    import tvm
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    if spec.b_layout != "kn" or spec.dtype != "float32" or spec.k is None or spec.n % vec:
        raise ValueError(f"bad GemmSpec {spec}: ksplit is float32, (K, N), N whole vectors")
    row_bias = spec.bias_axis == "m"  # one bias per row of A (a 1x1 conv's output channel)

    def i64(v):
        return tirx.const(v, "int64")

    N, K, unroll = spec.n, spec.k, KSPLIT_K_UNROLL
    rows = ksplit_rows(K)
    tasks = -(-K // rows)
    vectors = N // vec
    loop = T.parallel if parallel else T.serial
    with IRBuilder() as ib:
        with T.prim_func():
            M, A, B, bias, out = gemm_buffers(T, spec)
            # (the workspace holds KSPLIT_MAX_M rows: a larger M is refused, never overrun)
            too_many = f"ksplit kernel called with M > {KSPLIT_MAX_M}"
            with T.Assert(M <= KSPLIT_MAX_M, too_many):
                # part[t, i, :]: task t's sums for row i of A (rows of A past M never touched)
                part = T.alloc_buffer((i64(tasks * KSPLIT_MAX_M * N),), "float32")
                with loop(i64(0), i64(tasks)) as t:
                    first = t * rows
                    count = tirx.min(i64(K) - first, i64(rows))
                    with T.serial(i64(0), M) as i:
                        with T.serial(i64(0), i64(vectors)) as v:
                            with T.vectorized(i64(0), i64(vec)) as lane:
                                at = (t * KSPLIT_MAX_M + i) * N + v * vec + lane
                                T.buffer_store(part, tirx.const(0, "float32"), [at])

                    def accumulate(k0, ks: int) -> None:
                        # part[t, i, v] += the sum over ks rows from k0 of A[i, k] * B[k, v], for
                        # all i, v: one expression, each vector of sums loaded and stored once
                        with T.serial(i64(0), i64(vectors)) as v:
                            with T.serial(i64(0), M) as i:
                                with T.vectorized(i64(0), i64(vec)) as lane:
                                    at = (t * KSPLIT_MAX_M + i) * N + v * vec + lane
                                    value = part[at]
                                    for u in range(ks):
                                        value = value + A[i, k0 + u] * B[k0 + u, v * vec + lane]
                                    T.buffer_store(part, value, [at])

                    with T.serial(i64(0), count // unroll) as ko:
                        accumulate(first + ko * unroll, unroll)
                    with T.serial(i64(0), count % unroll) as kr:  # the last task's remainder
                        accumulate(first + count // unroll * unroll + kr, 1)
                with loop(i64(0), i64(vectors)) as v:
                    with T.serial(i64(0), M) as i:
                        with T.vectorized(i64(0), i64(vec)) as lane:
                            col = v * vec + lane
                            value = part[i * N + col]
                            for t in range(1, tasks):
                                value = value + part[(t * KSPLIT_MAX_M + i) * N + col]
                            T.buffer_store(out, value, [i, col])
                        if spec.bias or spec.activation != "none":
                            # (read back: an activation of the long sum expression itself keeps
                            # TVM's simplifier busy for minutes)
                            with T.vectorized(i64(0), i64(vec)) as lane:
                                col = v * vec + lane
                                value = out[i, col]
                                if spec.bias:
                                    value = value + bias[i if row_bias else col]
                                value = apply_activation(value, spec.activation, "float32", "cpu")
                                T.buffer_store(out, value, [i, col])
    return tvm.IRModule({"main": ib.get()})
