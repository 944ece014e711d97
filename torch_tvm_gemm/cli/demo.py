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
    from torch_tvm_gemm.cache import kernels_dir

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
    ok = err < 1e-3
    print("demo", "OK" if ok else "FAILED")
    return 0 if ok else 1
