"""The math of the depthwise conv2d kernel over channels-last pixels (``Conv2dSpec.layout``
"nhwc"), in TE.

The function of ``kernels/conv2d.py`` for ``groups == C == K``, in the layouts a
channels_last model hands over as they lie: ``x (N, H, W, C)`` (a channels_last tensor's
memory), ``weight (R, S, C)`` (the ``(C, 1, R, S)`` weight with its channels last: a small
copy per call), ``bias (C,)``, ``out (N, OH, OW, C)``. A vector runs along the channels,
which every tap of a pixel reads contiguously whatever the stride. The batch is symbolic.
"""

from __future__ import annotations

from .conv2d import Conv2dSpec, activate


def depthwise_nhwc_compute(spec: Conv2dSpec, pad_stage: bool = False):
    """The unscheduled PrimFunc ``main(x, weight, [bias,] out)`` of a depthwise ``spec``.

    Stages: with ``pad_stage``, "x_pad", the input with its zero border in the accumulation
    dtype; "acc", the R x S taps written out (without "x_pad", each is zero by a condition
    where it falls in the padding); "out", the bias, the activation and the cast (the
    activation reads the sum several times: in one expression with the taps, they were
    computed again for each read)."""
    from tvm import te, tirx

    acc = spec.acc_dtype
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    c, r_taps, s_taps, h, w = spec.c, spec.r, spec.s, spec.h, spec.w
    n = tirx.Var("N", "int64")
    x = te.placeholder((n, h, w, c), spec.dtype, name="x")
    weight = te.placeholder((r_taps, s_taps, c), spec.dtype, name="weight")
    bias = te.placeholder((c,), spec.dtype, name="bias")

    def bordered(b, row, col, ch):  # x at a padded position
        value = x[b, row - ph, col - pw, ch].astype(acc)
        if spec.padding == (0, 0):
            return value
        inside = tirx.all(row >= ph, row < h + ph, col >= pw, col < w + pw)
        return tirx.if_then_else(inside, value, tirx.const(0, acc))

    if pad_stage:
        x_pad = te.compute((n, h + 2 * ph, w + 2 * pw, c), bordered, name="x_pad")

    def tap(b, i, j, ch, r, s):
        row, col = i * sh + r * dh, j * sw + s * dw
        value = x_pad[b, row, col, ch] if pad_stage else bordered(b, row, col, ch)
        return value * weight[r, s, ch].astype(acc)

    def taps(b, i, j, ch):
        total = tap(b, i, j, ch, 0, 0)
        for rs in range(1, r_taps * s_taps):
            total = total + tap(b, i, j, ch, rs // s_taps, rs % s_taps)
        return total

    shape = (n, spec.out_h, spec.out_w, c)
    summed = te.compute(shape, taps, name="acc")

    def epilogue(b, i, j, ch):
        total = summed[b, i, j, ch] + bias[ch].astype(acc) if spec.bias else summed[b, i, j, ch]
        return activate(spec.activation, total, acc, spec.device).astype(spec.dtype)

    out = te.compute(shape, epilogue, name="out")
    return te.create_prim_func([x, weight] + ([bias] if spec.bias else []) + [out])
