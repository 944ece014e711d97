"""The CUDA workloads of the GPU tests and the benchmark, in one table.

A machine without ``tvm`` runs only the kernels of a pack built elsewhere, so the pack must
hold exactly the kernels those workloads call, backward passes included. Rather than
re-deriving them from the ops' logic, ``record_specs`` runs the workloads on CPU tensors in
the ops' planning mode for CUDA (``ops.planning``): the specs it records are the ones a GPU
run asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .workloads import RESNET50_CONVS


@dataclass(frozen=True)
class Case:
    op: str  # "matmul" (B is (K, N)) or "linear" (weight (N, K), optional bias, activation)
    dtype: torch.dtype
    m: int
    n: int
    k: int
    bias: bool = False
    activation: str = "none"

    def inputs(self, device, requires_grad: bool = False, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):
            t = (torch.randn(*shape, generator=g) / self.k**0.25).to(self.dtype).to(device)
            return t.requires_grad_(requires_grad)

        if self.op == "matmul":
            return (rand(self.m, self.k), rand(self.k, self.n))
        bias = rand(self.n) if self.bias else None
        return (rand(self.m, self.k), rand(self.n, self.k), bias, self.activation)

    def run(self, *args):
        if self.op == "matmul":
            return torch.ops.tvm_gemm.matmul(*args)
        return torch.ops.tvm_gemm.linear(*args)

    def reference(self, *args):
        """The same in PyTorch, accumulated in float32 (float64 for float64)."""
        wide = torch.float64 if self.dtype == torch.float64 else torch.float32
        if self.op == "matmul":
            a, b = args
            return (a.to(wide) @ b.to(wide)).to(self.dtype)
        x, w, b, act = args
        y = torch.nn.functional.linear(x.to(wide), w.to(wide), None if b is None else b.to(wide))
        y = {"none": y, "relu": torch.relu(y), "gelu": torch.nn.functional.gelu(y)}[act]
        return y.to(self.dtype)


@dataclass(frozen=True)
class ConvCase:
    """``conv2d_bias_relu`` on an ``(n, c, h, w)`` input and a ``(k, c, r, r)`` weight."""

    dtype: torch.dtype
    n: int
    c: int
    h: int
    w: int
    k: int  # output channels
    r: int  # square kernel
    stride: int | tuple[int, int] = 1
    padding: int | tuple[int, int] = 0
    dilation: int | tuple[int, int] = 1
    bias: bool = True
    relu: bool = True
    channels_last: bool = False

    op = "conv2d"

    @property
    def reduction(self) -> int:  # the GEMM's K: terms in each output's sum
        return self.c * self.r * self.r

    def inputs(self, device, requires_grad: bool = False, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):
            t = (torch.randn(*shape, generator=g) / self.reduction**0.25).to(self.dtype)
            return t.to(device).requires_grad_(requires_grad)

        x = rand(self.n, self.c, self.h, self.w)
        if self.channels_last:
            x = x.detach().to(memory_format=torch.channels_last).requires_grad_(requires_grad)
        bias = rand(self.k) if self.bias else None
        w = rand(self.k, self.c, self.r, self.r)
        return (x, w, bias, self.stride, self.padding, self.dilation, 1, self.relu)

    def run(self, *args):
        return torch.ops.tvm_gemm.conv2d_bias_relu(*args)

    def reference(self, *args):
        """``F.relu(F.conv2d(...))`` accumulated in float32 for fp16 / bf16 (exact even where
        cuDNN rounds fp32 inputs to TF32: their values fit), in float64 for fp32 / fp64."""
        x, w, b, stride, padding, dilation, groups, relu = args
        wide = torch.float32 if self.dtype in NARROW else torch.float64
        y = torch.nn.functional.conv2d(
            x.to(wide), w.to(wide), None if b is None else b.to(wide), stride, padding, dilation
        )
        return (torch.relu(y) if relu else y).to(self.dtype)

    def spec(self):
        """The kernel a CUDA run asks for (the op's own spec function, on meta tensors)."""
        from ..ops import conv2d_spec

        x, w, b, stride, padding, dilation, groups, relu = self.inputs("meta")
        return conv2d_spec(x, w, b, stride, padding, dilation, groups, relu, device="cuda")


NARROW = (torch.float16, torch.bfloat16)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Numerics, odd shapes (M not a tile multiple; N, K odd or not multiples of 8 / 32).
TEST_CASES = [
    Case(op, dt, m, n, k, bias, act)
    for dt in GPU_DTYPES
    for (op, m, n, k, bias, act) in [
        ("matmul", 7, 64, 40, False, "none"),  # small M: the "gemv" variant
        ("matmul", 127, 96, 72, False, "none"),
        ("matmul", 33, 33, 7, False, "none"),  # odd N and K: narrow loads
        ("linear", 129, 200, 136, True, "relu"),
        ("linear", 5, 64, 64, True, "gelu"),
        ("linear", 300, 256, 1000, False, "none"),  # K padded to the K tile
        # N, K multiples of 128, 64: fp16/bf16 take the wgmma kernel on sm_90a (M ragged: the
        # last row block has 1 / 104 rows; 10 k-tiles go round the 4-stage ring)
        ("linear", 129, 256, 192, True, "relu"),
        ("linear", 1000, 384, 640, False, "none"),
    ]
]
# TF32 (fp32 inputs on tensor cores, torch.backends.cuda.matmul.allow_tf32 = True): the fp32
# shapes above.
TF32_CASES = [case for case in TEST_CASES if case.dtype == torch.float32]
# Autograd / opcheck / torch.compile / CUDA graph: a few of the above, with backward.
GRAD_CASES = [
    Case("matmul", torch.bfloat16, 33, 64, 48),
    Case("linear", torch.float16, 40, 72, 56, True, "relu"),
    Case("linear", torch.float32, 24, 40, 32, True, "gelu"),
]
# conv2d: numerics at odd shapes. A 3x3 pad-1 layer (K <= 64: the narrow block), a 1x1, a
# strided one with K > 128 (two column blocks, padded), a 7x7 stem with C = 3 (no vector
# loads, no relu), and stride / padding / dilation differing per axis with C % 8 != 0.
CONV_TEST_CASES = [
    ConvCase(dt, *shape, **opts)
    for dt in GPU_DTYPES
    for shape, opts in [
        ((2, 64, 14, 14, 64, 3), {"padding": 1}),
        ((3, 40, 9, 11, 72, 1), {}),
        ((2, 32, 15, 13, 136, 3), {"stride": 2, "padding": 1}),
        ((1, 3, 23, 21, 24, 7), {"stride": 2, "padding": 3, "relu": False}),
        (
            (2, 12, 10, 9, 20, 3),
            {"stride": (1, 2), "padding": (0, 1), "dilation": 2, "bias": False},
        ),
    ]
] + [
    ConvCase(torch.float16, 2, 64, 14, 14, 64, 3, padding=1, channels_last=True),
    ConvCase(torch.float64, 2, 12, 10, 9, 20, 3, (1, 2), (0, 1), 2, bias=False),
]
CONV_GRAD_CASES = [ConvCase(torch.float16, 2, 16, 9, 10, 24, 3, padding=1)]
# ResNet-50 layers at batch 32, channels_last (the layout tensor-core convs run in).
CONV_BENCH_CASES = [
    ConvCase(dt, 32, c, hw, hw, k, r, padding=r // 2, channels_last=True)
    for dt in NARROW
    # Each 3x3 layer once and two of the 1x1 ones: the pack stays small.
    for (c, k, hw, r) in (RESNET50_CONVS[i] for i in (0, 1, 3, 6, 7, 9))
]
BENCH_CASES = (
    [Case("matmul", dt, s, s, s) for s in (512, 4096, 8192) for dt in NARROW]
    + [Case("linear", dt, 4096, 4096, 4096, True, "relu") for dt in NARROW]
    # (a linear's weight is (N, K): on sm_90a these run the wgmma kernel, matmul mma.sync)
    + [Case("linear", dt, 8192, 8192, 8192) for dt in NARROW]
)


def record_specs(cases, backward: bool = False, tf32: bool = False) -> list:
    """The kernel specs a GPU run of ``cases`` (and their backward) would ask for, with
    ``torch.backends.cuda.matmul.allow_tf32`` = ``tf32`` on an sm_80+ GPU.

    The cases run on CPU tensors under ``ops.planning(device="cuda")``: each op picks its
    kernel as on the GPU and records it, nothing is built or computed. A conv case runs its
    forward only (its backward runs in PyTorch, no kernel of ours).
    """
    from ..ops import planning

    with planning(device="cuda", tf32=tf32, compute=False) as found:
        for case in cases:
            grad = backward and not isinstance(case, ConvCase)
            out = case.run(*case.inputs("cpu", requires_grad=grad))
            if grad:
                out.float().sum().backward()
    return found.specs


def pack_specs(preset: str) -> list:
    """Specs of a named preset: "test" (GPU tests) or "bench" (benchmark), or "all"."""
    if preset == "test":
        specs = record_specs(TEST_CASES + CONV_TEST_CASES) + record_specs(TF32_CASES, tf32=True)
        grads = record_specs(GRAD_CASES + CONV_GRAD_CASES, backward=True)
        return specs + [s for s in grads if s not in specs]
    if preset == "bench":
        return record_specs(BENCH_CASES + CONV_BENCH_CASES)
    if preset == "all":
        specs = pack_specs("test")
        return specs + [s for s in pack_specs("bench") if s not in specs]
    raise ValueError(f"torch_tvm_gemm: unknown preset {preset!r} (test, bench, all)")
