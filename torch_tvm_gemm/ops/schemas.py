"""Every schema of the ``tvm_gemm`` namespace, in one place."""

from __future__ import annotations

import torch

LIB = torch.library.Library("tvm_gemm", "DEF")  # noqa: TOR901 (ops defined here, once)
# The GEMM ops take inputs of any strides (they copy what a kernel cannot read in place).
# Without this tag Inductor fixes each input's stride order, and an input computed in the
# graph was written into a buffer of its own for every op that reads it: in a compiled LLaMA
# layer the RMSNorm's output three times, once each for q, k and v (aten.mm's callers share
# one). The conv op keeps the fixed order: its kernel follows its input's memory format
# (NCHW or channels_last), which a free layout would let Inductor change.
GEMM_TAGS = (torch.Tag.flexible_layout,)
LIB.define("matmul(Tensor a, Tensor b) -> Tensor", tags=GEMM_TAGS)
LIB.define(
    "linear(Tensor x, Tensor weight, Tensor? bias=None, str activation='none') -> Tensor",
    tags=GEMM_TAGS,
)
LIB.define(
    "conv2d_bias_relu(Tensor x, Tensor weight, Tensor? bias, int[2] stride=1, "
    "int[2] padding=0, int[2] dilation=1, int groups=1, bool relu=True, "
    "str? activation=None) -> Tensor"
)
