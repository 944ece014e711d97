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


def test_cli_bench_inference_smoke(tmp_path):
    """One M of the sweep, the attention rows and the FMA probe: the command runs and every
    row has a ratio against torch and a fraction of the measured peak."""
    import json

    from torch_tvm_gemm.__main__ import main

    out = tmp_path / "inference.json"
    args = ["bench-inference", "--models", "bert", "--m", "3", "--act", "relu", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["peak_gflops"] > 0
    ops = {r["op"] for r in result["rows"]}
    assert {"linear_relu", "bmm_qk", "bmm_pv"} <= ops
    assert all(r["ratio"] > 0 and 0 < r["tvm_peak_fraction"] for r in result["rows"])


def test_cli_bench_inference_bf16(tmp_path):
    """--dtype bfloat16: the rows run bf16 operands (no fraction of the fp32 FMA peak)."""
    import json

    from torch_tvm_gemm.__main__ import main

    out = tmp_path / "inference.json"
    args = ["bench-inference", "--m", "40", "--act", "relu", "--shapes", "768x768"]
    assert (
        main([*args, "--no-attention", "--dtype", "bfloat16", "--repeats", "1", "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and len(result["rows"]) == 1
    assert all(r["ratio"] > 0 and r["tvm_peak_fraction"] is None for r in result["rows"])
