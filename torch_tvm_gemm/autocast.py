"""``torch.autocast`` for the tvm_gemm ops, as for torch's own linear / matmul / conv2d.

Inside ``torch.autocast(device_type, dtype)``, each op casts its floating-point tensor
arguments on that device (float64 excepted, as torch does) to the autocast dtype and runs in
it: fp32 master weights stay fp32 (the cast is differentiable, so their gradients are fp32)
and the output has the autocast dtype. The cast is a dispatcher kernel on the Autocast keys,
registered with torch.library, so ``torch.compile`` still sees the op itself.

A model's weight (a float32 leaf tensor that requires grad: what torch's autocast cache
keeps for one region) is cast once and kept, across autocast regions, while it is unchanged
(``kept_weights.py``: every write is seen, as for the BN fold; with gradients wanted the
kept cast is a function of the weight). torch casts such a weight once per region and frees
the copy at the region's end: with a region per call (``with autocast(): model(x)``) that
is a cast of every weight, in fresh memory, at every forward (BERT-style encoder, batch 1,
Intel Xeon: about half of eager's forward). The kept copies cost half the weights' fp32
memory while their weights live (``torch_tvm_gemm.kept_bytes()["autocast casts"]``;
``clear_kept_casts()`` frees them);
``torch.autocast(..., cache_enabled=False)`` keeps none (a cast at every call, as torch then
does). Other arguments, and every argument under torch.compile's tracing or a torch.func
transform, are cast at each call (``Tensor.to``; of these torch's cache would keep only a
weight under a transform, for one region).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from . import ops  # noqa: F401 (defines the ops first)
from .kept_weights import KeptWeights, gradient_keepable, with_gradient

OPS = ("matmul", "linear", "conv2d_bias_relu")
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

_LIB = torch.library.Library("tvm_gemm", "IMPL")  # noqa: TOR901 (autocast kernels only)


def _cast(value, device_type: str, dtype: torch.dtype):
    if (
        isinstance(value, Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == device_type
        and value.dtype != dtype
    ):
        if value.requires_grad and value.is_leaf and _keeps_cast(value):
            return _kept_cast(value, dtype)
        return value.to(dtype)
    return value


# The kept casts by the id of their weight, each entry removed when its weight dies (a dict
# of ids: WeakIdKeyDictionary's lookups cost ~1 us, a quarter of a kept cast's check).
_KEPT: dict[int, tuple[weakref.ref, KeptWeights]] = {}


def _keeps_cast(value: Tensor) -> bool:
    """Whether ``value``, a leaf that requires grad, is a model's weight whose cast is kept
    (see above): a plain float32 tensor, outside torch.compile's tracing (fake tensors, whose
    kept copy would outlive the graph) and torch.func transforms, with the autocast cache
    on."""
    return (
        value.dtype == torch.float32
        and type(value) in (Tensor, torch.nn.Parameter)
        and torch.is_autocast_cache_enabled()
        and not torch.compiler.is_compiling()
        and gradient_keepable()
    )


def _kept_cast(weight: Tensor, dtype: torch.dtype) -> Tensor:
    key = id(weight)
    entry = _KEPT.get(key)
    if entry is None or entry[0]() is not weight:
        forget = weakref.ref(weight, lambda _, key=key: _forget(key))
        entry = _KEPT[key] = (forget, KeptWeights("autocast casts"))
    (cast,) = entry[1].get([weight], True, (dtype,), lambda: (weight.to(dtype),))
    if torch.is_grad_enabled():  # (the gradient reaches the fp32 weight)
        source_dtype = weight.dtype  # (the backward's cast: the weight's own dtype)
        (cast,) = with_gradient((cast,), (weight,), vjp=lambda g: (g.to(source_dtype),))
    return cast


def _forget(key: int) -> None:
    entry = _KEPT.get(key)
    if entry is not None and entry[0]() is None:  # (not a newer weight's at that id)
        del _KEPT[key]


def clear_kept_casts() -> None:
    """Free the kept casts of every weight (made again at their next autocast call)."""
    _KEPT.clear()


def autocast_dtype(x: Tensor, weight: Tensor) -> torch.dtype | None:
    """The dtype the ops' autocast kernel will cast a float ``weight`` to under an active
    autocast on ``x``'s device, or None. For a module that keeps a copy it derives from its
    weight (the BN fold, a relaid conv weight): kept in that dtype, else the copy, not a leaf,
    would be cast at every call."""
    device = x.device.type
    if (
        torch.is_autocast_enabled(device)
        and weight.is_floating_point()
        and weight.dtype != torch.float64
    ):
        dtype = torch.get_autocast_dtype(device)
        return dtype if dtype != weight.dtype else None
    return None


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
