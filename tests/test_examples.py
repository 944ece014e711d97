"""Every example runs, and shows what it claims."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_swap_models_example():
    result = load("swap_models").main()
    assert result["diffs"]["mlp"] < 1e-4 and result["diffs"]["encoder"] < 1e-4
    assert result["losses"][-1] < 0.7 * result["losses"][0]
    assert result["encoder_losses"][-1] < result["encoder_losses"][0]


def test_cli_demo_and_quick_bench(tmp_path):
    from torch_tvm_gemm.__main__ import main

    assert main(["demo"]) == 0
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--repeats", "2", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and all(r["ratio"] > 0 for r in rows)
