"""torch_tvm_gemm: PyTorch ops whose kernels are compiled by Apache TVM.

    import torch, torch_tvm_gemm
    y = torch.ops.tvm_gemm.matmul(a, b)              # or torch_tvm_gemm.matmul(a, b)
    y = torch_tvm_gemm.linear(x, w, b, "relu")       # relu(x @ w.T + b), one fused kernel
    model = torch_tvm_gemm.swap_linear(model)        # nn.Linear -> TVMLinear, in place
    y = torch_tvm_gemm.conv2d_bias_relu(x, w, b, stride=1, padding=1)  # relu(conv2d + b)
    model = torch_tvm_gemm.convert(model)            # any model, in place: fusions + linears
    torch_tvm_gemm.precompile(model, x)              # build all its kernels now, in parallel

Kernels are compiled on first use for this machine and cached on disk
(``TVM_GEMM_CACHE_DIR``, default ``~/.cache/torch_tvm_gemm``); a warm cache needs only the
TVM runtime, never the compiler.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import autocast as _autocast  # noqa: F401 (their torch.autocast behaviour)
from . import ops as _ops  # noqa: F401 (registers torch.ops.tvm_gemm.*)
from . import vmap_rules as _vmap_rules  # noqa: F401 (torch.vmap over the ops)
from .fold import TVMConv2dBN
from .fusion import FusionSummary, TVMConv2dBiasReLU, fuse_conv_bias_relu
from .kept_weights import kept_bytes
from .model_convert import ConversionSummary, convert
from .model_precompile import PrecompileSummary, precompile
from .nn import TVMConv1D, TVMLinear, swap_linear, unswap_linear
from .ops.entry import linear, matmul
from .runtime.build_worker import KernelBuildError
from .runtime.output_pool import release as release_output_pool
from .runtime.output_pool import stats as output_pool_stats
from .runtime.precompile import precompile_specs

__all__ = ["matmul", "linear", "TVMLinear", "TVMConv1D", "swap_linear", "unswap_linear"]
__all__ += [
    "conv2d_bias_relu",
    "TVMConv2dBiasReLU",
    "fuse_conv_bias_relu",
    "TVMConv2dBN",
    "convert",
    "ConversionSummary",
    "FusionSummary",
    "KernelBuildError",
    "precompile",
    "PrecompileSummary",
    "precompile_specs",
    "output_pool_stats",
    "release_output_pool",
    "kept_bytes",
]
__version__ = "0.1.0"


def conv2d_bias_relu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
    relu: bool = True,
    activation: str | None = None,
) -> Tensor:
    """``F.relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups))`` in one kernel.

    ``x`` is ``(N, C, H, W)``, ``weight`` ``(K, C/groups, R, S)``, ``bias`` ``(K,)`` or None;
    ``relu=False`` gives the plain conv. ``activation``, when given, replaces ``relu``: one of
    ``"none"``, ``"relu"``, ``"relu6"`` (MobileNetV2), ``"hardswish"`` (MobileNetV3),
    ``"silu"`` (EfficientNet), ``"leaky_relu"`` (slope 0.01, CSPNet), ``"leaky_relu_0.1"``
    (another slope >= 0, as Python prints the float: YOLO), ``"sigmoid"`` or
    ``"hardsigmoid"`` (squeeze-and-excitation gates). Any groups (depthwise included). The bias is added once to the final sum, then the activation. Dtypes float32,
    float64, bfloat16, float16 (the narrow ones accumulate in float32). Differentiable; works
    under ``torch.compile``.
    """

    def pair(v):
        return [v, v] if isinstance(v, int) else list(v)

    return torch.ops.tvm_gemm.conv2d_bias_relu(
        x, weight, bias, pair(stride), pair(padding), pair(dilation), groups, relu, activation
    )
