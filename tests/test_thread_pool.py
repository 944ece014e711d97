"""CPU kernels run their parallel loops on torch's OpenMP pool (csrc/parallel_launch.cpp)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_close, randn

import torch_tvm_gemm as tg
from torch_tvm_gemm import _ext, config
from torch_tvm_gemm.runtime import loader

needs_ext = pytest.mark.skipif(_ext.load() is None, reason="C++ extension not built")


def _loaded_kernel_files() -> list[str]:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so")}
    root = str(config.kernels_dir())
    return sorted(p for p in paths if p.startswith(root))


def _ops_outputs() -> list[torch.Tensor]:
    """A packed GEMM, a gemv-shaped linear and a conv: each has a parallel loop."""
    a, b = randn(96, 200, seed=1), randn(200, 130, seed=2)
    x, w, bias = randn(4, 512, seed=3), randn(1024, 512, seed=4), randn(1024, seed=5)
    img, kern, kb = randn(2, 16, 13, 11, seed=6), randn(32, 16, 3, 3, seed=7), randn(32, seed=8)
    return [
        tg.matmul(a, b),
        tg.linear(x, w, bias, "relu"),
        tg.conv2d_bias_relu(img, kern, kb, padding=1),
    ]


@needs_ext
def test_loaded_cpu_kernels_launch_on_torch_pool():
    _ops_outputs()
    pools = {p: loader.parallel_launcher(p) for p in _loaded_kernel_files()}
    assert "torch" in pools.values(), pools
    assert "tvm" not in pools.values(), pools


def test_results_do_not_depend_on_thread_count():
    """Each output element is summed by one task in one order, so any split of the tasks over
    threads (3 threads on 2 cores: an uneven split) gives the same bits."""
    saved = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_ops_outputs())
    finally:
        torch.set_num_threads(saved)
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert torch.equal(got, want)
    a, b = randn(96, 200, seed=1), randn(200, 130, seed=2)
    assert_close(results[0][0], a.double() @ b.double(), k=200)


@needs_ext
def test_tvm_pool_opt_out_gives_the_same_results(tmp_path):
    """TVM_GEMM_TVM_POOL=1 keeps TVM's own pool; the numbers are the same either way."""
    script = (
        "import torch, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_thread_pool import _ops_outputs, _loaded_kernel_files\n"
        "from torch_tvm_gemm.runtime import loader\n"
        "torch.save(_ops_outputs(), sys.argv[1])\n"
        "print(sorted({loader.parallel_launcher(p) for p in _loaded_kernel_files()} - {None}))\n"
    )
    env = dict(os.environ, TVM_GEMM_TVM_POOL="1")
    out = tmp_path / "out.pt"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "['tvm']"
    for got, want in zip(torch.load(out), _ops_outputs(), strict=True):
        assert torch.equal(got, want)
