"""The GEMM math of ``kernels/gemm.py`` with the reduction split into K chunks, for a large K.

``out = act(A @ B + bias)`` as two reductions: "partial" sums each chunk of ``kc`` values of
K (``partial[c, i, j]``, the schedule keeps one register tile of it at a time), "acc" adds
the chunks up (in memory, one panel of it per thread). The bias and the activation are
applied once, in "out", on the final sum: never folded into a partial sum.

K is static. When ``kc`` does not divide it, K is padded to whole chunks, the padded values
reading as zero (A and B both: a zero times an inf would be a NaN).
"""

from __future__ import annotations

from .gemm import GemmSpec, epilogue_func, padded_column


def kblocked_gemm_compute(spec: GemmSpec, m_pad: int, n_pad: int, kc: int, granule: int = 1):
    """The unscheduled PrimFunc ``main(A, B, [bias,] out)`` of ``spec`` in chunks of ``kc``.

    Stages: "A_pad" / "B_pad" (operands in the accumulation dtype, M and N padded to the
    register tile as in ``gemm_compute``, padded columns clamped by ``granule``, K to whole
    chunks), "partial", "acc", "out"."""
    from tvm import te, tirx

    if spec.k is None or spec.batched:
        raise ValueError(f"bad GemmSpec {spec}: K blocking needs a static K, one matrix")
    acc = spec.acc_dtype
    i64 = "int64"  # every dim int64, as in gemm_compute
    chunks = -(-spec.k // kc)
    padded = chunks * kc != spec.k
    M = tirx.Var("M", i64)
    K = tirx.const(spec.k, i64)
    N = tirx.const(spec.n, i64)
    KC = tirx.const(kc, i64)
    Kp = tirx.const(chunks * kc, i64)
    Mp = (M + m_pad - 1) // m_pad * m_pad
    Np = tirx.const((spec.n + n_pad - 1) // n_pad * n_pad, i64)
    A = te.placeholder((M, K), spec.dtype, name="A")
    B = te.placeholder((K, N) if spec.b_layout == "kn" else (N, K), spec.dtype, name="B")
    by_row = spec.bias_axis == "m"
    bias = te.placeholder((M,) if by_row else (N,), spec.dtype, name="bias")

    def col(j):
        return padded_column(j, N, Np, granule)

    def kidx(k):  # padded K -> a real index (its value is replaced by zero)
        return te.min(k, K - 1) if padded else k

    def load(value, k):
        value = value.astype(acc)
        return te.if_then_else(k < K, value, tirx.const(0, acc)) if padded else value

    a_op = te.compute((Mp, Kp), lambda i, k: load(A[te.min(i, M - 1), kidx(k)], k), name="A_pad")
    if spec.b_layout == "kn":
        b_op = te.compute((Kp, Np), lambda k, j: load(B[kidx(k), col(j)], k), name="B_pad")
    else:
        b_op = te.compute((Np, Kp), lambda j, k: load(B[col(j), kidx(k)], k), name="B_pad")

    def b_at(k, j):
        return b_op[k, j] if spec.b_layout == "kn" else b_op[j, k]

    r = te.reduce_axis((tirx.const(0, i64), KC), name="k")
    partial = te.compute(
        (tirx.const(chunks, i64), Mp, Np),
        lambda c, i, j: te.sum(a_op[i, c * KC + r] * b_at(c * KC + r, j), axis=r),
        name="partial",
    )
    rc = te.reduce_axis((tirx.const(0, i64), tirx.const(chunks, i64)), name="c")
    acc_t = te.compute((Mp, Np), lambda i, j: te.sum(partial[rc, i, j], axis=rc), name="acc")
    return epilogue_func(spec, A, B, bias, acc_t, M, N)
