"""Swap the nn.Linear layers of an MLP and of a transformer encoder block for TVM kernels,
check the outputs against the originals, and train a few steps to see the loss fall.

    python examples/swap_models.py
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import torch_tvm_gemm as tg


def check_swap(name: str, model: nn.Module, x: torch.Tensor) -> float:
    """Swap a copy of ``model``; return the largest output difference from the original.

    Compared in training mode (the models have no dropout): in eval mode under no_grad,
    nn.TransformerEncoderLayer takes a fused fast path that reads the linear weights
    directly and would not run our modules at all.
    """
    swapped = tg.swap_linear(copy.deepcopy(model))
    diff = (swapped(x) - model(x)).abs().max().item()
    n = sum(isinstance(m, tg.TVMLinear) for m in swapped.modules())
    print(f"{name}: {n} linears swapped, max |output diff| = {diff:.2e}")
    return diff


def train(model: nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int = 20) -> list[float]:
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> dict:
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)
    )
    encoder = nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
    )
    x_mlp, x_seq = torch.randn(32, 64), torch.randn(4, 12, 64)

    diffs = {
        "mlp": check_swap("MLP", mlp, x_mlp),
        "encoder": check_swap("TransformerEncoderLayer", encoder, x_seq),
    }

    tg.swap_linear(mlp)
    losses = train(mlp, x_mlp, torch.randn(32, 10))
    print(
        f"MLP training with TVM linears: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps"
    )
    tg.swap_linear(encoder)
    enc_losses = train(encoder, x_seq, torch.randn(4, 12, 64))
    print(f"encoder training with TVM linears: loss {enc_losses[0]:.4f} -> {enc_losses[-1]:.4f}")
    return {"diffs": diffs, "losses": losses, "encoder_losses": enc_losses}


if __name__ == "__main__":
    main()
