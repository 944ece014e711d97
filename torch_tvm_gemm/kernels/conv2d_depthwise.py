"""The math of the depthwise conv2d kernels (``groups == C``, ``K = m * C``), in TE.

The same function as ``kernels/conv2d.py`` (``out = act(conv2d(x, weight) + bias)``, torch's
NCHW layouts, plain ``(K, 1, R, S)`` weight, symbolic batch), written so that a vector along
the output width reads contiguous input even at stride > 1: the zero-padded input copy
"x_pad" is split by column phase, ``x_pad[b, c, i, p, q] = x[b, c, i - ph, q * sw + p - pw]``,
so output columns ``j .. j+v`` of tap ``rs`` read ``x_pad[.., (rs*dw) % sw, j + (rs*dw) // sw]``,
one contiguous run (each phase is a stage of its own: ``x_pad{p}``). The schedule (``schedules/cpu_depthwise.py``) makes that copy per
parallel task, a few rows at a time, in a local buffer.
"""

from __future__ import annotations

from . import epilogue
from .conv2d import Conv2dSpec


def depthwise_compute(spec: Conv2dSpec):
    """The unscheduled PrimFunc ``main(x, weight, [bias,] out)`` of a depthwise ``spec``.

    Stages: "x_pad0" .. "x_pad{sw-1}", the zero-padded input in the accumulation dtype, one
    per column phase (``x_pad{p}[b, c, i, q]`` is padded column ``q * sw + p``); "out", the
    R x S taps summed in order, the bias, the activation and the cast, for each output. The
    taps are written out (not a reduction axis) so that each reads its phase's stage.
    """
    from tvm import te, tirx

    acc = spec.acc_dtype
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    mult = spec.k // spec.c
    oh, ow = spec.out_h, spec.out_w
    hp = (oh - 1) * sh + (spec.r - 1) * dh + 1
    wq = ow + ((spec.s - 1) * dw) // sw  # columns of each phase that the taps read

    n = tirx.Var("N", "int64")
    x = te.placeholder((n, spec.c, spec.h, spec.w), spec.dtype, name="x")
    weight = te.placeholder((spec.k, 1, spec.r, spec.s), spec.dtype, name="weight")
    bias = te.placeholder((spec.k,), spec.dtype, name="bias")

    def phase(p):
        def x_at(b, c, i, q):
            j = q * sw + p
            inside = tirx.all(i >= ph, i < spec.h + ph, j >= pw, j < spec.w + pw)
            # The plain pad pattern (unclamped indices), which the schedule splits into a
            # fill and an in-bound copy without a condition (``decompose_padding``).
            return tirx.if_then_else(
                inside, x[b, c, i - ph, j - pw].astype(acc), tirx.const(0, acc)
            )

        return te.compute((n, spec.c, hp, wq), x_at, name=f"x_pad{p}")

    x_pads = [phase(p) for p in range(sw)]

    def final(b, k, i, j):
        v = None
        for rr in range(spec.r):
            for rs in range(spec.s):
                col = rs * dw
                tap = x_pads[col % sw][b, k // mult, i * sh + rr * dh, j + col // sw]
                term = tap * weight[k, 0, rr, rs].astype(acc)
                v = term if v is None else v + term
        if spec.bias:
            v = v + bias[k].astype(acc)
        if spec.relu:
            v = epilogue.relu(v, acc)
        return v.astype(spec.dtype)

    out = te.compute((n, spec.k, oh, ow), final, name="out")
    args = [x, weight] + ([bias] if spec.bias else []) + [out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")
