"""Cold start of a converted model: kernels built layer by layer on first use, or up front by
``torch_tvm_gemm.precompile`` in 1 or 2 parallel compile workers.

    python benchmarks/cold_start.py [--rounds 3] [--models bert,resnet]

Models (transformers, random weights, eval mode, converted with ``torch_tvm_gemm.convert``):

- ``bert``: ``BertModel``, 2 layers, hidden 256, 4 heads, FFN 1024, one sequence of 32 tokens;
- ``resnet``: ``ResNetModel``, bottleneck blocks, one per stage, widths 64-512 (stem 32), one
  64x64 image.

Each run is a fresh process on an empty cache dir; the modes alternate within a round so
that a busy machine slows them alike. Per mode: the seconds from the converted model to the
end of its first forward (``precompile`` included; median, range, and the speed-up over the
layer-by-layer build in a compile worker), how many kernels were built and how many of them
by the forward itself, and the calling process's RSS afterwards (current and peak: the
compiler lives in the worker processes, except in the ``TVM_GEMM_BUILD_IN_PROCESS=1`` row).
The header gives the usable cores and the load average before and after: on a shared
machine, read ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# argv: model ("bert" or "resnet"), mode ("lazy", "inproc": lazy with the builds in this
# process, or the precompile worker count).
CHILD = """
import json, sys, time, torch
import torch_tvm_gemm as tg
from torch_tvm_gemm.runtime import build_worker

def bert():
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=1024,
                        max_position_embeddings=64)
    return BertModel(config).eval(), (torch.randint(0, 1000, (1, 32)),)

def resnet():
    from transformers import ResNetConfig, ResNetModel
    config = ResNetConfig(embedding_size=32, hidden_sizes=[64, 128, 256, 512],
                          depths=[1, 1, 1, 1], layer_type="bottleneck")
    return ResNetModel(config).eval(), (torch.randn(1, 3, 64, 64),)

def rss_mb(field):
    status = open("/proc/self/status").read().splitlines()
    return next(int(l.split()[1]) for l in status if l.startswith(field)) / 1024

which, mode = sys.argv[1:3]
torch.manual_seed(0)
model, inputs = {"bert": bert, "resnet": resnet}[which]()
tg.convert(model)
start = time.perf_counter()
planned = None
if mode not in ("lazy", "inproc"):
    planned = tg.precompile(model, *inputs, workers=int(mode))
before_forward = build_worker.build_count()
with torch.no_grad():
    model(*inputs)
seconds = time.perf_counter() - start
print(json.dumps({
    "seconds": seconds,
    "precompile_s": planned.seconds if planned else 0.0,
    "built": build_worker.build_count(),
    "built_by_forward": build_worker.build_count() - before_forward,
    "rss_mb": rss_mb("VmRSS"), "peak_rss_mb": rss_mb("VmHWM"),
    "tvm_imported": "tvm" in sys.modules,
}))
"""

MODES = [
    ("inproc", "layer by layer, in process"),
    ("lazy", "layer by layer (first use)"),
    ("1", "precompile, 1 worker"),
    ("2", "precompile, 2 workers"),
]


def run(model: str, mode: str) -> dict:
    """One cold start in a fresh process on an empty cache dir."""
    with tempfile.TemporaryDirectory(prefix="tvm_gemm_cold_") as cache:
        env = {**os.environ, "TVM_GEMM_CACHE_DIR": cache}
        for name in ("TVM_GEMM_BUILD_IN_PROCESS", "TVM_GEMM_NO_COMPILE", "TVM_GEMM_BUILD_WORKERS"):
            env.pop(name, None)
        if mode == "inproc":
            env["TVM_GEMM_BUILD_IN_PROCESS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, model, mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    if proc.returncode != 0:
        raise SystemExit(f"cold_start: {model} ({mode}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="bert,resnet")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    load_before = os.getloadavg()
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for model in models:
            for mode, _label in MODES:
                rows.setdefault((model, mode), []).append(run(model, mode))
    load_after = os.getloadavg()
    cores = len(os.sched_getaffinity(0))
    print(
        f"{cores} usable cores; load average {load_before[0]:.1f} before, {load_after[0]:.1f} "
        f"after; {args.rounds} rounds (median)"
    )
    for model in models:
        lazy = statistics.median(r["seconds"] for r in rows[(model, "lazy")])
        for mode, label in MODES:
            results = rows[(model, mode)]
            times = [r["seconds"] for r in results]
            seconds = statistics.median(times)
            first = results[0]
            print(
                f"  {model:6s} {label:28s} {seconds:5.1f} s ({min(times):4.1f}-{max(times):4.1f},"
                f" {lazy / seconds:4.2f}x)"
                f"  {first['built']:2d} kernels, {first['built_by_forward']:2d} built by the forward"
                f"  RSS {statistics.median(r['rss_mb'] for r in results):4.0f} MB"
                f" (peak {statistics.median(r['peak_rss_mb'] for r in results):4.0f})"
                f"  tvm imported: {any(r['tvm_imported'] for r in results)}"
            )


if __name__ == "__main__":
    main()
