"""The ``tvm_gemm`` ops: every torch.library definition, one module per concern.

``schemas`` (every schema), ``checks`` (argument validation shared by fake and real
kernels), ``gemm_ops`` (matmul and linear), ``conv_ops`` (conv2d + bias + activation),
``impls`` (C++ or Python impls; the C++ table's miss handler; ``planning()``), ``plan`` (the
kernels a planned run asks for). Importing the package registers everything; the autograd
kernels must exist before the C++ impls are registered (the C++ fast path sits in front of
them), hence ``init_impls()`` last.
"""

from __future__ import annotations

from . import checks, conv_ops, gemm_ops, impls, plan, schemas
from .checks import check_conv2d, check_linear, check_matmul, tf32_allowed
from .conv_ops import conv2d_spec
from .gemm_ops import gemm, gemm_spec
from .impls import impl_path, planning, use_impl
from .plan import Plan

__all__ = ["checks", "conv_ops", "gemm_ops", "impls", "plan", "schemas"]
__all__ += ["check_conv2d", "check_linear", "check_matmul", "tf32_allowed", "conv2d_spec"]
__all__ += ["gemm", "gemm_spec", "impl_path", "use_impl", "planning", "Plan"]

impls.init_impls()
