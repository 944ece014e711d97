"""The math of every GEMM kernel: ``out = act(A @ B + bias)``, written in TensorIR (TE).

No schedule here: the same PrimFunc is scheduled for LLVM CPUs in ``schedules/cpu.py`` and for
CUDA in ``schedules/cuda.py``.

Shapes: ``A (M, K)``; ``B (K, N)`` (layout "kn", torch.matmul's right operand) or ``(N, K)``
(layout "nk", an ``nn.Linear`` weight); ``bias (N,)``, or ``(M,)`` with ``bias_axis="m"``
(a 1x1 convolution as W @ X: one bias per output channel, i.e. per row); ``out (M, N)``. ``M`` is always
symbolic, so one kernel serves every batch size; ``N`` is static; ``K`` is static or symbolic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# gelu: exact erf form (F.gelu); gelu_tanh: F.gelu(approximate="tanh"); silu: x * sigmoid(x).
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class GemmSpec:
    """Everything that changes a compiled GEMM binary (the target aside)."""

    dtype: str
    n: int
    k: int | None  # None: symbolic K
    b_layout: str  # "kn" or "nk"
    bias: bool = False
    activation: str = "none"
    variant: str = "gemm"  # schedule family: "gemm" (packed B, any M) or "gemv" (small M)
    device: str = "cpu"
    bias_axis: str = "n"  # "n": one bias per column (Linear), "m": per row (1x1 conv)
    # CUDA fp32 only: multiply on tensor cores with TF32 inputs (10-bit mantissa, fp32 sums),
    # chosen per call by torch.backends.cuda.matmul.allow_tf32 (see ops.py).
    tf32: bool = False

    family = "gemm"

    def __post_init__(self) -> None:
        # Internal invariants: user input is validated in ops.py before a spec is made.
        if self.dtype not in DTYPES or self.activation not in ACTIVATIONS:
            raise ValueError(f"bad GemmSpec {self}")
        if self.b_layout not in ("kn", "nk") or self.bias_axis not in ("n", "m"):
            raise ValueError(f"bad GemmSpec {self}")
        if self.tf32 and (self.dtype != "float32" or self.device != "cuda"):
            raise ValueError(f"bad GemmSpec {self}: TF32 is for float32 CUDA kernels")

    @property
    def acc_dtype(self) -> str:
        return "float64" if self.dtype == "float64" else "float32"

    def key(self) -> dict:
        key = {"family": self.family, **asdict(self)}
        # Fields added later are absent at their defaults: existing cached kernels stay valid.
        if not self.tf32:
            del key["tf32"]
        if self.bias_axis == "n":
            del key["bias_axis"]
        return key

    def name(self) -> str:
        k = "K" if self.k is None else self.k
        epi = ("_bias" if self.bias else "") + (
            "" if self.activation == "none" else "_" + self.activation
        )
        if self.bias and self.bias_axis == "m":
            epi = epi.replace("_bias", "_rowbias")
        tf32 = "_tf32" if self.tf32 else ""
        return f"gemm_{self.variant}_{self.dtype}{tf32}_{self.b_layout}_n{self.n}_k{k}{epi}"


def apply_activation(x, activation: str, dtype: str):
    """The activation on a TE/TIR expression, applied once to the final sum."""
    from tvm import tirx

    if activation == "none":
        return x
    if activation == "relu":
        return tirx.max(x, tirx.const(0, dtype))
    if activation == "gelu":  # exact erf form, as torch.nn.functional.gelu
        half = tirx.const(0.5, dtype)
        return (
            half * x * (tirx.const(1, dtype) + tirx.erf(x * tirx.const(0.7071067811865476, dtype)))
        )
    if activation == "gelu_tanh":  # F.gelu(x, approximate="tanh"), GPT-2's "gelu_new"
        inner = tirx.const(0.7978845608028654, dtype) * (
            x + tirx.const(0.044715, dtype) * x * x * x
        )
        return tirx.const(0.5, dtype) * x * (tirx.const(1, dtype) + tirx.tanh(inner))
    if activation == "silu":  # F.silu: x * sigmoid(x)
        return x * tirx.sigmoid(x)
    raise ValueError(f"unknown activation {activation!r}")


def gemm_compute(
    spec: GemmSpec,
    m_pad: int = 1,
    n_pad: int = 1,
    k_pad: int = 1,
    operand_dtype: str | None = None,
    granule: int = 1,
):
    """Return the unscheduled PrimFunc ``main(A, B, [bias,] out)`` for ``spec``.

    The reduction runs over a padded domain, M and N rounded up to ``m_pad`` / ``n_pad``
    (the schedule's register tile), so that its inner loops carry no bounds check: padded
    rows and columns read clamped (in-bounds) inputs, and "out" never stores them.
    (``Schedule.pad_einsum`` would do this, but in TVM 0.27 it drops a non-constant
    reduction init, i.e. the bias.)

    ``k_pad`` > 1 rounds K up too, the padded columns of A and rows of B reading as zero
    (tensor-core tiles need whole K steps; a zero adds nothing to the sum).

    ``granule`` (a divisor of K and N) makes the clamps and K tests along a contiguous axis
    act on whole groups of ``granule`` elements, so that a vectorized copy of a group stays
    one contiguous (16-byte, ``cp.async``) load: ``min(j, N - 1)`` would make it a gather.

    Stages: "A_pad" / "B_pad" give the operands in ``operand_dtype`` (default: the
    accumulation dtype) on the padded domain (the schedule inlines them or turns them into
    packed or shared-memory copies; CUDA keeps the input dtype there, the tensor-core operand
    type, and converts in "acc"); "acc" is the reduction, from zero; "out" adds the bias,
    applies the activation once to the final sum and casts back to the input dtype.

    Why the bias is not the reduction's init: TVM 0.27 drops a non-constant init in
    ``compute_inline`` of a producer and ``pad_einsum``, and ``rfactor`` would add it to
    every partial sum (all seen in our tests); one add per output in "out" costs nothing.
    """
    from tvm import te, tirx

    acc = spec.acc_dtype
    # All dims int64: a symbolic K is int64, and TVM refuses index maps mixing widths.
    M = tirx.Var("M", "int64")
    K = tirx.const(spec.k, "int64") if spec.k is not None else tirx.Var("K", "int64")
    N = tirx.const(spec.n, "int64")
    Mp = (M + m_pad - 1) // m_pad * m_pad
    Np = tirx.const((spec.n + n_pad - 1) // n_pad * n_pad, "int64")
    Kp = (K + k_pad - 1) // k_pad * k_pad
    opd = operand_dtype or acc
    A = te.placeholder((M, K), spec.dtype, name="A")
    B = te.placeholder((K, N) if spec.b_layout == "kn" else (N, K), spec.dtype, name="B")
    bias = te.placeholder((M,) if spec.bias_axis == "m" else (N,), spec.dtype, name="bias")

    g = granule

    def row(i):  # padded row -> a real one (its result is discarded)
        return te.min(i, M - 1) if m_pad > 1 else i

    def col(j):  # padded column -> a real one; per group of g (N % g == 0)
        if Np.value == N.value:
            return j
        return te.min(j // g, (N - 1) // g) * g + j % g if g > 1 else te.min(j, N - 1)

    k_padded = k_pad > 1 and not (spec.k is not None and spec.k % k_pad == 0)

    def load(value, k):  # zero beyond K (only when K is padded: no select otherwise)
        value = value.astype(opd)
        inside = k // g < K // g if g > 1 else k < K  # (K % g == 0: the same test)
        return te.if_then_else(inside, value, tirx.const(0, opd)) if k_padded else value

    a_op = te.compute((Mp, Kp), lambda i, k: load(A[row(i), k], k), name="A_pad")
    if spec.b_layout == "kn":
        b_op = te.compute((Kp, Np), lambda k, j: load(B[k, col(j)], k), name="B_pad")
    else:
        b_op = te.compute((Np, Kp), lambda j, k: load(B[col(j), k], k), name="B_pad")

    def b_at(k, j):
        return b_op[k, j] if spec.b_layout == "kn" else b_op[j, k]

    r = te.reduce_axis((0, Kp), name="k")
    acc_t = te.compute(
        (Mp, Np),
        lambda i, j: te.sum(a_op[i, r].astype(acc) * b_at(r, j).astype(acc), axis=r),
        name="acc",
    )

    def final(i, j):
        if spec.bias:
            return acc_t[i, j] + bias[i if spec.bias_axis == "m" else j].astype(acc)
        return acc_t[i, j]

    out = te.compute(
        (M, N),
        lambda i, j: apply_activation(final(i, j), spec.activation, acc).astype(spec.dtype),
        name="out",
    )
    args = [A, B] + ([bias] if spec.bias else []) + [out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")
