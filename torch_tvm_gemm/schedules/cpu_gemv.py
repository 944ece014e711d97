"""The float32 "gemv" kernel for a Linear weight (layout "nk") with short rows, as TIR.

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
"""

from __future__ import annotations

from ..kernels.gemm import GemmSpec, apply_activation
from .cpu_amx import kernel_args

SCHEDULE_VERSION = 2  # bump when the kernel changes: it is part of the CPU GEMM cache key
PREFETCH_BYTES = 8192  # how far ahead of each row the prefetch reads
PREFETCH_MAX_K = 2048  # the longest rows (8 KB of float32) it takes


def applies(spec: GemmSpec) -> bool:
    """Whether ``spec`` runs this kernel: the float32 CPU gemv of a (N, K) weight, K static
    and at most PREFETCH_MAX_K."""
    return (
        spec.variant == "gemv"
        and spec.b_layout == "nk"
        and spec.dtype == "float32"
        and spec.device == "cpu"
        and spec.bias_axis == "n"
        and not spec.batched
        and spec.k is not None
        and spec.k <= PREFETCH_MAX_K
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
    ahead = PREFETCH_BYTES // 4
    with IRBuilder() as ib:
        with T.prim_func():
            handles = kernel_args(T, ("A", "B"), spec.bias)
            M = tirx.Var("M", "int64")
            K = i64(spec.k)
            A = T.match_buffer(handles[0], (M, K), "float32")
            B = T.match_buffer(handles[1], (i64(N), K), "float32")
            bias = T.match_buffer(handles[2], (i64(N),), "float32") if spec.bias else None
            out = T.match_buffer(handles[-1], (M, i64(N)), "float32")
            # The weight as one flat array: the prefetch address runs past a row's end into
            # the next rows (the ones read next), and past the last row (a prefetch never
            # faults).
            flat = T.decl_buffer((N * K,), "float32", data=B.data)
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
                                value = acc[at] + A[i, k0 + lane] * B[row[r], k0 + lane]
                                T.buffer_store(acc, value, [at])
                    with T.serial(i64(0), K % vec) as t:  # the last K % VEC values, in lane 0
                        k = K // vec * vec + t
                        for r in range(rows):
                            value = acc[r * vec] + A[i, k] * B[row[r], k]
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
                                    value = value + bias[col]
                                value = apply_activation(value, spec.activation, "float32", "cpu")
                                T.buffer_store(out, value, [i, col])
    return tvm.IRModule({"main": ib.get()})
