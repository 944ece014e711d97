"""Fuse a small CNN with ``torch_tvm_gemm.convert`` and check it against the original.

    python examples/cnn_fusion.py

Conv2d -> BatchNorm2d -> ReLU and Conv2d -> ReLU become one ``tvm_gemm.conv2d_bias_relu``
kernel each (BN folded into the conv), and the classifier's Linear layers become
``TVMLinear``; the script prints what was fused, the largest difference from the original
outputs, and (with timing) the time per batch before and after.
"""

from __future__ import annotations

import time

import torch

import torch_tvm_gemm as tg
from torch_tvm_gemm.cli.bench_conv import small_cnn


def time_per_call(fn, x: torch.Tensor, reps: int = 10) -> float:
    fn(x)  # warm up (and build / load kernels)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn(x)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


@torch.no_grad()
def main(timing: bool = True) -> int:
    torch.manual_seed(0)
    model = small_cnn()
    x = torch.randn(4, 3, 32, 32)
    expected = model(x)
    fused = tg.convert(model, inplace=False)  # a converted copy: keep the original to compare
    print(fused.conversion_summary)
    err = (fused(x) - expected).abs().max().item()
    print(f"max |fused - original| = {err:.2e}")
    if timing:
        before, after = time_per_call(model, x), time_per_call(fused, x)
        print(
            f"batch {x.shape[0]} 3x32x32: original {before * 1e3:.2f} ms, fused "
            f"{after * 1e3:.2f} ms ({before / after:.2f}x)"
        )
    ok = err < 1e-4 and len(fused.conversion_summary.fused) == 3
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
