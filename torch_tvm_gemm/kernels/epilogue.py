"""The element-wise epilogues of the kernels (relu, relu6, hardswish, leaky_relu, gelu,
gelu_tanh, silu, sigmoid, hardsigmoid), with torch's NaN and inf semantics.

``max(x, 0)`` is not ``torch.relu``: LLVM's and CUDA's float max return the number when one
operand is NaN, so a NaN sum became 0 (hiding a diverging model). ``x < 0 ? 0 : x`` keeps
NaN (the comparison is false), maps -inf to 0, keeps +inf and keeps -0.0 as torch does.
"""

from __future__ import annotations


def relu(x, dtype: str):
    """``torch.relu`` on a TIR expression: NaN stays NaN."""
    from tvm import tirx

    zero = tirx.const(0, dtype)
    return tirx.Select(x < zero, zero, x)


def relu6(x, dtype: str):
    """``F.relu6`` (``hardtanh(x, 0, 6)``): NaN stays NaN, -0.0 stays -0.0, as in torch.

    Written as relu, then the clip at 6 of relu's result: each select compares the value it
    passes on, which LLVM turns into one vector max / min (x86 ``maxps(0, x)`` returns x for
    a NaN x, and for -0.0). ``x < 0 ? 0 : (x > 6 ? 6 : x)``, the same function, compiled to
    compares and blends that LLVM did not vectorize in the conv's unrolled write-back: a 1x1
    conv 128 -> 512 channels at 28x28 took 1.79 ms against 0.87 ms with relu (now 0.91 ms).
    """
    from tvm import tirx

    zero, six = tirx.const(0, dtype), tirx.const(6, dtype)
    y = tirx.Select(x < zero, zero, x)
    return tirx.Select(y > six, six, y)


def hardsigmoid(x, dtype: str):
    """``F.hardsigmoid``: ``relu6(x + 3) / 6`` (NaN stays NaN, +-inf give 1 and 0)."""
    from tvm import tirx

    return relu6(x + tirx.const(3, dtype), dtype) / tirx.const(6, dtype)


def hardswish(x, dtype: str):
    """``F.hardswish``: ``x * relu6(x + 3) / 6`` (as torch: -inf gives NaN, -3 gives -0.0)."""
    from tvm import tirx

    return x * relu6(x + tirx.const(3, dtype), dtype) / tirx.const(6, dtype)


LEAKY_RELU_SLOPE = 0.01  # F.leaky_relu's and nn.LeakyReLU's default negative_slope


def leaky_relu(x, dtype: str, slope: float = LEAKY_RELU_SLOPE):
    """``F.leaky_relu(x, slope)``: ``x > 0 ? x : slope * x``, NaN and -0.0 kept, as torch."""
    from tvm import tirx

    return tirx.Select(x > tirx.const(0, dtype), x, x * tirx.const(slope, dtype))


# LLVM has no vector erf or exp: TVM's ``erf`` / ``exp`` become one libm call per element, so
# a fused GELU took 2.3x the time of the GEMM itself (linear 128 x 768 -> 3072: 4.0 ms against
# 1.7 ms). On the CPU, float32 epilogues use the polynomial forms below instead: plain
# arithmetic that vectorizes, as accurate as torch's own vectorized CPU kernels (the same
# erf approximation) and with the same NaN and inf results.
_LOG2E, _LN2_HI, _LN2_LO = 1.4426950408889634, 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)  # fmt: skip
_ERF_P = 0.3275911
_ERF_POLY = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)


def _exp(x, dtype: str, fast: bool):
    """exp(x): TVM's own, or (``fast``, float32) Cephes' expf: 2^n * e^r, |r| <= ln2 / 2,
    n put into the exponent bits; inf above 88.3, 0 below -87.3, NaN stays NaN."""
    from tvm import tirx

    if not fast:
        return tirx.exp(x)

    def c(v):
        return tirx.const(v, dtype)

    xc = tirx.min(tirx.max(x, c(-87.3)), c(88.3))
    n = tirx.floor(xc * c(_LOG2E) + c(0.5))
    r = xc - n * c(_LN2_HI) - n * c(_LN2_LO)
    p = c(_EXP_POLY[0])
    for coef in _EXP_POLY[1:]:
        p = p * r + c(coef)
    e = p * r * r + r + c(1.0)
    bits = tirx.shift_left(
        tirx.Cast("int32", n) + tirx.const(127, "int32"), tirx.const(23, "int32")
    )
    y = e * tirx.reinterpret(dtype, bits)
    y = tirx.Select(x > c(88.3), c(float("inf")), tirx.Select(x < c(-87.3), c(0.0), y))
    return tirx.Select(x != x, x, y)  # (NaN compares unequal to itself)


def _erf(x, dtype: str, fast: bool):
    """erf(x): TVM's own, or (``fast``) Abramowitz & Stegun 7.1.26, |error| < 1.5e-7, the
    approximation of torch's vectorized CPU erf. |x| and the sign put back are ``abs`` and
    ``copysign`` (bit operations), not selects on ``x < 0``: with the selects LLVM spent
    18-20 s on a packed kernel with this epilogue (N = 100, K = 77; 10.9 s at N = 3072, K =
    768) where relu took 0.5-0.8 s; 1.6 s and 2.6 s now."""
    from tvm import tirx

    if not fast:
        return tirx.erf(x)

    def c(v):
        return tirx.const(v, dtype)

    a = tirx.abs(x)
    t = c(1.0) / (c(1.0) + c(_ERF_P) * a)
    p = c(_ERF_POLY[0])
    for coef in _ERF_POLY[1:]:
        p = p * t + c(coef)
    return tirx.copysign(c(1.0) - p * t * _exp(-a * a, dtype, fast), x)


def _fast(dtype: str, device: str) -> bool:
    return device == "cpu" and dtype == "float32"


def gelu(x, dtype: str, device: str = "cpu"):
    """The exact (erf) GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))``, as ``F.gelu``."""
    from tvm import tirx

    half = tirx.const(0.5, dtype)
    erf = _erf(x * tirx.const(0.7071067811865476, dtype), dtype, _fast(dtype, device))
    return half * x * (tirx.const(1, dtype) + erf)


def gelu_tanh(x, dtype: str, device: str = "cpu"):
    """The tanh GELU, ``F.gelu(x, approximate="tanh")`` (GPT-2's "gelu_new"):
    ``0.5 * x * (1 + tanh(u))``, tanh(u) = 1 - 2 / (exp(2u) + 1) (NaN and +-inf as torch)."""
    from tvm import tirx

    def c(v):
        return tirx.const(v, dtype)

    u = c(0.7978845608028654) * (x + c(0.044715) * x * x * x)
    if not _fast(dtype, device):
        return c(0.5) * x * (c(1) + tirx.tanh(u))
    tanh = c(1.0) - c(2.0) / (_exp(c(2.0) * u, dtype, True) + c(1.0))
    return c(0.5) * x * (c(1) + tanh)


def silu(x, dtype: str, device: str = "cpu"):
    """``F.silu``: x / (1 + exp(-x)) (LLaMA's MLP): -inf gives NaN, as in torch."""
    from tvm import tirx

    if not _fast(dtype, device):
        return x * tirx.sigmoid(x)
    return x / (tirx.const(1.0, dtype) + _exp(-x, dtype, True))


def sigmoid(x, dtype: str, device: str = "cpu"):
    """``torch.sigmoid``: 1 / (1 + exp(-x)) (a squeeze-and-excitation gate): +-inf give 1 and
    0, NaN stays NaN."""
    from tvm import tirx

    if not _fast(dtype, device):
        return tirx.sigmoid(x)
    one = tirx.const(1.0, dtype)
    # (NaN kept by a test of its own: the exp's clamp maps NaN to a number, and its own
    # ``x != x`` test did not survive compilation, sigmoid(NaN) came out 1; the other
    # epilogues multiply by x, which carries the NaN.)
    return tirx.Select(tirx.isnan(x), x, one / (one + _exp(-x, dtype, True)))
