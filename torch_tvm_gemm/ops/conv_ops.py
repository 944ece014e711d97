"""The conv op, ``tvm_gemm::conv2d_bias_relu`` (relu, or the epilogue ``activation`` names):
the kernel a call needs
(``conv2d_spec``), the CPU and CUDA impls, the fake kernel and the autograd formulas.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from ..func_autograd import register_function_autograd
from ..kernels.conv2d import ACTIVATIONS as CONV_ACTIVATIONS
from ..kernels.conv2d import Conv2dSpec, leaky_relu_slope, torch_activation
from ..kernels.gemm import ACTIVATIONS as GEMM_ACTIVATIONS
from ..runtime import output_pool
from ..runtime.loader import sync_threads
from ..runtime.table import get_kernel
from ..schedules import cpu_depthwise_nhwc
from ..schedules.cpu_conv2d import (
    channels_last_blocked,
    nhwc_kernel,
    one_pixel_as_linear,
    patches_as_gemm,
    pointwise_as_gemm,
    weight_pack,
)
from ..target import host_cpu
from .checks import (
    CONV,
    DTYPE_NAMES,
    INT32_MAX,
    check_conv2d,
    check_cuda_arch,
    conv_activation,
    pair,
)
from .gemm_ops import aligned, device_name, gemm, saveable, silu_grad, sum_tangents
from .plan import active as active_plan
from .schemas import LIB

_conv_spec = functools.lru_cache(maxsize=4096)(Conv2dSpec)  # one spec object per geometry


def conv2d_spec(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride,
    padding,
    dilation,
    groups: int,
    relu: bool,
    device: str | None = None,
    activation: str | None = None,
) -> Conv2dSpec:
    """The kernel a validated call asks for, on ``device`` (default: x's; ``cuda_cases``
    asks for the CUDA kernel of meta tensors); ``activation``, when given, replaces relu."""
    n, c, h, w = x.shape
    k, _, r, s = weight.shape
    spec = _conv_spec(
        dtype=DTYPE_NAMES[x.dtype],
        c=c,
        k=k,
        r=r,
        s=s,
        h=h,
        w=w,
        stride=pair(CONV, "stride", stride, 1),
        padding=pair(CONV, "padding", padding, 0),
        dilation=pair(CONV, "dilation", dilation, 1),
        groups=groups,
        bias=bias is not None,
        relu=relu,
        device=device or device_name(x),
        activation=conv_activation(relu, activation),
    )
    if spec.device == "cpu" and weight_pack(spec, n) != spec.weight_pack:
        return dataclasses.replace(spec, weight_pack=weight_pack(spec, n))
    return spec


def _conv2d_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int = 1,
    relu: bool = True,
    activation: str | None = None,
) -> Tensor:
    if active_plan() is not None:
        shape = check_conv2d(x, weight, bias, stride, padding, dilation, groups)
        conv_activation(relu, activation)
        return _planned_conv2d(
            x, weight, bias, stride, padding, dilation, groups, relu, activation, shape
        )
    shape, spec, route = _checked_geometry(
        x, weight, bias, stride, padding, dilation, groups, relu, activation
    )
    if channels_last_output(x) and math.prod(shape) != 0:
        return _conv2d_channels_last(x, weight, bias, spec, shape)
    if route == "subsample":
        return _conv2d_impl(_subsampled(x, spec), weight, bias, 1, 0, 1, groups, relu, activation)
    # The kernel writes NCHW; channels_last / strided inputs are copied to NCHW first.
    out = output_pool.empty(shape, x.dtype, x.device)
    if out.numel() == 0:  # (no input channels included: check_conv2d)
        return out
    if route == "linear":
        return _one_pixel_conv(x, weight, bias, spec.activation, out)
    if route == "gemm":
        return _pointwise_conv(x, weight, bias, spec.activation, out)
    if route == "nhwc":
        return _nhwc_conv(x, weight, bias, spec, out)
    if route == "patches":
        return _patches_conv(x, weight, bias, spec, out)
    kernel = get_kernel(spec)
    sync_threads()
    # The kernel reads the weight in torch's layout and packs it itself, at every call: no
    # cache key sees every change of a weight (a write through ``weight.data`` or a numpy
    # view leaves ``_version`` as it was; the copy-on-write mark of ``fold.py`` sees those,
    # but handing the weight to the kernel takes it for writing, which clears the mark at
    # every call), and checking a kept pack costs a pass over the weight, as packing does.
    args = [x.contiguous(), weight.contiguous()]
    if bias is not None:
        args.append(bias.contiguous())
    kernel(*[aligned(t) for t in args], out)  # out: fresh, hence aligned
    return out


# The checks and the kernel choice of a call depend on its geometry only (shapes, dtypes,
# devices, stride, padding, dilation, groups, activation), and a model calls each layer with
# one geometry: they are worked out once per geometry. Measured: ~20 us a call, where the
# kernel of a small conv takes 1-100 us (MobileNetV2 at batch 1: 52 convs, ~20 ms in all).
# Only geometries that passed the checks are kept; nothing here holds a tensor.
_GEOMETRIES: dict[tuple, tuple[list[int], Conv2dSpec | None, str]] = {}
_MAX_GEOMETRIES = 4096


def _checked_geometry(x, weight, bias, stride, padding, dilation, groups, relu, activation):
    """(output shape, kernel spec, route) of a valid CPU call; raises the checks' errors for
    an invalid one. The route: "linear" (one output pixel of a 1x1 conv: a GEMM over that
    pixel of each image), "gemm" (a GEMM per image), "patches" (one GEMM over the
    patches of all images: few output pixels, see ``reads_patches``), "nhwc" (the bf16
    implicit GEMM over channels-last pixels, on AMX tiles or vdpbf16ps), "conv" (the conv
    kernel) or "subsample" (a strided 1x1 conv: the same conv, stride 1, on the pixels it
    reads)."""
    try:
        key = (
            x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
            weight.is_contiguous(memory_format=CL),
            None if bias is None else (bias.shape, bias.dtype, bias.device),
            tuple(stride), tuple(padding), tuple(dilation), groups, relu, activation,
        )  # fmt: skip
        found = _GEOMETRIES.get(key)
    except TypeError:  # an argument that is not a sequence or not hashable: checked below
        key, found = None, None
    if found is not None:
        return found
    shape = check_conv2d(x, weight, bias, stride, padding, dilation, groups)
    conv_activation(relu, activation)
    if math.prod(shape) == 0:  # no kernel runs: nothing to choose
        return shape, None, "conv"
    spec = conv2d_spec(x, weight, bias, stride, padding, dilation, groups, relu, None, activation)
    if one_pixel_as_linear(spec):
        route = "linear"
    elif reads_patches(spec, weight):
        route = "patches"
    elif strided_pointwise(spec):
        route = "subsample"
    else:
        route = "gemm" if pointwise_as_gemm(spec) else "nhwc" if nhwc_kernel(spec) else "conv"
    found = (shape, spec, route)
    if key is not None and len(_GEOMETRIES) < _MAX_GEOMETRIES:
        _GEOMETRIES[key] = found
    return found


CL = torch.channels_last


def reads_patches(spec: Conv2dSpec, weight: Tensor) -> bool:
    """Whether the CPU conv runs as one GEMM over patches (``patches_as_gemm``): where the
    weight is (K, R, S, C) in memory, a 1x1 or channels_last one, so that the patches' copy
    moves whole rows of channels. (On (C, R, S) patches of a contiguous 3x3 weight, runs of
    3 values, the copy cost what the GEMM gained: 0.63-0.99x torch at 7x7 512 -> 512, where
    the conv kernel ran at 0.79-1.21x and channels-last patches at 0.87-1.26x.)"""
    pointwise = spec.r == spec.s == 1
    return patches_as_gemm(spec) and (pointwise or weight.is_contiguous(memory_format=CL))


def weight_layout(x: Tensor, weight: Tensor, stride, padding, dilation, groups: int):
    """The memory format in which the CPU conv of ``x`` reads ``weight`` as it lies:
    channels_last ((K, R, S, C) in memory) where it runs the bf16 implicit GEMM over NHWC
    pixels (route "nhwc"), which permutes any other weight at every call, or where a
    channels_last weight makes it a GEMM over patches (``reads_patches``), or where it runs
    the blocked kernel over the pixels of a channels_last x (``channels_last_blocked``); else
    contiguous. For a module that keeps a weight it derives (the conv + BN fold,
    ``fold.py``): ResNet-50's 512-channel 3x3 weights took 0.8-2 ms a call to permute in bf16
    (AMD EPYC, batch 1), where the conv itself takes ~0.5 ms."""
    if x.device.type != "cpu" or x.dim() != 4 or weight.dim() != 4:
        return torch.contiguous_format
    try:
        _, spec, route = _checked_geometry(x, weight, None, stride, padding, dilation, groups,
                                           True, None)  # fmt: skip
    except (ValueError, TypeError, RuntimeError):  # a bad call: the op itself will say so
        return torch.contiguous_format
    patches = spec is not None and patches_as_gemm(spec)
    blocked_nhwc = spec is not None and channels_last_output(x) and channels_last_blocked(spec)
    return CL if route == "nhwc" or patches or blocked_nhwc else torch.contiguous_format


def channels_last_output(x: Tensor) -> bool:
    """Whether the op's output is channels_last (the CPU and CUDA impls and the fake kernel):
    for a channels_last ``x``, as ``F.conv2d`` does (an ``x`` that is both, one channel or
    one pixel, counts as contiguous)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=CL)


def channels_last_route(spec: Conv2dSpec, weight: Tensor) -> str:
    """The route of the CPU conv of a channels_last x (``_conv2d_channels_last`` runs it):
    "patches" (few output pixels: ``reads_patches``), "nhwc kernel" (a depthwise or blocked
    kernel over the channels-last pixels: ``_conv_nhwc``), "subsample" (a strided 1x1 conv:
    the same conv at stride 1 on the pixels it reads), "pixels" (a 1x1 conv: one GEMM over
    all pixels), "nhwc" (the bf16 implicit GEMM) or "copy" (the NCHW kernel on a copy)."""
    if reads_patches(spec, weight):
        return "patches"
    if cpu_depthwise_nhwc.applies(spec, host_cpu()):
        return "nhwc kernel"
    if strided_pointwise(spec):
        return "subsample"
    if spec.r == spec.s == 1 and spec.padding == (0, 0) and spec.groups == 1:
        return "pixels"
    if nhwc_kernel(spec) is not None:
        return "nhwc"
    return "nhwc kernel" if channels_last_blocked(spec) else "copy"


def _conv2d_channels_last(x: Tensor, weight: Tensor, bias, spec, shape) -> Tensor:
    """The CPU conv of a channels_last ``x``, its output channels_last. A 1x1 conv is then one
    GEMM over all pixels, ``(N*H*W, C) @ W^T``, on x as it lies and straight into the output
    (no copy either side; measured, 2 threads, Intel Xeon, against oneDNN's channels_last
    conv: 0.93-1.25x at ResNet-50's 1x1 shapes at batch 8, where the NCHW routes ran at
    0.42-0.87x); a strided one on a channels_last copy of the pixels it reads. The bf16
    implicit GEMM ("nhwc") reads x and writes its output channels-last as they are, and so
    do the depthwise and blocked kernels over channels-last pixels (``_conv_nhwc``). Other
    convs run the NCHW kernel and their output is copied to channels_last."""
    n, _, out_h, out_w = shape
    route = channels_last_route(spec, weight)
    if route == "patches":
        y = _patches_product(x, weight, bias, spec)
        return y.view(n, out_h, out_w, -1).permute(0, 3, 1, 2)
    if route == "nhwc kernel":
        return _conv_nhwc(x, weight, bias, spec, shape)
    if route == "subsample":  # the same conv at stride 1, on the pixels it reads
        sub = _subsampled(x, spec).contiguous(memory_format=CL)
        y = _conv2d_impl(sub, weight, bias, [1, 1], [0, 0], [1, 1], spec.groups, spec.relu,
                         spec.activation)  # fmt: skip
        return y.contiguous(memory_format=CL)  # (a no-op, but where the pixels are one)
    if route == "pixels":
        k, c = weight.shape[:2]
        pixels = x.permute(0, 2, 3, 1).reshape(-1, c)  # a view: x is channels_last
        out = output_pool.empty((n * out_h * out_w, k), x.dtype, x.device)
        _gemm_activated(pixels, weight.reshape(k, c), "nk", bias, spec.activation, out, "n")
        return out.view(n, out_h, out_w, k).permute(0, 3, 1, 2)
    if route == "nhwc":  # NHWC in and out already: no copy to NCHW and back
        y = _nhwc_product(x, weight, bias, spec)
        return y.view(n, out_h, out_w, -1).permute(0, 3, 1, 2)
    y = _conv2d_impl(
        x.contiguous(),
        weight,
        bias,
        list(spec.stride),
        list(spec.padding),
        list(spec.dilation),
        spec.groups,
        spec.relu,
        spec.activation,
    )
    return y.contiguous(memory_format=CL)


@functools.lru_cache(maxsize=4096)
def _nhwc_spec(spec: Conv2dSpec, batch: int) -> Conv2dSpec:
    """``spec``'s kernel over channels-last pixels for ``batch`` images (one object per
    geometry, as ``_conv_spec``), with the blocked kernel's weight pack for that layout."""
    nhwc = dataclasses.replace(spec, layout="nhwc", weight_pack="task")
    return dataclasses.replace(nhwc, weight_pack=weight_pack(nhwc, batch))


def _conv_nhwc(x: Tensor, weight: Tensor, bias: Tensor | None, spec, shape) -> Tensor:
    """A conv of a channels_last ``x`` by a kernel over its channels-last pixels: the
    depthwise one (``schedules/cpu_depthwise_nhwc.py``, the weight as (R, S, C): a copy of
    R*S*C values) or the blocked one (``channels_last_blocked``, the weight as (K, R, S,
    C/groups): a view of a channels_last weight). x is read as it lies, the output written
    channels-last.
    Planning records the kernel."""
    n, k, out_h, out_w = shape
    nhwc = _nhwc_spec(spec, n)
    found = active_plan()
    if found is not None:
        found.record(nhwc)
        if not found.compute:
            return x.new_empty(shape).contiguous(memory_format=CL)
        y = torch.nn.functional.conv2d(x, weight, bias, spec.stride, spec.padding,
                                       spec.dilation, spec.groups)  # fmt: skip
        return torch_activation(spec.activation)(y)
    kernel = get_kernel(nhwc)
    sync_threads()
    if spec.groups == spec.c == spec.k:  # depthwise
        w = weight.reshape(k, spec.r, spec.s).permute(1, 2, 0).contiguous()
    else:  # (K, R, S, C/groups): no copy of a channels_last weight (``weight_layout``)
        w = weight.permute(0, 2, 3, 1).contiguous()
    out = output_pool.empty((n, out_h, out_w, k), x.dtype, x.device)
    args = [x.permute(0, 2, 3, 1), w] + ([bias.contiguous()] if bias is not None else [])
    kernel(*[aligned(t) for t in args], out)  # out: fresh, hence aligned
    return out.permute(0, 3, 1, 2)


def strided_pointwise(spec: Conv2dSpec) -> bool:
    """A 1x1 conv with a stride and no padding (ResNet's downsampling shortcuts) reads one
    pixel in ``stride`` x ``stride``: it runs as a stride-1 conv on a copy of those pixels.
    In place, every channel block of the kernel streamed the whole input through the caches
    for a quarter of it: ResNeXt's 256 -> 512 channels at 56x56, stride 2, batch 8, ran at
    0.56x torch (2 threads, Intel Xeon)."""
    return spec.r == spec.s == 1 and spec.padding == (0, 0) and spec.stride != (1, 1)


def _subsampled(x: Tensor, spec: Conv2dSpec) -> Tensor:
    """The input pixels a strided 1x1 conv reads (a view; the route copies it)."""
    sh, sw = spec.stride
    return x[:, :, ::sh, ::sw]


def _one_pixel_conv(x: Tensor, weight: Tensor, bias: Tensor | None, act: str, out: Tensor):
    """A 1x1 conv with one output pixel (``one_pixel_as_linear``) as a linear layer over the
    pixel it reads, ``out = act(x[:, :, 0, 0] @ W^T + bias)`` (the linear op's kernel)."""
    n, c = x.shape[:2]
    k = weight.shape[0]
    _gemm_activated(x[:, :, 0, 0], weight.reshape(k, c), "nk", bias, act, out.view(n, k), "n")
    return out


def _pointwise_conv(x: Tensor, weight: Tensor, bias: Tensor | None, act: str, out: Tensor):
    """A 1x1 conv as one GEMM per image, ``out[n] = act(W @ x[n] + bias[:, None])`` over
    the flattened pixels (``schedules/cpu_conv2d.pointwise_as_gemm`` says when and why)."""
    n, c = x.shape[:2]
    pixels = x.contiguous().view(n, c, -1)
    return _gemm_per_image(weight.reshape(weight.shape[0], c), pixels, bias, act, out)


def _nhwc_conv(x: Tensor, weight: Tensor, bias: Tensor | None, spec, out: Tensor):
    """``_nhwc_product`` of an NCHW x, its NHWC result copied into ``out``."""
    y = _nhwc_product(x, weight, bias, spec)
    out.copy_(y.view(x.shape[0], spec.out_h, spec.out_w, -1).permute(0, 3, 1, 2))
    return out


def _nhwc_product(x: Tensor, weight: Tensor, bias: Tensor | None, spec) -> Tensor:
    """The bf16 implicit GEMM (``schedules/cpu_amx_conv.py`` or ``cpu_avx512_bf16_conv.py``):
    an NHWC copy of x (none for a channels_last x that needs no zero border), the weight as
    (K, R*S*C) (no copy for a channels_last weight); returns the NHWC result, (N*OH*OW, K)."""
    kernel = get_kernel(spec)
    sync_threads()
    n, k = x.shape[0], weight.shape[0]
    padding = nhwc_kernel(spec).input_padding(spec)  # read in place: zero borders around it
    x_nhwc = _nhwc_pixels(x, *(padding or (0, 0, 0, 0))).contiguous()
    w_ohwi = weight.permute(0, 2, 3, 1).reshape(k, -1).contiguous()
    y = torch.empty((n * spec.out_h * spec.out_w, k), dtype=x.dtype, device=x.device)
    args = [aligned(x_nhwc), aligned(w_ohwi)] + (
        [aligned(bias.contiguous())] if bias is not None else []
    )
    kernel(*args, y)
    return y


def _nhwc_pixels(x: Tensor, top: int, bottom: int, left: int, right: int) -> Tensor:
    """x's pixels as (N, H, W, C): a view, or a channels-last copy inside zero borders."""
    pixels = x.permute(0, 2, 3, 1)
    if top or bottom or left or right:
        pixels = torch.nn.functional.pad(pixels, (0, 0, left, right, top, bottom))
    return pixels


def _patches_conv(x: Tensor, weight: Tensor, bias: Tensor | None, spec, out: Tensor):
    """``_patches_product`` of an NCHW x, its (pixels, channels) result copied into ``out``."""
    y = _patches_product(x, weight, bias, spec)
    out.copy_(y.view(x.shape[0], spec.out_h, spec.out_w, -1).permute(0, 3, 1, 2))
    return out


# The patches of a 3x3 conv are 9 times its input: a large batch takes them a chunk of
# images at a time, each chunk one GEMM (ResNet's 7x7 stage at batch 8: 1.6 MB of patches).
PATCHES_MAX_BYTES = 32 << 20


def _patches_product(x: Tensor, weight: Tensor, bias: Tensor | None, spec) -> Tensor:
    """The conv as one GEMM over the patches of all images (``reads_patches``), a chunk of
    images at a time past PATCHES_MAX_BYTES: ``act(P @ W^T + bias)``, P's rows the
    (N*OH*OW) output pixels' inputs in the order of the weight's memory, (R, S, C). Returns
    the (N*OH*OW, K) result."""
    n, c = x.shape[:2]
    k, _, r, s = weight.shape
    top, left = spec.padding
    pixels = _nhwc_pixels(x, top, top, left, left)
    # A view of the patches over the pixels' storage: (n, oh, ow) the output pixel, then
    # (r, s, c) the weight's order; the reshape copies it (except a 1x1 over NHWC pixels).
    sn, sh, sw, sc = pixels.stride()
    (st_h, st_w), (dl_h, dl_w) = spec.stride, spec.dilation
    sizes = (n, spec.out_h, spec.out_w, r, s, c)
    strides = (sn, st_h * sh, st_w * sw, dl_h * sh, dl_w * sw, sc)
    patches = pixels.as_strided(sizes, strides, pixels.storage_offset())
    p, taps = spec.out_h * spec.out_w, r * s * c
    y = output_pool.empty((n * p, k), x.dtype, x.device)
    w_rsc = weight.permute(0, 2, 3, 1).reshape(k, -1)  # a view: 1x1 or channels_last
    images = max(1, PATCHES_MAX_BYTES // (p * taps * x.element_size()))
    for first in range(0, n, images):
        last = min(n, first + images)
        rows = patches[first:last].reshape((last - first) * p, taps)
        _gemm_activated(rows, w_rsc, "nk", bias, spec.activation, y[first * p : last * p], "n")
    return y


def _gemm_per_image(w: Tensor, pixels: Tensor, bias: Tensor | None, act: str, out: Tensor):
    """``out[n] = act(w @ pixels[n] + bias[:, None])`` for each image n."""
    n, k = pixels.shape[0], w.shape[0]
    dest = out.view(n, k, -1)
    for i in range(n):
        _gemm_activated(w, pixels[i], "kn", bias, act, dest[i], "m")
    return out


def _gemm_activated(a, b, b_layout: str, bias, act: str, out: Tensor, bias_axis: str) -> None:
    """``out = act(a @ B + bias)`` by the GEMM kernel, the conv's epilogue in the kernel's
    (relu6, hardswish and leaky_relu too: ``kernels/gemm.is_epilogue``)."""
    gemm(a, b, b_layout, bias, act, out=out, bias_axis=bias_axis)


def _planned_conv2d(x, weight, bias, stride, padding, dilation, groups, relu, activation, shape):
    """Planning mode (ops/plan.py): record the kernels the planned device's impl would ask
    for, and return torch's result. (A grouped conv planned for CUDA records nothing: the
    GPU impl refuses it.)"""
    found = active_plan()
    device = found.device_for(device_name(x))
    act = conv_activation(relu, activation)
    if math.prod(shape) != 0 and (device == "cpu" or groups == 1):
        spec = conv2d_spec(x, weight, bias, stride, padding, dilation, groups, relu, device, act)
        if device == "cpu" and one_pixel_as_linear(spec):  # (its GEMM plans its own)
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            return _one_pixel_conv(x, weight, bias, act, out)
        if device == "cpu" and channels_last_output(x):  # (its GEMMs and convs plan theirs)
            return _conv2d_channels_last(x, weight, bias, spec, shape)
        if device == "cpu" and reads_patches(spec, weight):
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            return _patches_conv(x, weight, bias, spec, out)  # a GEMM, which plans its own
        if device == "cpu" and strided_pointwise(spec):
            sub = _subsampled(x, spec)
            return _planned_conv2d(sub, weight, bias, 1, 0, 1, groups, relu, activation, shape)
        if device == "cpu" and pointwise_as_gemm(spec):
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            return _pointwise_conv(x, weight, bias, act, out)  # GEMMs, which plan theirs
        found.record(spec)
    if not found.compute:
        return x.new_empty(shape)
    y = torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return torch_activation(act)(y)


# The C++ impl (csrc/tvm_gemm_ops.cpp conv2d_impl) keeps, per geometry, the route this
# function chooses: it runs the "conv", "linear", "nhwc kernel" and "pixels" routes itself and
# calls _conv2d_impl for the others. Its kernels are handed over by id (``cpp_conv_kernel``,
# through tvm-ffi).
_CPP_KERNEL_SPECS: list[Conv2dSpec] = []
_CPP_KERNEL_IDS: dict[Conv2dSpec, int] = {}


# The epilogues the C++ impl's GEMM table knows (ops/impls.py registers them): the linear
# op's, then the conv's others (a leaky ReLU of another slope: the Python route).
CPP_LINEAR_EPILOGUES = frozenset(GEMM_ACTIVATIONS) | frozenset(CONV_ACTIVATIONS)


def cpp_route(x, weight, bias, stride, padding, dilation, groups, relu, activation):
    """The C++ impl's plan for a call's geometry: ``(route, output shape, kernel id, linear
    activation)``. Routes: "conv" (the conv kernel of id ``kernel id``, on an NCHW x),
    "linear" (a 1x1 conv with one output pixel whose epilogue the C++ GEMM table knows), for
    a channels_last x "nhwc kernel" (the kernel of id ``kernel id`` over its pixels:
    ``_conv_nhwc``) and "pixels" (a 1x1 conv: the GEMM over all pixels, an epilogue the
    GEMM table knows), or "python" (the rest, and empty outputs: it calls ``_conv2d_impl``).
    Raises the checks' error for a bad call, and builds (or loads) the kernel, as the first
    Python call would."""
    shape, spec, route = _checked_geometry(
        x, weight, bias, stride, padding, dilation, groups, relu, activation
    )
    python = "python", list(shape), -1, "none"
    if math.prod(shape) == 0:
        return python
    if channels_last_output(x):
        route = channels_last_route(spec, weight)
        if route == "pixels" and spec.activation in CPP_LINEAR_EPILOGUES:
            return "pixels", list(shape), -1, spec.activation
        if route == "nhwc kernel":
            return route, list(shape), _cpp_kernel_id(_nhwc_spec(spec, shape[0])), "none"
        return python
    if route == "linear" and spec.activation in CPP_LINEAR_EPILOGUES:
        return "linear", list(shape), -1, spec.activation
    if route != "conv":
        return python
    return "conv", list(shape), _cpp_kernel_id(spec), "none"


def _cpp_kernel_id(spec: Conv2dSpec) -> int:
    """The id by which the C++ impl asks for ``spec``'s kernel (built or loaded here first:
    a failed build raises here, as a Python error)."""
    get_kernel(spec)
    kernel_id = _CPP_KERNEL_IDS.get(spec)
    if kernel_id is None:
        kernel_id = _CPP_KERNEL_IDS[spec] = len(_CPP_KERNEL_SPECS)
        _CPP_KERNEL_SPECS.append(spec)
    return kernel_id


def cpp_conv_kernel(kernel_id: int):
    """The kernel ``cpp_route`` gave ``kernel_id`` (the tvm-ffi global "tvm_gemm.conv_kernel")."""
    return get_kernel(_CPP_KERNEL_SPECS[kernel_id])


# CUDA: an implicit GEMM on tensor cores (kernels/conv2d_cuda.py) over an NHWC input and a
# (K, R*S*C) weight. The op stays NCHW: a channels_last x (the layout tensor-core convs want)
# is NHWC already, so it costs no copy and gives a channels_last output, as F.conv2d does;
# a contiguous x is permuted to NHWC first and the output copied back to contiguous NCHW.


def _conv2d_cuda_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int = 1,
    relu: bool = True,
    activation: str | None = None,
) -> Tensor:
    shape = check_conv2d(x, weight, bias, stride, padding, dilation, groups)
    if active_plan() is not None:
        conv_activation(relu, activation)
        return _planned_conv2d(
            x, weight, bias, stride, padding, dilation, groups, relu, activation, shape
        )
    if groups != 1:
        raise NotImplementedError(
            f"tvm_gemm.{CONV}: argument 'groups' must be 1 on CUDA, got {groups} (grouped "
            "and depthwise convolutions have CPU kernels only; use F.conv2d on the GPU)"
        )
    check_cuda_arch(x)
    conv_activation(relu, activation)
    n, k, oh, ow = shape
    if max(x.numel(), math.prod(shape), weight.numel()) > INT32_MAX:
        raise ValueError(
            f"tvm_gemm.{CONV}: CUDA kernels index in 32 bits; x {tuple(x.shape)} with weight "
            f"{tuple(weight.shape)} has a tensor of 2**31 elements or more (split the batch)"
        )
    channels_last = channels_last_output(x)
    # The kernel writes NHWC: ``nhwc`` is its output, ``out`` the same memory as N, K, OH, OW.
    nhwc = torch.empty((n, oh, ow, k), dtype=x.dtype, device=x.device)
    out = nhwc.permute(0, 3, 1, 2)
    if out.numel() != 0:  # (no input channels: no output channels, see check_conv2d)
        spec = conv2d_spec(x, weight, bias, stride, padding, dilation, 1, relu, "cuda", activation)
        kernel = get_kernel(spec)
        x_nhwc = x.permute(0, 2, 3, 1).contiguous()  # a view of a channels_last x: no copy
        args = [x_nhwc, _weight_krsc(weight)]  # (at every call: see _conv2d_impl)
        if bias is not None:
            args.append(bias.contiguous())
        with torch.cuda.device(x.device):  # (as in gemm: tvm_ffi uses torch's current stream)
            kernel(*[aligned(t) for t in args], nhwc.view(n * oh * ow, k))
    return out if channels_last else out.contiguous()


def _weight_krsc(weight: Tensor) -> Tensor:
    """The CUDA kernels' B operand: ``(K, C, R, S)`` -> ``(K, R*S*C)``, channels fastest."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1).contiguous()


LIB.impl(CONV, _conv2d_cuda_impl, "CUDA")


@torch.library.register_fake("tvm_gemm::conv2d_bias_relu")
def _conv2d_fake(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int = 1,
    relu: bool = True,
    activation: str | None = None,
) -> Tensor:
    shape = check_conv2d(x, weight, bias, stride, padding, dilation, groups)
    conv_activation(relu, activation)
    if channels_last_output(x):  # (Tensor.new_empty takes no memory_format)
        return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=CL)
    return x.new_empty(shape)


_CONV_DEFAULTS = [None, [1, 1], [0, 0], [1, 1], 1, True, None]  # bias ... activation

# d act(z) / dz applied to the incoming gradient: from the output where it tells (relu,
# relu6: the gradient passes where the output is strictly inside the linear range, as in
# torch; leaky_relu: the output has the sign of z), else from the pre-activation z (torch's
# own backward formulas).
_OUTPUT_GRADS = {
    "relu": lambda grad, out: grad * (out > 0),
    "relu6": lambda grad, out: grad * ((out > 0) & (out < 6)),
    "sigmoid": lambda grad, out: torch.ops.aten.sigmoid_backward(grad, out),
}


def _output_grad(act: str):
    """The gradient formula of ``act`` from the output, or None."""
    slope = leaky_relu_slope(act)  # (a slope >= 0: out > 0 exactly where z > 0)
    if slope is not None:
        return lambda grad, out: torch.where(out > 0, grad, grad * slope)
    return _OUTPUT_GRADS.get(act)


# torch's backward formulas (differentiable again, except hardsigmoid's, as for torch's own
# F.hardsigmoid)
_PRE_ACTIVATION_GRADS = {
    "hardswish": lambda grad, z: torch.ops.aten.hardswish_backward(grad, z),
    "hardsigmoid": lambda grad, z: torch.ops.aten.hardsigmoid_backward(grad, z),
    "silu": silu_grad,
}


def _conv_args(inputs) -> list:
    """The op's 9 arguments (trailing ones equal to their defaults may be left out by the
    dispatcher), the epilogue resolved into the last."""
    args = (list(inputs) + _CONV_DEFAULTS[len(inputs) - 2 :])[:9]
    args[8] = conv_activation(args[7], args[8])
    return args


def _conv2d_setup(ctx, inputs, output) -> None:
    x, weight, bias, stride, padding, dilation, groups, _, act = _conv_args(inputs)
    ctx.geometry = (
        list(pair(CONV, "stride", stride, 1)),
        list(pair(CONV, "padding", padding, 0)),
        list(pair(CONV, "dilation", dilation, 1)),
        groups,
    )
    ctx.activation = act
    ctx.bias_sizes = None if bias is None else list(bias.shape)
    ctx.x_shape, ctx.w_shape = x.shape, weight.shape
    need_x, need_w = ctx.needs_input_grad[:2]
    # Only what the backward needs (an inference tensor cannot be saved; torch accepts one
    # where no gradient needs it): dX needs the weight, dW the input, relu's, relu6's,
    # leaky_relu's and sigmoid's derivatives the output; hardswish, hardsigmoid and silu the
    # pre-activation, recomputed in the backward from x, weight and bias rather than kept
    # alive.
    if act in _PRE_ACTIVATION_GRADS:
        ctx.save_for_backward(saveable(x), saveable(weight), saveable(bias), None)
    else:
        ctx.save_for_backward(
            x if need_w else None,
            weight if need_x else None,
            None,
            output if _output_grad(act) is not None else None,
        )


def _pre_activation(x, weight, bias, geometry) -> Tensor:
    stride, padding, dilation, groups = geometry
    return torch.ops.tvm_gemm.conv2d_bias_relu(
        x, weight, bias, stride, padding, dilation, groups, False, "none"
    )


def _conv2d_backward(ctx, grad: Tensor):
    x, weight, bias, output = ctx.saved_tensors
    if (formula := _output_grad(ctx.activation)) is not None:
        grad = formula(grad, output)
    elif ctx.activation in _PRE_ACTIVATION_GRADS:
        z = _pre_activation(x, weight, bias, ctx.geometry)
        grad = _PRE_ACTIVATION_GRADS[ctx.activation](grad, z)
    # An operand whose values no requested gradient reads is passed as a shape only, as
    # torch.nn.grad.conv2d_input / conv2d_weight do.
    if x is None:
        x = grad.new_empty(1).expand(ctx.x_shape)
    if weight is None:
        weight = grad.new_empty(1).expand(ctx.w_shape)
    stride, padding, dilation, groups = ctx.geometry
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad,
        x,
        weight,
        ctx.bias_sizes,
        stride,
        padding,
        dilation,
        False,  # transposed
        [0, 0],  # output_padding
        groups,
        [need_x, need_w, need_b and ctx.bias_sizes is not None],
    )
    return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _conv2d_jvp(ctx, inputs, output, tangent_x, tangent_w, tangent_b, *_):
    """Forward-mode: conv(dx, W) + conv(x, dW) + db, through the activation's derivative."""
    x, weight, bias = inputs[0], inputs[1], inputs[2]
    stride, padding, dilation, groups = ctx.geometry
    conv = torch.nn.functional.conv2d
    parts = []
    if tangent_x is not None:
        parts.append(conv(tangent_x, weight, None, stride, padding, dilation, groups))
    if tangent_w is not None:
        parts.append(conv(x, tangent_w, None, stride, padding, dilation, groups))
    if tangent_b is not None:
        parts.append(tangent_b.view(1, -1, 1, 1).expand_as(output))
    dz = sum_tangents(parts, output)
    act = _conv_args(inputs)[8]
    if (formula := _output_grad(act)) is not None:
        return formula(dz, output)
    if act in _PRE_ACTIVATION_GRADS:
        return _PRE_ACTIVATION_GRADS[act](dz, _pre_activation(x, weight, bias, ctx.geometry))
    return dz


register_function_autograd("conv2d_bias_relu", _conv2d_backward, _conv2d_setup, _conv2d_jvp)
