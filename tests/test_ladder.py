"""The optimization ladder: every step is correct at odd sizes; the CLI writes its files."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_close, randn

from torch_tvm_gemm.__main__ import main
from torch_tvm_gemm.tools import ladder

pytestmark = pytest.mark.slow  # every ladder step compiled and tuned: not in the fast lane


@pytest.mark.parametrize("step", ladder.HAND_STEPS, ids=lambda s: s.name)
@pytest.mark.parametrize(("m", "n", "k"), [(37, 70, 33), (1, 129, 7)])
def test_step_correct_at_odd_sizes(step, m, n, k):
    fn = ladder.compile_step(step, ladder.ladder_spec(n, k))["main"]
    a, b = randn(m, k), randn(k, n)
    out = torch.full((m, n), float("nan"))
    fn(a, b, out)
    assert_close(out, a @ b, k)


def test_steps_follow_the_classic_order():
    names = [s.name for s in ladder.HAND_STEPS]
    assert names == ["naive", "tiled", "packed", "vectorized", "parallel", "unrolled"]


def test_ladder_cli_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "ladder"
    rc = main(
        ["ladder", "--sizes", "33,48", "--tune-trials", "2", "--tune-time", "120"]
        + ["--out", str(out)]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| step |" in printed and "x torch" in printed
    report = json.loads((out / "ladder.json").read_text())
    steps = [row["step"] for row in report["steps"]]
    assert steps == [s.name for s in ladder.HAND_STEPS] + ["tuned"]
    for row in report["steps"]:
        for cell in row["sizes"].values():
            assert cell["gflops"] and cell["gflops"] > 0, (row["step"], cell)
            assert cell["vs_torch"] > 0
    assert set(report["torch_gflops"]) == {"33", "48"}
    assert (out / "ladder.png").read_bytes()[:4] == b"\x89PNG"
