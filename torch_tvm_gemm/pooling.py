"""``ChannelsLastMaxPool2d``: ``nn.MaxPool2d`` that pools an NCHW CPU input through a
channels_last copy. ``convert`` puts every ``nn.MaxPool2d`` of a model on it.

torch's CPU max pool over contiguous NCHW is scalar code, one output at a time; over
channels_last it is vectorised along the channels. ResNet's stem pool (64 channels, 112x112,
3x3 stride 2) took 3.2 ms at batch 1 NCHW against 0.17 ms channels_last: 8% of a converted
ResNet-50's forward, as much as the gap between our convs and oneDNN's. With the copy in and
the copy of the result back to NCHW: 0.71 ms (4.4x), 3.4-7.9x at other sizes with 32 to 512
channels; 0.8x with 3 channels (2 threads, AMD EPYC Zen 5). The result is the same values
in the layout ``nn.MaxPool2d`` gives; a channels_last input pools as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MIN_CHANNELS = 16  # fewer: the copies cost more than the vectorised pool saves


class ChannelsLastMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d``, pooling a contiguous NCHW CPU batch of ``MIN_CHANNELS`` channels or
    more on a channels_last copy (same values, same NCHW result)."""

    def forward(self, x: Tensor) -> Tensor:
        if not _pools_faster_channels_last(x) or self.return_indices:
            return super().forward(x)
        y = F.max_pool2d(
            x.contiguous(memory_format=torch.channels_last),
            self.kernel_size,
            self.stride,
            self.padding,
            self.dilation,
            ceil_mode=self.ceil_mode,
        )
        return y.contiguous()


def _pools_faster_channels_last(x: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 4
        and x.shape[1] >= MIN_CHANNELS
        and x.is_contiguous()
        and not x.is_contiguous(memory_format=torch.channels_last)
    )


def swap_max_pools(model: nn.Module) -> list[str]:
    """Put every ``nn.MaxPool2d`` of ``model`` (exactly that class) on
    ``ChannelsLastMaxPool2d``, in place: the same objects, hyperparameters and state (a pool
    has no parameters); returns their qualified names."""
    swapped = []
    for fqn, module in model.named_modules():
        if type(module) is nn.MaxPool2d:
            module.__class__ = ChannelsLastMaxPool2d
            swapped.append(fqn)
    return swapped


__all__ = ["ChannelsLastMaxPool2d", "swap_max_pools"]
