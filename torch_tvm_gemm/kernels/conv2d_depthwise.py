"""The math of the depthwise conv2d kernels (``groups == C``, ``K = m * C``), in TE.

The same function as ``kernels/conv2d.py`` (``out = act(conv2d(x, weight) + bias)``, torch's
NCHW layouts, plain ``(K, 1, R, S)`` weight, symbolic batch), written so that a vector along
the output width reads contiguous input even at stride > 1: the zero-padded input copy
"x_pad" is split by column phase, ``x_pad[b, c, i, p, q] = x[b, c, i - ph, q * sw + p - pw]``,
so output columns ``j .. j+v`` of tap ``rs`` read ``x_pad[.., (rs*dw) % sw, j + (rs*dw) // sw]``,
one contiguous run (each phase is a stage of its own: ``x_phase{p}``). The schedule (``schedules/cpu_depthwise.py``) makes that copy per
parallel task, a few rows at a time, in a local buffer.
"""

from __future__ import annotations

from .conv2d import Conv2dSpec, activate


def tap_phases(spec: Conv2dSpec) -> list[int]:
    """The column phases the taps read (at stride 2 and dilation 2, only phase 0)."""
    sw, dw = spec.stride[1], spec.dilation[1]
    return sorted({rs * dw % sw for rs in range(spec.s)})


def row_width(spec: Conv2dSpec) -> int:
    """The columns an output row is computed over. A row of 3, 5-7 or 9-15 columns as a
    vector of its own width is loaded in two or three pieces at every tap (seen: 7 columns,
    a 4 + 2 + 1 load and two inserts per tap); it is computed 8 or 16 wide instead, one
    whole-register load a tap, and the extra columns (zero padding read) not stored. Not
    without padding: the taps then read x itself, and past its columns each load would
    keep its bounds check (scalar code)."""
    ow = spec.out_w
    if ow > 16 or ow & (ow - 1) == 0 or spec.padding == (0, 0):
        return ow
    return 8 if ow < 8 else 16


def depthwise_compute(spec: Conv2dSpec, split_after_pad: bool = False):
    """The unscheduled PrimFunc ``main(x, weight, [bias,] out)`` of a depthwise ``spec``.

    Stages: "x_pad", the zero-padded input in the accumulation dtype; at stride ``sw`` > 1,
    "x_phase0" .. "x_phase{sw-1}", its column phases (``x_phase{p}[b, c, i, q]`` is padded
    column ``q * sw + p``), read from "x_pad" (``split_after_pad``) or padded themselves
    from ``x`` (then there is no "x_pad"); "out", the
    R x S taps summed in order, the bias, the activation and the cast, for each output. The
    taps are written out (not a reduction axis) so that each reads its phase's stage. Where
    ``row_width`` widens the rows, "out_row" computes them that wide and "out" copies the
    output's columns.
    """
    from tvm import te, tirx

    acc = spec.acc_dtype
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    mult = spec.k // spec.c
    phases = tap_phases(spec)
    oh, ow = spec.out_h, spec.out_w
    hp = (oh - 1) * sh + (spec.r - 1) * dh + 1
    wide = row_width(spec)
    wq = wide + ((spec.s - 1) * dw) // sw  # columns of each phase that the taps read

    n = tirx.Var("N", "int64")
    x = te.placeholder((n, spec.c, spec.h, spec.w), spec.dtype, name="x")
    weight = te.placeholder((spec.k, 1, spec.r, spec.s), spec.dtype, name="weight")
    bias = te.placeholder((spec.k,), spec.dtype, name="bias")

    def padded(i, j):
        """Padded input row ``i``, column ``j``, as the plain pad pattern (unclamped indices)
        that the schedule splits into a fill and an in-bound copy (``decompose_padding``)."""
        inside = tirx.all(i >= ph, i < spec.h + ph, j >= pw, j < spec.w + pw)

        def at(b, c):
            return tirx.if_then_else(
                inside, x[b, c, i - ph, j - pw].astype(acc), tirx.const(0, acc)
            )

        return at

    def phase_of(source, p):
        return te.compute(
            (n, spec.c, hp, wq), lambda b, c, i, q: source(b, c, i, q * sw + p), name=f"x_phase{p}"
        )

    if sw == 1 or split_after_pad:
        x_pad = te.compute(
            (n, spec.c, hp, wq * sw), lambda b, c, i, j: padded(i, j)(b, c), name="x_pad"
        )
        if sw == 1:
            x_pads = {0: x_pad}
        else:
            x_pads = {p: phase_of(lambda b, c, i, j: x_pad[b, c, i, j], p) for p in phases}
    else:
        x_pads = {p: phase_of(lambda b, c, i, j: padded(i, j)(b, c), p) for p in phases}

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
        return activate(spec.activation, v, acc, spec.device).astype(spec.dtype)

    if wide == ow:
        out = te.compute((n, spec.k, oh, ow), final, name="out")
    else:
        rows = te.compute((n, spec.k, oh, wide), final, name="out_row")

        def column(b, k, i, j):
            # (The never-taken read of the last wide column makes the copy's reads span the
            # whole wide row, so that a row computed where the copy needs it stays wide.)
            return tirx.if_then_else(j < ow, rows[b, k, i, j], rows[b, k, i, wide - 1])

        out = te.compute((n, spec.k, oh, ow), column, name="out")
    args = [x, weight] + ([bias] if spec.bias else []) + [out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")
