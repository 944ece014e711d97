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
