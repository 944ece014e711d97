"""``TVMConv2dBN``: a Conv2d followed by an eval-mode (or frozen) BatchNorm2d (and optionally an
activation: ReLU, ReLU6, hardswish, SiLU, leaky ReLU, sigmoid, hardsigmoid) as
one TVM conv, with the BN folded into the conv's weight and bias.

The conv and BN stay the model's (they are not submodules here, so nothing is duplicated in
a ``state_dict``); the folded weight and bias are recomputed whenever one of their tensors
changes through torch (``load_state_dict``, an optimizer step, ``copy_``, ``.to()``: each
bumps the tensor's version) or is replaced by another tensor, in the memory format the op
reads in place (``conv_ops.weight_layout``: channels_last for the bf16 NHWC convs, which
permuted it at every call before: ResNet-50 bf16, batch 1, 9.2 -> 2.1 ms of copies a forward
on an AMD EPYC; for the fp32 convs with few output pixels, a GEMM over channels-last patches; and
for the fp32 convs of a channels_last input; an input of another image size or memory
format folds again). A write that torch does not count in the version (through
``tensor.data``, or a numpy view made after the fold) is seen too: keeping a fold marks the
six tensors' storage copy-on-write (``kept_weights.py``), and the first write through any
alias clears the mark, which the next call checks. Nothing is copied: no one else shares
the buffer, so the writer keeps it. A numpy view made before the fold writes unseen: call
``refold()`` after writing through one. (Folding at every call instead would cost a pass
over the weight per call, as much as the conv's own pack.) Under ``torch.compile`` the fold
is part of the graph, computed at every call (inductor fuses it into one pass over the
weight). With gradients wanted the kept fold is read as a function of the conv's and BN's own
parameters (``kept_weights.with_gradient``: the backward differentiates the fold), so the
gradients reach them; under a torch.func transform or forward-mode AD the fold is done with
autograd on every call. A BN switched back to training mode runs as plain torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .autocast import autocast_dtype
from .fusion import CONV_OP, conv_padding, is_frozen_bn
from .kept_weights import KeptWeights, gradient_keepable, with_gradient
from .kernels.conv2d import torch_activation
from .ops.conv_ops import weight_layout


def fold_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """The weight and bias of ``conv`` with the eval-mode ``bn`` after it folded in."""
    return _fold(conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                 bn.eps)  # fmt: skip


def _fold(weight, bias, gamma, beta, mean, var, eps: float) -> tuple[Tensor, Tensor]:
    """``fold_conv_bn`` of the conv's and BN's tensors (bias, gamma, beta may be None)."""
    scale, bias = _affine(bias, gamma, beta, mean, var, eps)
    weight = weight * scale.to(weight.dtype).view(-1, 1, 1, 1)
    return weight, bias.to(weight.dtype)


def _conv_bn_affine(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """(scale, bias) per output channel: ``bn(conv(x)) == conv_no_bias(x) * scale + bias``."""
    return _affine(conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps)


def _affine(bias, gamma, beta, mean, var, eps: float) -> tuple[Tensor, Tensor]:
    gamma = gamma if gamma is not None else torch.ones_like(var)
    beta = beta if beta is not None else torch.zeros_like(var)
    scale = gamma * torch.rsqrt(var + eps)
    bias = bias if bias is not None else torch.zeros_like(mean)
    return scale, (bias - mean) * scale + beta


def _cast(tensors: tuple[Tensor, ...], dtype: torch.dtype | None) -> tuple[Tensor, ...]:
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def _fold_when_traced(conv: nn.Conv2d, padding: list[int], x: Tensor) -> bool:
    """Under torch.compile, whether to fold the BN into the weight (a pass over the weight at
    every call: the graph cannot keep a fold) rather than apply it to the conv's output (a
    pass over the output, which inductor fuses with the activation): where the weight has no
    more values than the output. Measured (torchvision ResNet-50, AMD EPYC, 2 threads, batch
    1, channels_last): folding every conv, compiled converted 46.9 ms against 30.2 ms for
    the converted model in eager."""
    n, _, h, w = x.shape
    out_pixels = 1
    for size, k, s, p, d in zip((h, w), conv.kernel_size, conv.stride, padding, conv.dilation,
                                strict=True):  # fmt: skip
        out_pixels *= (size + 2 * p - d * (k - 1) - 1) // s + 1
    return conv.weight.numel() <= n * out_pixels * conv.out_channels


class TVMConv2dBN(nn.Module):
    """``act(bn(conv(x)))`` for an eval-mode ``bn``, one ``tvm_gemm.conv2d_bias_relu`` call.

    ``activation``: "relu", "relu6", "hardswish", "silu", "leaky_relu" (or "leaky_relu_0.1":
    another slope), "sigmoid", "hardsigmoid" or "none" (True / False: relu / none).
    """

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, activation: str | bool) -> None:
        super().__init__()
        padding = conv_padding(conv)
        if padding is None:
            raise ValueError(
                f"TVMConv2dBN: padding={conv.padding!r}, padding_mode={conv.padding_mode!r} "
                "is not supported (zero padding, symmetric only)"
            )
        # Plain attributes, not submodules: the model owns (and saves) them.
        self.__dict__["sources"] = (conv, bn)
        if isinstance(activation, bool):
            activation = "relu" if activation else "none"
        torch_activation(activation)  # (a KeyError names an unknown one)
        self.activation = activation
        self.padding = list(padding)
        self.frozen = is_frozen_bn(bn)  # (eval-mode BN in training mode too: always folded)
        # the fold, while the six tensors stay as they were
        self._kept = KeptWeights("bn folds")

    @property
    def relu(self) -> bool:
        return self.activation == "relu"

    def _tensors(self) -> tuple[list[Tensor | None], bool]:
        """The conv's weight and bias and the BN's weight, bias, mean and variance (None where
        there is none), and whether all are plain parameters or buffers (else one is computed
        at each read, e.g. a parametrization's weight: a fresh tensor of version 0, possibly at
        the address of the last one, which no key can follow)."""
        conv, bn = self.sources
        try:  # read from the modules' own dicts: nn.Module.__getattr__ cost ~3 us for the six
            p, bb = conv._parameters, bn._buffers
            bp = bb if self.frozen else bn._parameters  # (a frozen BN's are buffers)
            found = [p["weight"], p["bias"], bp["weight"], bp["bias"]]
            return found + [bb["running_mean"], bb["running_var"]], True
        except KeyError:
            found = [conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var]
            return found, False

    def _weights(self, x: Tensor) -> tuple[Tensor, Tensor]:
        conv, bn = self.sources
        six, plain = self._tensors()
        tensors = [t for t in six if t is not None]
        if torch.compiler.is_dynamo_compiling():
            # Traced, the fold is part of the graph: dynamo cannot trace the version check
            # below (a graph break at every folded conv, an error under fullgraph=True), and
            # a kept fold would not see the weights change between calls of the graph.
            weight, bias = fold_conv_bn(conv, bn)
            return weight.contiguous(), bias.contiguous()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if grad and not (plain and gradient_keepable()):
            return fold_conv_bn(conv, bn)  # differentiable, every call
        # (and x's image: its size and memory format pick the route, hence the layout, e.g.
        # at 7x7 pixels, or channels_last; and the dtype autocast will run the op in)
        cast = autocast_dtype(x, conv.weight)
        image = (x.shape[1:], x.dtype, x.is_contiguous(), cast)

        def fold() -> tuple[Tensor, Tensor]:
            weight, bias = fold_conv_bn(conv, bn)
            seen = x
            if cast is not None:  # (the op's autocast kernel would cast the fold every call)
                weight, bias = weight.to(cast), bias.to(cast)
                seen = torch.empty_strided(x.shape, x.stride(), dtype=cast)  # (as the op sees x)
            # kept in the layout the op reads in place (the bf16 NHWC convs: channels_last)
            layout = weight_layout(seen, weight, conv.stride, self.padding, conv.dilation,
                                   conv.groups)  # fmt: skip
            return weight.contiguous(memory_format=layout), bias.contiguous()

        kept = self._kept.get(tensors, plain, image, fold)
        if grad:  # (the gradient of the layout copy is the fold's: no copy in the backward)
            return with_gradient(kept, six, lambda *t: _cast(_fold(*t, bn.eps), cast))
        return kept

    def refold(self) -> None:
        """Fold again at the next call (after a write through a numpy view made before the
        fold, which no check sees)."""
        self._kept.forget()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # (a module pickled before it had one)
        self.__dict__.setdefault("_kept", KeptWeights("bn folds"))

    def forward(self, x: Tensor) -> Tensor:
        conv, bn = self.sources
        if bn.training and not self.frozen:  # back to training: batch statistics, no fold
            y = bn(conv(x))
            # (a BN subclass, timm's BatchNormAct2d, applied the fused activation itself)
            if type(bn).forward is not nn.BatchNorm2d.forward:
                return y
            return torch_activation(self.activation)(y)
        unbatched = x.dim() == 3
        x4 = x.unsqueeze(0) if unbatched else x
        geometry = (list(conv.stride), self.padding, list(conv.dilation), conv.groups)
        if torch.compiler.is_dynamo_compiling() and not _fold_when_traced(conv, self.padding, x4):
            # (the BN and the activation after the conv op: one pointwise pass, see there)
            scale, bias = _conv_bn_affine(conv, bn)
            y = CONV_OP(x4, conv.weight, None, *geometry, False, "none")
            y = y * scale.view(-1, 1, 1).to(y.dtype) + bias.view(-1, 1, 1).to(y.dtype)
            y = torch_activation(self.activation)(y)
        else:
            weight, bias = self._weights(x4)
            y = CONV_OP(x4, weight, bias, *geometry, True, self.activation)
        return y.squeeze(0) if unbatched else y

    def extra_repr(self) -> str:
        conv, _ = self.sources
        return f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}, activation={self.activation!r}"
