"""``tune``: MetaSchedule tuning of the kernels for given shapes, or for a model's layers.

    python -m torch_tvm_gemm tune --op matmul --shapes 512x512x512,1024x1024x1024
    python -m torch_tvm_gemm tune --op linear --bias --activation relu --shapes 64x512x256
    python -m torch_tvm_gemm tune --model mypkg.models:make_mlp --input-shape 32,256

Shapes are MxNxK. Each kernel is tuned in a compile-worker process (this one never imports
the compiler; ``TVM_GEMM_BUILD_IN_PROCESS=1`` tunes here). The database persists in the
cache dir: an interrupted run resumes, a finished one is not repeated, and later builds of
the kernel use the kept result.
"""

from __future__ import annotations

import importlib
import math
import sys
import time

from torch_tvm_gemm.kernels.gemm import ACTIVATIONS, DTYPES, GemmSpec


def register(sub) -> None:
    p = sub.add_parser("tune", help="tune kernels with MetaSchedule (persistent database)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--shapes", help="MxNxK,MxNxK,... for --op")
    what.add_argument("--model", help="module:factory returning an nn.Module")
    p.add_argument("--op", default="matmul", choices=["matmul", "linear"])
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--bias", action="store_true", help="linear: with a bias")
    p.add_argument("--activation", default="none", choices=ACTIVATIONS, help="linear epilogue")
    p.add_argument("--input-shape", help="the model's example input shape, e.g. 32,256")
    p.add_argument("--trials", type=int, default=32, help="measured trials per kernel")
    p.add_argument("--time", type=float, default=600.0, help="seconds, all kernels together")
    p.add_argument("--space", default="hand", choices=["hand", "generic"])
    p.add_argument("--rpc-tracker", help="HOST:PORT of a TVM RPC tracker (measure remotely)")
    p.add_argument("--rpc-key", help="device key registered with the tracker")
    p.set_defaults(func=run)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"tune: bad shape {item!r}: expected MxNxK, e.g. 512x512x512")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def op_spec(op: str, n: int, k: int, m: int, args) -> tuple[GemmSpec, int | None]:
    """The kernel the op asks for at this shape (``ops.gemm_spec``), and K when symbolic."""
    from torch_tvm_gemm.ops import gemm_spec

    if op == "matmul":  # matmul compiles one kernel for every K
        return gemm_spec(args.dtype, m, n, k, "kn", static_k=False), k
    spec = gemm_spec(args.dtype, m, n, k, "nk", bias=args.bias, activation=args.activation)
    return spec, None


def model_jobs(args) -> list[tuple[str, GemmSpec, int, int | None]]:
    """(layer name, spec, M, K) for each Linear of the model on the example input."""
    import torch

    from torch_tvm_gemm.ops import gemm_spec

    if not args.input_shape:
        raise SystemExit("tune: --model needs --input-shape (e.g. 32,256)")
    module_name, _, factory = args.model.partition(":")
    model = getattr(importlib.import_module(module_name), factory or "model")()
    shape = [int(s) for s in args.input_shape.split(",")]
    seen: dict[str, tuple] = {}

    def hook(name):
        def record(module, inputs, _output):
            seen[name] = (module, tuple(inputs[0].shape))

        return record

    handles = [
        m.register_forward_hook(hook(name))
        for name, m in model.named_modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
    ]
    with torch.no_grad():
        model(torch.randn(*shape))
    for h in handles:
        h.remove()
    jobs = []
    for name, (module, in_shape) in seen.items():
        if isinstance(module, torch.nn.Conv2d):
            print(f"  {name}: Conv2d skipped (tuning covers the GEMM kernels only)")
            continue
        m = math.prod(in_shape[:-1])
        n, k, bias = module.out_features, module.in_features, module.bias is not None
        spec = gemm_spec(args.dtype, m, n, k, "nk", bias=bias)  # the kernel the call asks for
        jobs.append((name, spec, m, None))
    return jobs


def shape_jobs(args) -> list[tuple[str, GemmSpec, int, int | None]]:
    jobs = []
    for m, n, k in parse_shapes(args.shapes):
        spec, sym_k = op_spec(args.op, n, k, m, args)
        jobs.append((f"{args.op} {m}x{n}x{k}", spec, m, sym_k))
    return jobs


def parse_rpc(args) -> tuple[str, int, str] | None:
    if not args.rpc_tracker:
        return None
    host, _, port = args.rpc_tracker.rpartition(":")
    if not host or not port.isdigit() or not args.rpc_key:
        raise SystemExit("tune: --rpc-tracker wants HOST:PORT, and --rpc-key is needed with it")
    return host, int(port), args.rpc_key


def run(args) -> int:
    from torch_tvm_gemm import config
    from torch_tvm_gemm.runtime.build_worker import KernelBuildError
    from torch_tvm_gemm.runtime.tune_worker import tune

    jobs = model_jobs(args) if args.model else shape_jobs(args)
    rpc = parse_rpc(args)
    deadline = time.monotonic() + args.time
    kept = 0
    for name, spec, m, k in jobs:
        if spec.variant not in ("gemm", "rows"):
            print(f"{name}: M = {m}: the {spec.variant} kernel has no tuning space")
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"{name}: time budget spent, not tuned")
            continue
        try:
            res = tune(
                spec, m, k, trials=args.trials, time_budget_s=left, rpc=rpc, space=args.space
            )
        except KeyboardInterrupt:
            print(f"\n{name}: interrupted; what was measured is kept: run again to resume")
            return 130
        except KernelBuildError as err:
            print(f"{name}: {err}", file=sys.stderr)
            return 1
        kept += res.kept
        tuned = f"{res.tuned_gflops:.1f}" if res.tuned_gflops else "-"
        hand = f"{res.hand_gflops:.1f}" if res.hand_gflops else "-"
        print(
            f"{name}: {res.trials} trials ({res.new_trials} new), tuned {tuned} GFLOPS vs "
            f"hand {hand}: {'kept' if res.kept else 'not kept'} ({res.reason})"
        )
    print(f"{kept} tuned kernel(s) kept; database: {config.tuning_root()}")
    return 0
