"""``demo``: the ops and the model swap on small inputs, checked against PyTorch."""

from __future__ import annotations

import time


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the ops and a swapped model, compare with PyTorch")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(func=run)


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    import torch_tvm_gemm as tg
    from torch_tvm_gemm.config import kernels_dir

    dev = args.device
    print(f"torch_tvm_gemm demo on {dev}; kernel cache: {kernels_dir()}")
    a, b = torch.randn(127, 256, device=dev), torch.randn(256, 96, device=dev)
    start = time.perf_counter()
    c = tg.matmul(a, b)
    first = time.perf_counter() - start
    err = (c - a @ b).abs().max().item()
    print(
        f"matmul (127x256) @ (256x96): max |diff| vs torch.matmul = {err:.2e}  "
        f"(first call incl. build/load {first:.2f} s)"
    )

    x, w, bias = (
        torch.randn(33, 256, device=dev),
        torch.randn(512, 256, device=dev),
        torch.randn(512, device=dev),
    )
    for act, ref in [("relu", F.relu), ("gelu", F.gelu)]:
        y = tg.linear(x, w, bias, act)
        err = (y - ref(F.linear(x, w, bias))).abs().max().item()
        print(f"linear + bias + {act}: max |diff| vs F.{act}(F.linear) = {err:.2e}")

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).to(dev)
    ref = model(x)
    tg.swap_linear(model)
    print("swapped model:", model)
    err = (model(x) - ref).abs().max().item()
    print(f"swapped MLP: max |diff| vs the original = {err:.2e}")
    errors = [err]

    if dev == "cpu":  # the CUDA conv needs a kernel pack or nvcc: see the README
        errors.append(_conv_demo(torch, F, tg))
    ok = max(errors) < 1e-3
    print("demo", "OK" if ok else "FAILED")
    return 0 if ok else 1


def _conv_demo(torch, F, tg) -> float:
    """The fused conv op, then ``convert`` on a small CNN (conv-BN-ReLU blocks, a Linear)."""
    from torch import nn

    x, w, b = torch.randn(2, 8, 20, 20), torch.randn(16, 8, 3, 3), torch.randn(16)
    y = tg.conv2d_bias_relu(x, w, b, padding=1)
    err = (y - F.relu(F.conv2d(x, w, b, padding=1))).abs().max().item()
    print(f"conv2d + bias + relu: max |diff| vs F.relu(F.conv2d) = {err:.2e}")
    cnn = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).eval()
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref = cnn(images)
        converted = tg.convert(cnn, inplace=False)
        cnn_err = (converted(images) - ref).abs().max().item()
    print(f"convert(small CNN): {converted.conversion_summary.line()}")
    print(f"converted CNN: max |diff| vs the original = {cnn_err:.2e}")
    return max(err, cnn_err)
