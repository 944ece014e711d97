"""``TVMConv2dBiasReLU``: an ``nn.Conv2d`` computed with its activation by one TVM kernel."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .autocast import autocast_dtype
from .kept_weights import KeptWeights, gradient_keepable, with_gradient
from .ops.conv_ops import weight_layout

CONV_OP = torch.ops.tvm_gemm.conv2d_bias_relu


def conv_padding(conv: nn.Conv2d) -> tuple[int, int] | None:
    """The conv's padding as two ints, or None where the op cannot express it."""
    if conv.padding_mode != "zeros":
        return None
    if conv.padding == "valid":
        return (0, 0)
    if conv.padding == "same":  # symmetric only: total padding dilation * (k - 1) even
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True)]
        return None if any(t % 2 for t in total) else (total[0] // 2, total[1] // 2)
    return tuple(conv.padding)


class TVMConv2dBiasReLU(nn.Conv2d):
    """``nn.Conv2d`` (optionally followed by ``nn.ReLU``) computed by one TVM kernel.

    Build it with ``from_conv(conv, relu=True)`` (or ``activation="relu6"``, ``"hardswish"``,
    ``"silu"``, ``"leaky_relu"``, ``"leaky_relu_0.1"`` (another slope), ``"sigmoid"``,
    ``"hardsigmoid"``, ``"none"``, which
    replaces ``relu``): it shares ``conv``'s
    parameters, and its ``state_dict`` has the Conv2d's keys (``weight``, ``bias``), so
    checkpoints load both ways.
    Supports ``padding_mode="zeros"`` with int / tuple / "valid" / symmetric "same" padding.

    Where the op reads the weight in another memory format than the module's own (a
    channels_last input: ``conv_ops.weight_layout``), a copy in that format is kept while the
    weight is unchanged (``kept_weights.py``: every write through torch or ``.data``, and
    numpy views made after the copy, are seen; after writing through a numpy view made
    before it, call ``refold()``), rather than permuting the weight at every call.
    """

    def __init__(self, *args, relu: bool = True, activation: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.activation = _activation(relu, activation)
        self._op_padding = self._checked_padding()
        self._kept = KeptWeights("relaid conv weights")

    @property
    def relu(self) -> bool:
        """Whether the epilogue is ReLU (setting it chooses ReLU or none)."""
        return self.activation == "relu"

    @relu.setter
    def relu(self, value: bool) -> None:
        self.activation = "relu" if value else "none"

    def _checked_padding(self) -> tuple[int, int]:
        padding = conv_padding(self)
        if padding is None:
            raise ValueError(
                f"TVMConv2dBiasReLU: padding={self.padding!r}, padding_mode="
                f"{self.padding_mode!r} is not supported (zero padding, symmetric only)"
            )
        return padding

    @classmethod
    def from_conv(
        cls, conv: nn.Conv2d, relu: bool = True, activation: str | None = None
    ) -> TVMConv2dBiasReLU:
        """A TVMConv2dBiasReLU sharing ``conv``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name in (
            "in_channels",
            "out_channels",
            "kernel_size",
            "stride",
            "padding",
            "dilation",
            "transposed",
            "output_padding",
            "groups",
            "padding_mode",
        ):
            setattr(new, name, getattr(conv, name))
        new.weight, new.bias = conv.weight, conv.bias
        new.activation = _activation(relu, activation)
        new._op_padding = new._checked_padding()
        new._kept = KeptWeights("relaid conv weights")
        new.train(conv.training)
        return new

    def refold(self) -> None:
        """Copy the weight again at the next call (after a write through a numpy view made
        before the kept copy, which no check sees; as ``TVMConv2dBN.refold``)."""
        self._kept.forget()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # (a module pickled before it had one)
        self.__dict__.setdefault("_kept", KeptWeights("relaid conv weights"))

    def _op_weight(self, x: Tensor) -> Tensor:
        """The weight as the op reads it in place. Measured (VGG-11 converted, 224 x 224,
        batch 1, 2 threads, Intel Xeon): its channels_last region permuted the 3x3 weights at
        every call, 4.1 ms of the 70.6 ms forward."""
        weight = self.weight
        if torch.compiler.is_dynamo_compiling() or x.device.type != "cpu":
            return weight  # (a graph keeps no copy)
        grad = torch.is_grad_enabled() and weight.requires_grad
        if grad and not gradient_keepable():
            return weight  # (the op's own autograd, copying where it reads another layout)
        # (under autocast the op runs in another dtype: a copy is kept in it, as the op's
        # autocast kernel would cast a copy, not a leaf, at every call: VGG-11 at 64 x 64 in a
        # bf16 region, 4.8 ms of casts in a 7.7 ms forward)
        cast = autocast_dtype(x, weight)
        image = (x.shape[1:], x.dtype, x.is_contiguous(), cast)

        def relayout() -> tuple[Tensor]:
            # (the layout for x and the weight as the op will see them)
            seen, seen_w = x, weight
            if cast is not None:
                seen = torch.empty_strided(x.shape, x.stride(), dtype=cast)
                seen_w = torch.empty_strided(weight.shape, weight.stride(), dtype=cast)
            layout = weight_layout(seen, seen_w, self.stride, self._op_padding, self.dilation,
                                   self.groups)  # fmt: skip
            if weight.is_contiguous(memory_format=layout):
                return (weight,)  # read in place (under autocast, cast as any weight is)
            return (weight.to(cast or weight.dtype).contiguous(memory_format=layout),)

        # (a parametrization's weight is computed at each read: not plain, copied every call)
        plain = self._parameters.get("weight") is weight
        kept = self._kept.get([weight], plain, image, relayout)
        if grad and kept[0] is not weight:  # (the copy's gradient is the weight's)
            source_dtype = weight.dtype  # (the gradient of a cast, a layout copy: cast back)
            return with_gradient(kept, (weight,), vjp=lambda g: (g.to(source_dtype),))[0]
        return kept[0]

    def forward(self, x: Tensor) -> Tensor:
        unbatched = x.dim() == 3  # as nn.Conv2d: (C, H, W) is one image
        x = x.unsqueeze(0) if unbatched else x
        y = CONV_OP(
            x,
            self._op_weight(x),
            self.bias,
            list(self.stride),
            list(self._op_padding),
            list(self.dilation),
            self.groups,
            self.relu,
            self.activation,
        )
        return y.squeeze(0) if unbatched else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}"


def _activation(relu: bool, activation: str | None) -> str:
    from .kernels.conv2d import ACTIVATIONS, is_activation

    if activation is None:
        return "relu" if relu else "none"
    if not is_activation(activation):
        raise ValueError(
            f"TVMConv2dBiasReLU: activation must be one of {', '.join(ACTIVATIONS)} or "
            f"leaky_relu_<slope> (a slope >= 0 as Python prints it: leaky_relu_0.1), "
            f"got {activation!r}"
        )
    return activation
