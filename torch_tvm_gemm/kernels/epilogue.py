"""The element-wise epilogues of the kernels (relu, gelu, gelu_tanh, silu), with torch's NaN and inf semantics.

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


def gelu(x, dtype: str):
    """The exact (erf) GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))``, as ``F.gelu``."""
    from tvm import tirx

    half = tirx.const(0.5, dtype)
    return half * x * (tirx.const(1, dtype) + tirx.erf(x * tirx.const(0.7071067811865476, dtype)))


def gelu_tanh(x, dtype: str):
    """The tanh GELU, ``F.gelu(x, approximate="tanh")`` (GPT-2's "gelu_new")."""
    from tvm import tirx

    inner = tirx.const(0.7978845608028654, dtype) * (x + tirx.const(0.044715, dtype) * x * x * x)
    return tirx.const(0.5, dtype) * x * (tirx.const(1, dtype) + tirx.tanh(inner))


def silu(x, dtype: str):
    """``F.silu``: x * sigmoid(x) (LLaMA's MLP)."""
    from tvm import tirx

    return x * tirx.sigmoid(x)
