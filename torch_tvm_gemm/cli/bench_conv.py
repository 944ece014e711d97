"""``bench-conv``: conv2d+bias+relu on ResNet-50 layer shapes vs ``F.relu(F.conv2d)``.

Both sides are timed in the same run, alternating, best of several rounds; the ratio is
torch time / TVM time (above 1: TVM faster). Also times a small CNN end to end before and
after ``torch_tvm_gemm.convert``. Kernel builds happen in a warm-up call and are not timed.
"""

from __future__ import annotations

import json
import math

from ..measure import keep_freed_memory, mean_call, time_interleaved
from ..tools.workloads import RESNET50_CONVS as RESNET50


def register(sub) -> None:
    p = sub.add_parser("bench-conv", help="conv2d+bias+relu vs F.relu(F.conv2d), ResNet-50 shapes")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=None, help="torch and TVM threads")
    p.add_argument("--reps", type=int, default=5, help="calls per timing round")
    p.add_argument("--rounds", type=int, default=7, help="timing rounds (best is kept)")
    p.add_argument("--quick", action="store_true", help="only the 3x3 layers")
    p.add_argument("--no-cnn", action="store_true", help="skip the small-CNN timing")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=run)


def compare(ours, theirs, reps: int, rounds: int) -> tuple[float, float]:
    """(our time, their time) per call: interleaved rounds of ``reps`` back-to-back calls
    each, after a warm-up call (kernel builds, loads, caches); the best round of each."""
    t_ours, t_theirs = time_interleaved(
        [ours, theirs], rounds, sample=lambda fn: mean_call(fn, reps)
    )
    return t_ours, t_theirs


def small_cnn():
    """A small CNN (conv-BN-ReLU blocks, a conv-ReLU, a linear head) in eval mode."""
    import torch
    from torch import nn

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    model = nn.Sequential(
        *block(3, 16),
        nn.MaxPool2d(2),
        *block(16, 32),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    for m in model.modules():  # non-trivial BN statistics, as after training
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    import torch_tvm_gemm as tg

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not keep_freed_memory():
        print("note: could not tune the allocator (not glibc): expect allocation noise")
    layers = [row for row in RESNET50 if row[3] == 3] if args.quick else RESNET50
    print(f"conv2d+bias+relu, float32, {torch.get_num_threads()} threads; ratio = torch / TVM")
    print(f"{'N':>2} {'C':>5} {'K':>5} {'HxW':>7} {'RxS':>4} {'TVM ms':>8} {'torch ms':>9} ratio")
    rows = []
    with torch.no_grad():
        for n in args.batch:
            for c, k, hw, r in layers:
                x, w = torch.randn(n, c, hw, hw), torch.randn(k, c, r, r) * 0.05
                b, pad = torch.randn(k), r // 2
                t_tvm, t_torch = compare(
                    lambda x=x, w=w, b=b, p=pad: tg.conv2d_bias_relu(x, w, b, 1, p),
                    lambda x=x, w=w, b=b, p=pad: F.relu(F.conv2d(x, w, b, 1, p)),
                    args.reps,
                    args.rounds,
                )
                ratio = t_torch / t_tvm
                rows.append(
                    {"n": n, "c": c, "k": k, "hw": hw, "kernel": r, "tvm_s": t_tvm}
                    | {"torch_s": t_torch, "ratio": ratio}
                )
                print(
                    f"{n:>2} {c:>5} {k:>5} {f'{hw}x{hw}':>7} {f'{r}x{r}':>4} "
                    f"{t_tvm * 1e3:8.3f} {t_torch * 1e3:9.3f} {ratio:5.2f}"
                )
    ratios = [row["ratio"] for row in rows]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"geometric mean ratio {geomean:.2f}, min {min(ratios):.2f} (target >= 1.0, min >= 0.7)")
    result = {"threads": torch.get_num_threads(), "layers": rows, "geomean": geomean}

    if not args.no_cnn:
        model, x = small_cnn(), torch.randn(8, 3, 64, 64)
        with torch.no_grad():
            fused = tg.convert(model, inplace=False)
            t_fused, t_orig = compare(lambda: fused(x), lambda: model(x), args.reps, args.rounds)
            err = (fused(x) - model(x)).abs().max().item()
        print(
            f"small CNN, batch 8 3x64x64: original {t_orig * 1e3:.2f} ms, fused "
            f"{t_fused * 1e3:.2f} ms ({t_orig / t_fused:.2f}x), max |diff| {err:.1e}"
        )
        result["cnn"] = {"original_s": t_orig, "fused_s": t_fused, "max_abs_diff": err}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
