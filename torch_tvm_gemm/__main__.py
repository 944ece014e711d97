"""The command line: ``python -m torch_tvm_gemm <command> ...`` (``--help`` lists them).

Each command lives in its own module with ``register(subparsers)``, which adds its parser
and sets ``func`` (called with the parsed args; returns the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that each define one or more commands (imported lazily: only the one asked for
# does any work).
COMMAND_MODULES = [
    "torch_tvm_gemm.cli.demo",
    "torch_tvm_gemm.cli.bench_overhead",
    "torch_tvm_gemm.cli.bench",
    "torch_tvm_gemm.cli.bench_inference",
    "torch_tvm_gemm.cli.bench_conv",
    "torch_tvm_gemm.cli.bench_models",
    "torch_tvm_gemm.cli.compile",
    "torch_tvm_gemm.cli.ladder",
    "torch_tvm_gemm.cli.tune",
    "torch_tvm_gemm.cli.cache",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torch_tvm_gemm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
