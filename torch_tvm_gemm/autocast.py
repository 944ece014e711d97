"""``torch.autocast`` for the tvm_gemm ops, as for torch's own linear / matmul / conv2d.

Inside ``torch.autocast(device_type, dtype)``, each op casts its floating-point tensor
arguments on that device (float64 excepted, as torch does) to the autocast dtype and runs in
it: fp32 master weights stay fp32 (the cast is differentiable, so their gradients are fp32)
and the output has the autocast dtype. With the C++ extension the cast is torch's own
(``at::autocast::cached_cast``): a weight (a leaf tensor that requires grad) is cast once
per autocast region and reused, as for torch's ops, instead of at every call (BERT-style
encoder, batch 1, one region around the calls, Intel Xeon: 0.60x eager -> see
docs/model-coverage.md); without it, ``Tensor.to`` at every call. The cast is a dispatcher kernel on the Autocast keys,
registered with torch.library, so ``torch.compile`` still sees the op itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _ext, ops  # noqa: F401 (defines the ops first)

OPS = ("matmul", "linear", "conv2d_bias_relu")
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

_LIB = torch.library.Library("tvm_gemm", "IMPL")  # noqa: TOR901 (autocast kernels only)


def _cast(value, device_type: str, dtype: torch.dtype):
    if (
        isinstance(value, Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == device_type
    ):
        ext = _ext.load()
        if ext is not None:  # (torch's cast: its cache keeps a weight's cast for the region)
            return ext.autocast_cast(value, dtype, device_type)
        return value.to(dtype)
    return value


def _autocast_kernel(name: str, device_type: str, key: str):
    op = getattr(torch.ops.tvm_gemm, name).default
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        args = [_cast(a, device_type, dtype) for a in args]
        kwargs = {k: _cast(v, device_type, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)

    return kernel


for _name in OPS:
    for _device, _key in _KEYS.items():
        _LIB.impl(_name, _autocast_kernel(_name, _device, _key), _key)
