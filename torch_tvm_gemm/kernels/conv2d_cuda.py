"""The conv2d math of the CUDA kernels: an implicit GEMM, in TensorIR (TE).

``conv2d(x, w)`` is the GEMM ``out[m, k] = sum_q A[m, q] * B[k, q]`` with

* ``m = (n, oh, ow)``: one row per output pixel, ``M = N * OH * OW`` (batch ``N`` symbolic,
  as on the CPU: one kernel per layer shape, any batch size);
* ``k``: the output channel, ``N_gemm = K`` (the schedules call it ``n``, as GemmSpec does);
* ``q = (r, s, c)``: the reduction, ``K_gemm = R * S * C``, ``c`` fastest.

The input is NHWC and the weight ``(K, R*S*C)`` (``w.permute(0, 2, 3, 1)``), so that a run of
consecutive ``q`` is a run of consecutive channels in memory for both operands: the row of A
for pixel ``m`` is the im2col row, gathered straight from ``x`` by the "A_pad" stage
(``x[n, oh*sh - ph + r*dh, ow*sw - pw + s*dw, c]``, zero outside the image). No im2col
buffer exists in global memory: the schedule makes "A_pad" the global -> shared copy.

The stages are named and shaped as ``kernels/gemm.gemm_compute``'s for a GEMM with an
"nk" B ("A_pad", "B_pad", "acc", "out"), so the GEMM schedules of ``schedules/cuda.py``
apply unchanged (``schedules/cuda_conv2d.py``). The output is the ``(M, K)`` matrix, i.e.
NHWC; ``ops/conv_ops.py`` gives it back as an NCHW tensor.
"""

from __future__ import annotations

import math

from .conv2d import Conv2dSpec, activate


def load_granule(spec: Conv2dSpec, widest: int) -> int:
    """Elements per vector load (at most ``widest``): a divisor of C, so that a vector of A
    never crosses from one (r, s) tap to the next (different pixels, different bounds
    test), and of K, for the vector loads of B rows and the stores of out."""
    return math.gcd(widest, spec.c, spec.k)


def conv2d_gemm_compute(
    spec: Conv2dSpec,
    m_pad: int = 1,
    n_pad: int = 1,
    k_pad: int = 1,
    operand_dtype: str | None = None,
    granule: int = 1,
):
    """The unscheduled PrimFunc ``main(x, weight, [bias,] out)`` of ``spec`` (groups == 1).

    Arguments: ``x (N, H, W, C)``, ``weight (K, R*S*C)``, ``bias (K,)``, ``out (N*OH*OW, K)``.
    Padding arguments as in ``gemm_compute``: M, N (= K channels) and K (= R*S*C) rounded up
    to ``m_pad`` / ``n_pad`` / ``k_pad``; padded rows / channels read clamped in-bounds
    inputs and are never stored, padded reduction steps read zero. ``granule`` (a divisor of
    C and K, see ``load_granule``) makes every index clamp and bounds test act on whole
    groups of ``granule`` consecutive elements, so that a vector copy stays one contiguous
    (16-byte, ``cp.async``) load with a single predicate.
    """
    from tvm import te, tirx

    if spec.groups != 1:
        raise ValueError(f"the implicit-GEMM conv needs groups == 1: {spec}")
    acc = spec.acc_dtype
    opd = operand_dtype or acc
    g = granule
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    oh, ow = spec.out_h, spec.out_w
    kq = spec.r * spec.s * spec.c  # the GEMM's reduction length
    cg = spec.c // g  # channel groups per (r, s) tap

    def i64(v):
        return tirx.const(v, "int64")

    # M is a variable of its own (the rows of "out"), not N * OH * OW: TVM 0.27's analyzer
    # cannot prove N * OH * OW <= ceil(N * OH * OW / m_pad) * m_pad, and the schedule then
    # refuses to compute_at (region cover). ops/conv_ops.py passes M = N * OH * OW; the image index
    # is clamped to N - 1 all the same, so that no other M reads outside ``x``.
    n = tirx.Var("N", "int64")
    M = tirx.Var("M", "int64")
    Mp = (M + m_pad - 1) // m_pad * m_pad
    Np = _ceil_to(spec.k, n_pad)
    Kp = _ceil_to(kq, k_pad)
    x = te.placeholder((n, i64(spec.h), i64(spec.w), i64(spec.c)), spec.dtype, name="x")
    weight = te.placeholder((i64(spec.k), i64(kq)), spec.dtype, name="weight")
    bias = te.placeholder((i64(spec.k),), spec.dtype, name="bias")

    def row(i):  # a padded row -> a real one (its result is discarded)
        return te.min(i, M - 1) if m_pad > 1 else i

    def a_at(i, q):
        # Written on the group index qg = q // g and the lane q % g: everything but the
        # channel is a function of qg alone, so a vector of g lanes is one contiguous load.
        m, qg, lane = row(i), q // g, q % g
        b, pix = te.min(m // (oh * ow), n - 1), m % (oh * ow)
        tap, c = qg // cg, qg % cg * g + lane
        ih = pix // ow * sh - ph + tap // spec.s * dh
        iw = pix % ow * sw - pw + tap % spec.s * dw
        conds = []
        if ph or (oh - 1) * sh + (spec.r - 1) * dh >= spec.h:  # rows that can fall outside
            conds += [ih >= 0, ih < spec.h]
        if pw or (ow - 1) * sw + (spec.s - 1) * dw >= spec.w:
            conds += [iw >= 0, iw < spec.w]
        if Kp != kq:  # the reduction padded to the K tile
            conds.append(qg < kq // g)
        value = x[b, _clamp(ih, spec.h), _clamp(iw, spec.w), c].astype(opd)
        if not conds:
            return value
        return tirx.if_then_else(tirx.all(*conds), value, tirx.const(0, opd))

    def b_at(j, q):
        col = j if Np == spec.k else te.min(j // g, (spec.k - 1) // g) * g + j % g
        value = weight[col, q].astype(opd)  # (as in gemm_compute: masked past the end)
        if Kp == kq:
            return value
        return tirx.if_then_else(q // g < kq // g, value, tirx.const(0, opd))

    a_op = te.compute((Mp, i64(Kp)), a_at, name="A_pad")
    b_op = te.compute((i64(Np), i64(Kp)), b_at, name="B_pad")
    r = te.reduce_axis((0, i64(Kp)), name="k")
    acc_t = te.compute(
        (Mp, i64(Np)),
        lambda i, j: te.sum(a_op[i, r].astype(acc) * b_op[j, r].astype(acc), axis=r),
        name="acc",
    )

    def final(i, j):
        v = acc_t[i, j]
        if spec.bias:
            v = v + bias[j].astype(acc)
        v = activate(spec.activation, v, acc, "cuda")  # once, on the final sum
        return v.astype(spec.dtype)

    out = te.compute((M, i64(spec.k)), final, name="out")
    args = [x, weight] + ([bias] if spec.bias else []) + [out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def _clamp(v, size: int):
    """``v`` clamped to ``[0, size)``: the (masked) read of a padding tap stays in bounds."""
    from tvm import te

    return te.max(te.min(v, size - 1), 0)


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m
