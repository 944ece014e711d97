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

from . import conv2d

# The linear op's activations. gelu: exact erf form (F.gelu); gelu_tanh: F.gelu(approximate=
# "tanh"); silu: x * sigmoid(x).
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")


def is_epilogue(name: str) -> bool:
    """Whether a GEMM kernel can end in ``name``: the linear op's ACTIVATIONS, and the conv
    op's epilogues (relu6, hardswish, leaky_relu...) for the convs it runs as GEMMs (a 1x1
    conv over its pixels). Only the conv op asks for the latter."""
    return name in ACTIVATIONS or conv2d.is_activation(name)


def torch_activation(name: str):
    """What an epilogue computes, in torch: the reference the kernels are checked against,
    and the ops' result for an empty reduction (K = 0). (torch is imported here, not at the
    top: the compile worker imports this module without torch.)"""
    import torch.nn.functional as F

    if name not in ACTIVATIONS:
        return conv2d.torch_activation(name)
    return {
        "none": lambda t: t,
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu,
    }[name]


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
    # schedule family: "gemm" (packed B, any M), "gemv" (small M), "ksplit" (CPU, layout "kn",
    # float32, M up to 4: K split among the tasks), "dot" / "dot2" (CPU, layout "nk", M from 2
    # to a few dozen / M = 2), "swap" (CPU, "nk", float32, M near 64: x packed, the weight read
    # in place), "swap32" / "swap48" (the same, M near 32 / 48), "rows" (CPU, float32, M
    # from 512: the packed kernel's tasks split by rows); see schedules/cpu.py
    variant: str = "gemm"
    device: str = "cpu"
    bias_axis: str = "n"  # "n": one bias per column (Linear), "m": per row (1x1 conv)
    # CUDA fp32 only: multiply on tensor cores with TF32 inputs (10-bit mantissa, fp32 sums),
    # chosen per call by torch.backends.cuda.matmul.allow_tf32 (see ops/gemm_ops.py).
    tf32: bool = False
    # CPU matmul of 3-D @ 3-D: A (batch, M, K), B (batch, K, N) or (batch, N, K), out (batch,
    # M, N), the batch symbolic and a parallel axis (no bias, no activation).
    batched: bool = False

    family = "gemm"

    def __post_init__(self) -> None:
        # Internal invariants: user input is validated in ops/checks.py before a spec is made.
        if self.dtype not in DTYPES or not is_epilogue(self.activation):
            raise ValueError(f"bad GemmSpec {self}")
        if self.b_layout not in ("kn", "nk") or self.bias_axis not in ("n", "m"):
            raise ValueError(f"bad GemmSpec {self}")
        if self.tf32 and (self.dtype != "float32" or self.device != "cuda"):
            raise ValueError(f"bad GemmSpec {self}: TF32 is for float32 CUDA kernels")
        if self.batched and (
            self.device != "cpu" or self.bias or self.activation != "none" or self.variant != "gemm"
        ):
            raise ValueError(f"bad GemmSpec {self}: batched kernels are plain CPU matmuls")

    @property
    def acc_dtype(self) -> str:
        return "float64" if self.dtype == "float64" else "float32"

    def problem_k(self, k: int | None = None) -> int:
        """The K of a problem: the kernel's own, or ``k`` for a symbolic-K kernel."""
        if self.k is not None:
            return self.k
        if k is None:
            raise ValueError(f"kernel {self.name()} has a symbolic K: give the K to run at")
        return k

    def key(self) -> dict:
        key = {"family": self.family, **asdict(self)}
        # Fields added later are absent at their defaults: existing cached kernels stay valid.
        if not self.tf32:
            del key["tf32"]
        if self.bias_axis == "n":
            del key["bias_axis"]
        if not self.batched:
            del key["batched"]
        return key

    def name(self) -> str:
        k = "K" if self.k is None else self.k
        epi = ("_bias" if self.bias else "") + (
            "" if self.activation == "none" else "_" + self.activation
        )
        if self.bias and self.bias_axis == "m":
            epi = epi.replace("_bias", "_rowbias")
        tf32 = "_tf32" if self.tf32 else ""
        if self.batched:
            return f"bgemm_{self.variant}_{self.dtype}_{self.b_layout}_n{self.n}_k{k}"
        return f"gemm_{self.variant}_{self.dtype}{tf32}_{self.b_layout}_n{self.n}_k{k}{epi}"


def apply_activation(x, activation: str, dtype: str, device: str = "cpu"):
    """The activation on a TE/TIR expression, applied once to the final sum (NaN and inf
    as in torch; vectorizable polynomial forms on the CPU: ``kernels/epilogue.py``)."""
    from . import epilogue

    if activation == "none":
        return x
    if activation == "relu":
        return epilogue.relu(x, dtype)
    if activation == "gelu":  # exact erf form, as torch.nn.functional.gelu
        return epilogue.gelu(x, dtype, device)
    if activation == "gelu_tanh":  # F.gelu(x, approximate="tanh"), GPT-2's "gelu_new"
        return epilogue.gelu_tanh(x, dtype, device)
    if activation == "silu":  # F.silu: x * sigmoid(x)
        return epilogue.silu(x, dtype, device)
    if conv2d.is_activation(activation):  # the conv op's others (a conv run as a GEMM)
        return conv2d.activate(activation, x, dtype, device)
    raise ValueError(f"unknown activation {activation!r}")


def gemm_compute(
    spec: GemmSpec,
    m_pad: int = 1,
    n_pad: int = 1,
    k_pad: int = 1,
    operand_dtype: str | None = None,
    granule: int = 1,
    padded_epilogue: bool = False,
):
    """Return the unscheduled PrimFunc ``main(A, B, [bias,] out)`` for ``spec``.

    The reduction runs over a padded domain, M and N rounded up to ``m_pad`` / ``n_pad``
    (the schedule's register tile), so that its inner loops carry no bounds check: padded
    rows and columns read clamped (in-bounds) inputs, and "out" never stores them.
    (``Schedule.pad_einsum`` would do this, but in TVM 0.27 it drops a non-constant
    reduction init, i.e. the bias.)

    ``k_pad`` > 1 rounds K up too, the padded columns of A and rows of B reading as zero
    (tensor-core tiles need whole K steps; a zero adds nothing to the sum).

    ``granule`` (a divisor of N, and of K where K is padded) makes the clamps and K tests
    along a contiguous axis act on whole groups of ``granule`` elements, so that a vectorized
    copy of a group stays one contiguous load (a 16-byte ``cp.async``, a CPU vector):
    ``min(j, N - 1)`` would make it a gather (``padded_column``).

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

    def col(j):
        return padded_column(j, N, Np, g)

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

    return epilogue_func(spec, A, B, bias, acc_t, M, N, padded_epilogue)


def padded_column(j, n, n_padded, granule: int = 1):
    """Column ``j`` of the padded domain -> a real column of B (a padded column's result is
    discarded): ``min(j, N - 1)``, or with ``granule`` (a divisor of N) by whole groups of
    that many columns. Clamped value by value, the column of a copy vectorized along N
    depends on the lane, and LLVM copies such a vector one value at a time: the CPU packed
    kernel's copy of every panel of a "kn" B, where N is whole vectors but not whole panels
    (N = 1376 in panels of 64, M = 128, 2 threads, Intel Xeon: 0.75x torch.mm; by vectors
    0.93x; ``schedules/cpu.py`` ``column_granule``)."""
    from tvm import te

    if getattr(n_padded, "value", n_padded) == getattr(n, "value", n):
        return j
    if granule > 1:
        return te.min(j // granule, (n - 1) // granule) * granule + j % granule
    return te.min(j, n - 1)


def epilogue_func(spec: GemmSpec, A, B, bias, acc_t, M, N, padded: bool = False):
    """The PrimFunc ``main(A, B[, bias], out)`` whose "out" stage takes the sum ``acc_t``
    over the real (M, N) outputs: the bias added and the activation applied once each, then
    the cast to the output dtype (shared by every 2-D GEMM compute). ``padded``: bias and
    activation in an "epi" stage over all of ``acc_t`` (the padded rows and columns too, with
    a clamped bias), so that a schedule can run it on whole tiles, vectorized, without the
    bounds test that "out", then a plain copy, keeps."""
    from tvm import te

    acc = spec.acc_dtype

    def activated(i, j, clamp: bool):
        value = acc_t[i, j]
        if spec.bias:  # (clamp: the padded outputs take the last row's or column's bias)
            at = i if spec.bias_axis == "m" else j
            if clamp:
                at = te.min(at, (M if spec.bias_axis == "m" else N) - 1)
            value = value + bias[at].astype(acc)
        return apply_activation(value, spec.activation, acc, spec.device)

    if padded:
        epi = te.compute(acc_t.shape, lambda i, j: activated(i, j, True), name="epi")
        out = te.compute((M, N), lambda i, j: epi[i, j].astype(spec.dtype), name="out")
    else:
        out = te.compute((M, N), lambda i, j: activated(i, j, False).astype(spec.dtype), name="out")
    args = [A, B] + ([bias] if spec.bias else []) + [out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def batched_gemm_compute(spec: GemmSpec, m_pad: int, n_pad: int, granule: int = 1):
    """The unscheduled PrimFunc ``main(A, B, out)`` of a batched ``spec``: per batch entry the
    stages of ``gemm_compute`` ("A_pad", "B_pad", "acc", "out"), M and N padded the same way
    (``granule``: as there)."""
    from tvm import te, tirx

    acc = spec.acc_dtype
    batch = tirx.Var("batch", "int64")
    M = tirx.Var("M", "int64")
    K = tirx.const(spec.k, "int64") if spec.k is not None else tirx.Var("K", "int64")
    N = tirx.const(spec.n, "int64")
    Mp = (M + m_pad - 1) // m_pad * m_pad
    Np = tirx.const((spec.n + n_pad - 1) // n_pad * n_pad, "int64")
    A = te.placeholder((batch, M, K), spec.dtype, name="A")
    nk = spec.b_layout == "nk"
    B = te.placeholder((batch, N, K) if nk else (batch, K, N), spec.dtype, name="B")

    def col(j):
        return padded_column(j, N, Np, granule)

    a_op = te.compute(
        (batch, Mp, K), lambda b, i, k: A[b, te.min(i, M - 1), k].astype(acc), name="A_pad"
    )
    if nk:
        b_op = te.compute((batch, Np, K), lambda b, j, k: B[b, col(j), k].astype(acc), name="B_pad")
    else:
        b_op = te.compute((batch, K, Np), lambda b, k, j: B[b, k, col(j)].astype(acc), name="B_pad")
    r = te.reduce_axis((0, K), name="k")
    acc_t = te.compute(
        (batch, Mp, Np),
        lambda b, i, j: te.sum(a_op[b, i, r] * (b_op[b, j, r] if nk else b_op[b, r, j]), axis=r),
        name="acc",
    )
    out = te.compute((batch, M, N), lambda b, i, j: acc_t[b, i, j].astype(spec.dtype), name="out")
    return te.create_prim_func([A, B, out]).with_attr("global_symbol", "main")
