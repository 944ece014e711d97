"""Every schema of the ``tvm_gemm`` namespace, in one place."""

from __future__ import annotations

import torch

LIB = torch.library.Library("tvm_gemm", "DEF")  # noqa: TOR901 (ops defined here, once)
LIB.define("matmul(Tensor a, Tensor b) -> Tensor")
LIB.define("linear(Tensor x, Tensor weight, Tensor? bias=None, str activation='none') -> Tensor")
LIB.define(
    "conv2d_bias_relu(Tensor x, Tensor weight, Tensor? bias, int[2] stride=1, "
    "int[2] padding=0, int[2] dilation=1, int groups=1, bool relu=True, "
    "str? activation=None) -> Tensor"
)
