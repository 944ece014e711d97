"""Cold-cache costs of building kernels: in compile workers against in the calling process.

    python benchmarks/cold_build.py [--rounds 3]

Each figure comes from a fresh process with an empty cache dir; the modes alternate within a
round, so that a busy machine slows them alike. Measured:

- the first ``linear`` call of one kernel (the compiler's import included) and the calling
  process's RSS after it;
- the kernels of two models' first calls, built one after another as first use builds them
  (in process, then in one worker), and all at once with ``precompile_specs`` (one worker per
  core; the kernel list is the one the serial run asked for): the Linear layers of a
  BERT-base layer (QKV, attention output, FFN up with GELU, FFN down, each at M=128 and M=8:
  8 kernels), and the ResNet-50 bottleneck convs of ``bench-conv`` (12 layers).
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

FIRST_CALL = """
import json, sys, time, torch
import torch_tvm_gemm as tg
x, w, b = torch.randn(37, 96), torch.randn(80, 96), torch.randn(80)
start = time.perf_counter()
tg.linear(x, w, b, "relu")
seconds = time.perf_counter() - start
def rss_mb(pid="self"):
    status = open(f"/proc/{pid}/status").read().splitlines()
    return next(int(l.split()[1]) for l in status if l.startswith("VmRSS")) / 1024
from torch_tvm_gemm.runtime import build_worker
workers = sum(rss_mb(pid) for pid in build_worker.worker_pids())
print(json.dumps({"seconds": seconds, "rss_mb": rss_mb(), "worker_rss_mb": workers,
                  "tvm": "tvm" in sys.modules}))
"""

# A model's first calls; argv: mode ("serial" or "parallel"), the spec list file (written by
# the serial run, read by the parallel one).
MODEL = """
import json, pickle, sys, time, torch
import torch_tvm_gemm as tg
from torch_tvm_gemm.runtime import build_worker, cache
from torch_tvm_gemm.cli.bench_conv import RESNET50
from torch_tvm_gemm.runtime.precompile import precompile_specs

def bert():
    for m in (128, 8):
        for n, k, act in [(2304, 768, "none"), (768, 768, "none"), (3072, 768, "gelu"),
                          (768, 3072, "none")]:
            tg.linear(torch.randn(m, k), torch.randn(n, k), torch.randn(n), act)

def resnet50():
    for c, k, h, r in RESNET50:
        x, w = torch.randn(1, c, h, h), torch.randn(k, c, r, r)
        tg.conv2d_bias_relu(x, w, torch.randn(k), padding=r // 2)

workload, mode, spec_file = sys.argv[1:4]
asked = []
load_or_build = cache.load_or_build
cache.load_or_build = lambda spec: asked.append(spec) or load_or_build(spec)
start = time.perf_counter()
if mode == "parallel":
    with open(spec_file, "rb") as f:
        precompile_specs(pickle.load(f))
built_up_front = build_worker.build_count()
{"bert": bert, "resnet50": resnet50}[workload]()
seconds = time.perf_counter() - start
if mode == "serial":
    with open(spec_file, "wb") as f:
        pickle.dump(asked, f)
print(json.dumps({"seconds": seconds, "kernels": build_worker.build_count(),
                  "built_on_use": build_worker.build_count() - built_up_front}))
"""


def run(script: str, *args: str, in_process: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="tvm_gemm_bench_") as cache:
        env = {**os.environ, "TVM_GEMM_CACHE_DIR": cache, "TVM_GEMM_BUILD_IN_PROCESS": "0"}
        if in_process:
            env["TVM_GEMM_BUILD_IN_PROCESS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        out = subprocess.run(
            [sys.executable, "-c", script, *args],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
        ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    rows: dict[str, list[dict]] = {}
    specs = tempfile.mkdtemp(prefix="tvm_gemm_bench_specs_")
    for _ in range(rounds):
        runs = [
            ("first call, in process", FIRST_CALL, (), True),
            ("first call, worker", FIRST_CALL, (), False),
        ]
        for model in ("bert", "resnet50"):
            spec_file = os.path.join(specs, model)
            runs += [
                (f"{model}: in process, serial", MODEL, (model, "serial", spec_file), True),
                (f"{model}: 1 worker, serial", MODEL, (model, "serial", spec_file), False),
                (f"{model}: precompile_specs", MODEL, (model, "parallel", spec_file), False),
            ]
        for name, script, args, in_process in runs:
            rows.setdefault(name, []).append(run(script, *args, in_process=in_process))
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} usable cores, load average {os.getloadavg()[0]:.1f}, {rounds} rounds (median)")
    for name, results in rows.items():
        line = f"  {name:30s} {statistics.median(r['seconds'] for r in results):6.2f} s"
        if "kernels" in results[0]:
            line += f"   {results[0]['kernels']} kernels, {results[0]['built_on_use']} on first use"
        if "rss_mb" in results[0]:
            rss = statistics.median(r["rss_mb"] for r in results)
            worker = statistics.median(r["worker_rss_mb"] for r in results)
            line += f"   RSS after {rss:4.0f} MB (worker {worker:4.0f} MB)"
            line += f"   tvm imported: {results[0]['tvm']}"
        print(line)


if __name__ == "__main__":
    main()
