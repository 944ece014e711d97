"""Planning mode (``ops.planning``) and ``precompile(model, *example_inputs)``.

Planning runs build nothing, so most tests here are cheap; the one that builds does it in a
child process on a cold cache of its own, where it also proves that the caller never imports
the compiler and that a forward after ``precompile`` builds nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import randn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm import ops
from torch_tvm_gemm.ops import conv_ops, gemm_ops
from torch_tvm_gemm.runtime import build_worker, table
from torch_tvm_gemm.schedules import cpu_conv2d
from torch_tvm_gemm.schedules.cpu_conv2d import pointwise_as_gemm

ROOT = Path(__file__).resolve().parents[1]
lin = torch.ops.tvm_gemm.linear
mm = torch.ops.tvm_gemm.matmul
conv = torch.ops.tvm_gemm.conv2d_bias_relu


def _planned(fn, **options):
    with ops.planning(**options) as found:
        out = fn()
    return found.specs, out


# --- planning -------------------------------------------------------------------------------


def test_planning_records_each_kernel_once_and_builds_nothing():
    x, w, b = randn(4, 192), randn(80, 192), randn(80)
    a, bm = randn(40, 24), randn(24, 9)
    loaded = dict(table._table)
    builds = build_worker.build_count()

    def run():
        return lin(x, w, b, "relu"), mm(a, bm), lin(x, w, b, "relu"), lin(randn(40, 192), w)

    specs, (y, c, _, _) = _planned(run)
    assert specs == [
        ops.gemm_spec("float32", 4, 80, 192, "nk", bias=True, activation="relu"),
        ops.gemm_spec("float32", 40, 9, 24, "kn", static_k=False),
        ops.gemm_spec("float32", 40, 80, 192, "nk"),
    ]
    assert specs[0].variant != specs[2].variant  # the M of each call decides
    torch.testing.assert_close(y, torch.relu(x @ w.T + b))  # torch computed them
    torch.testing.assert_close(c, a @ bm)
    assert build_worker.build_count() == builds and dict(table._table) == loaded


def test_planning_covers_the_backward():
    x = randn(6, 32).requires_grad_()
    w = randn(48, 32).requires_grad_()

    def run():
        lin(x, w, None, "gelu").sum().backward()

    specs, _ = _planned(run)
    assert specs == [
        ops.gemm_spec("float32", 6, 48, 32, "nk", activation="gelu"),
        ops.gemm_spec("float32", 6, 48, 32, "nk"),  # the backward's pre-activation
        ops.gemm_spec("float32", 6, 32, 48, "kn"),  # dX = dZ @ W: W read in place, K = 48
        ops.gemm_spec("float32", 48, 32, 6, "kn", static_k=False),  # dW = dZ^T @ X
    ]
    assert x.grad is not None and w.grad is not None


def test_a_transposed_b_is_read_with_a_static_k():
    """``x @ w.T`` reads w's rows in place ("nk") with K in the kernel, as a Linear: the
    kernels that read a (N, K) B by rows (dot, gemv) need a static K (with a symbolic one
    they ran at 0.01-0.2x torch.matmul); ``a @ b`` keeps one kernel for every K."""
    x, w, a, b = randn(8, 768), randn(3072, 768), randn(8, 768), randn(768, 3072)
    specs, (y, z) = _planned(lambda: (mm(x, w.t()), mm(a, b)))
    assert specs == [
        ops.gemm_spec("float32", 8, 3072, 768, "nk"),
        ops.gemm_spec("float32", 8, 3072, 768, "kn", static_k=False),
    ]
    assert specs[0].k == 768 and specs[0].variant == "dot" and specs[1].k is None
    torch.testing.assert_close(y, x @ w.T)
    torch.testing.assert_close(z, a @ b)


def test_planning_for_cuda_on_cpu_tensors():
    a, b = randn(3, 7, 40), randn(3, 40, 24)  # batched: one kernel per entry on CUDA
    cpu, _ = _planned(lambda: mm(a, b))
    cuda, _ = _planned(lambda: mm(a, b), device="cuda")
    assert cpu == [ops.gemm_spec("float32", 7, 24, 40, "kn", static_k=False, batched=True)]
    assert cuda == [ops.gemm_spec("float32", 7, 24, 40, "kn", device="cuda")]
    assert cuda[0].k == 40  # CUDA kernels fix K
    (tf32,), _ = _planned(lambda: mm(a[0], b[0]), device="cuda", tf32=True)
    assert tf32.tf32 and tf32.device == "cuda"


def test_planning_convs_as_the_impl_of_the_planned_device_runs_them():
    x3, w3, b3 = randn(2, 8, 6, 6), randn(16, 8, 3, 3), randn(16)
    x1, w1 = randn(2, 8, 16, 16), randn(16, 8, 1, 1)
    geometry = ([1, 1], [1, 1], [1, 1], 1, True)
    spec3 = ops.conv2d_spec(x3, w3, b3, *geometry)
    (found,), y = _planned(lambda: conv(x3, w3, b3, *geometry))
    assert found == spec3
    torch.testing.assert_close(y, torch.relu(nn.functional.conv2d(x3, w3, b3, padding=1)))
    pointwise = ([1, 1], [0, 0], [1, 1], 1, False)
    specs, _ = _planned(lambda: conv(x1, w1, None, *pointwise))
    if pointwise_as_gemm(ops.conv2d_spec(x1, w1, None, *pointwise)):  # GEMMs, one per image
        assert specs == [ops.gemm_spec("float32", 16, 256, 8, "kn", bias_axis="m")]
    else:
        assert specs == [ops.conv2d_spec(x1, w1, None, *pointwise)]
    cuda, _ = _planned(lambda: conv(x1, w1, None, *pointwise), device="cuda")
    assert cuda == [ops.conv2d_spec(x1, w1, None, *pointwise, device="cuda")]


@pytest.mark.parametrize("size", [(17, 18), (9, 10)])
def test_planning_a_strided_1x1_conv_records_what_the_impl_asks_for(monkeypatch, size):
    """A strided 1x1 conv runs as the stride-1 conv of its subsampled input, or at 5x5
    output pixels as a GEMM over its patches: planning records exactly the kernels that
    call then asks for."""
    monkeypatch.setattr(cpu_conv2d, "PATCHES_GEMM_MIN_WORK", 0)  # (a small conv takes it)
    monkeypatch.setattr(conv_ops, "_GEOMETRIES", {})
    x, w, b = randn(2, 8, *size), randn(16, 8, 1, 1), randn(16)
    args = (x, w, b, [2, 2], [0, 0], [1, 1], 1, True, None)
    specs, y = _planned(lambda: conv(*args))
    torch.testing.assert_close(y, torch.relu(nn.functional.conv2d(x, w, b, 2)))
    asked = []
    for module in (conv_ops, gemm_ops):  # (the conv kernels, the GEMM kernels)
        get_kernel = module.get_kernel
        monkeypatch.setattr(module, "get_kernel", lambda s, f=get_kernel: asked.append(s) or f(s))
    conv(*args)
    assert specs == asked and len(asked) == 1
    out_h, out_w = (-(-side // 2) for side in size)
    if out_h * out_w > 64:
        assert asked[0].stride == (1, 1) and (asked[0].h, asked[0].w) == (out_h, out_w)
    else:  # one GEMM: (N * OH * OW, C) @ W^T
        assert not hasattr(asked[0], "r") and (asked[0].n, asked[0].k) == (16, 8)


def test_planning_without_compute_leaves_results_alone():
    x, w = randn(5, 16), randn(8, 16)
    specs, y = _planned(lambda: lin(x, w), compute=False)
    assert len(specs) == 1 and y.shape == (5, 8)


@pytest.mark.parametrize("path", ["cpp", "python"])
def test_planning_forces_the_python_impls_and_restores_the_choice(path):
    if path == "cpp" and tg._ext.load() is None:
        pytest.skip("C++ extension not built")
    previous = ops.use_impl(path)
    try:
        with ops.planning():
            assert ops.impl_path() == "python"
        assert ops.impl_path() == path
        with pytest.raises(KeyError), ops.planning():
            raise KeyError("the workload failed")
        assert ops.impl_path() == path and ops.plan.active() is None
    finally:
        ops.use_impl(previous)


def test_planning_rejects_bad_use():
    with pytest.raises(ValueError, match="tvm_gemm.planning: device"):
        with ops.planning(device="tpu"):
            pass
    with ops.planning(), pytest.raises(RuntimeError, match="does not nest"):
        with ops.planning():
            pass
    assert ops.plan.active() is None


# --- precompile: errors and edge cases (nothing to build) ------------------------------------


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = tg.TVMLinear(8, 4)

    def forward(self, x):
        return self.fc(x).view(3, -1, 7)  # cannot reshape 2x4 into (3, ?, 7)


def test_a_model_that_raises_names_precompile():
    with pytest.raises(RuntimeError, match="shape") as info:
        tg.precompile(Broken(), torch.randn(2, 8))
    if sys.version_info >= (3, 11):
        assert "torch_tvm_gemm.precompile" in "".join(info.value.__notes__)
    assert ops.plan.active() is None


def test_a_model_without_tvm_layers_needs_no_kernels():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.Tanh())
    summary = tg.precompile(model, torch.randn(1, 3, 5, 5), workers=1)
    assert (summary.kernels, summary.built, summary.loaded, summary.ready) == (0, 0, 0, 0)
    assert "0 kernels" in str(summary)


def test_precompile_rejects_bad_arguments():
    with pytest.raises(TypeError, match="torch_tvm_gemm.precompile: expected a model"):
        tg.precompile("model", torch.randn(2))
    with pytest.raises(ValueError, match="workers must be >= 1"):
        tg.precompile(nn.Identity(), torch.randn(2), workers=0)
    with pytest.raises(TypeError, match="example_kwargs must be a dict"):
        tg.precompile(nn.Identity(), example_kwargs=[1])


class Keywords(nn.Module):
    def forward(self, x, scale=1.0):
        return torch.tanh(x) * scale


@pytest.mark.parametrize(
    "example",
    [torch.randn(2, 3), (torch.randn(2, 3), 2.0), {"x": torch.randn(2, 3), "scale": 3.0}],
    ids=["tensor", "tuple", "dict"],
)
def test_convert_takes_example_inputs_of_any_form(example):
    model = tg.convert(Keywords(), example_inputs=example)
    assert model.conversion_summary.precompiled.kernels == 0
    assert tg.convert(Keywords()).conversion_summary.precompiled is None  # off by default


# --- precompile on a cold cache, in a fresh process ------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    import torch_tvm_gemm as tg
    from torch_tvm_gemm.runtime import build_worker, table

    class Net(nn.Module):  # two linears and a conv-relu, at shapes no other test builds
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1)
            self.fc1 = nn.Linear(6 * 5 * 5, 23)
            self.fc2 = nn.Linear(23, 11)

        def forward(self, x):
            y = torch.relu(self.conv(x)).flatten(1)
            return self.fc2(torch.relu(self.fc1(y)))

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 3, 5, 5)
    with torch.no_grad():
        expected = model(x)
        if sys.argv[1] == "convert":
            tg.convert(model, example_inputs=(x,))
            summary = model.conversion_summary.precompiled
        else:
            tg.convert(model)
            summary = tg.precompile(model, x, workers=2)
        builds = build_worker.build_count()
        out = model(x)
        built_by_forward = build_worker.build_count() - builds
        table.clear_table()  # which kernels does a forward use? (loaded again: no build)
        model(x)
        used = set(table._table)
    print(json.dumps({
        "kernels": summary.kernels, "built": summary.built, "loaded": summary.loaded,
        "ready": summary.ready, "built_by_forward": built_by_forward,
        "same_kernels": used == set(summary.specs), "used": len(used),
        "ok": torch.allclose(out, expected, rtol=1e-4, atol=1e-4),
        "tvm_imported": "tvm" in sys.modules,
    }))
    """
)


def _child(cache_dir: Path, how: str) -> dict:
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(cache_dir)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("TVM_GEMM_BUILD_IN_PROCESS", None)
    env.pop("TVM_GEMM_NO_COMPILE", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, how], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_precompile_readies_both_kernels_of_a_measured_variant():
    # A vocabulary-wide Linear at M = 128 ("swap2"): its kernel is measured against the packed
    # one at first use, so precompile builds (or loads) both and leaves the choice to that use.
    from torch_tvm_gemm.runtime import cache, variant_choice
    from torch_tvm_gemm.runtime.precompile import precompile_specs
    from torch_tvm_gemm.schedules.cpu import SWAP2_MIN_N

    w, b = randn(SWAP2_MIN_N + 5, 37), randn(SWAP2_MIN_N + 5)
    specs, _ = _planned(lambda: lin(randn(128, 37), w, b, "gelu"))
    assert [spec.variant for spec in specs] == ["swap2"]
    both = variant_choice.candidates(specs[0])
    assert [spec.variant for spec in both] == ["swap2", "gemm"]
    table.clear_table()
    precompile_specs(specs)
    assert all(cache.kernel_path(spec).exists() for spec in both)
    assert variant_choice.chosen_variant(specs[0]) is None  # not measured yet


def test_precompile_builds_what_a_forward_needs_on_a_cold_cache(tmp_path):
    cold = _child(tmp_path, "convert")  # convert(model, example_inputs=...)
    assert cold["ok"] and not cold["tvm_imported"], cold
    assert cold["kernels"] >= 3 and cold["built"] == cold["kernels"], cold  # conv, fc1, fc2
    assert cold["loaded"] == cold["ready"] == 0, cold
    assert cold["built_by_forward"] == 0 and cold["same_kernels"], cold
    warm = _child(tmp_path, "precompile")  # the same kernels, from the cache now
    assert warm["ok"] and not warm["tvm_imported"], warm
    assert warm["built"] == 0 and warm["loaded"] == warm["kernels"] == cold["kernels"], warm
    assert warm["built_by_forward"] == 0 and warm["same_kernels"], warm
