"""The kernel cache: warm start without the compiler, corruption, concurrency, no-compile mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from torch_tvm_gemm.kernels.gemm import GemmSpec
from torch_tvm_gemm.runtime import cache, loader

# A child process that runs one linear and reports how many kernels it built and whether
# it imported the compiler (never: builds run in a compile worker).
CHILD = textwrap.dedent(
    """
    import sys, json, warnings, torch
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import torch_tvm_gemm as tg
        from torch_tvm_gemm.runtime import build_worker
        x, w, b = torch.randn(5, 24), torch.randn(12, 24), torch.randn(12)
        out = tg.linear(x, w, b, "relu")
    ok = torch.allclose(out, torch.relu(torch.nn.functional.linear(x, w, b)), atol=1e-4)
    print(json.dumps({"ok": ok, "tvm_imported": "tvm" in sys.modules,
                      "built": build_worker.build_count(),
                      "warnings": [str(c.message) for c in caught]}))
    """
)


def run_child(cache_dir: Path, **env) -> subprocess.Popen:
    full_env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(cache_dir), **env}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def kernel_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "kernels").glob("*.so"))


def test_warm_cache_needs_no_compiler(tmp_path):
    cold = result(run_child(tmp_path))
    assert cold["ok"] and cold["built"] == 1
    assert not cold["tvm_imported"], "a build must not import the TVM compiler in the caller"
    warm = result(run_child(tmp_path))
    assert warm["ok"] and warm["built"] == 0 and not warm["tvm_imported"]


def test_in_process_build_mode(tmp_path):
    cold = result(run_child(tmp_path, TVM_GEMM_BUILD_IN_PROCESS="1"))
    assert cold["ok"] and cold["built"] == 1 and cold["tvm_imported"]


def test_two_processes_compile_once(tmp_path):
    procs = [run_child(tmp_path) for _ in range(2)]
    results = [result(p) for p in procs]
    assert all(r["ok"] for r in results)
    # The second process waits on the kernel's lock, then loads what the first one built.
    assert sum(r["built"] for r in results) == 1
    assert len(kernel_files(tmp_path)) == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "no_metadata"])
def test_corrupt_kernel_is_rebuilt(tmp_path, damage):
    result(run_child(tmp_path))
    (so,) = kernel_files(tmp_path)
    if damage == "truncate":
        so.write_bytes(so.read_bytes()[: so.stat().st_size // 3])
    elif damage == "garbage":
        so.write_bytes(os.urandom(so.stat().st_size))
    else:
        so.with_suffix(".json").unlink()
    again = result(run_child(tmp_path))
    assert again["ok"] and again["built"] == 1
    assert any("corrupt" in w for w in again["warnings"]), again["warnings"]
    assert cache.is_intact(so)


def test_a_reader_never_meets_a_library_without_its_json(tmp_path, monkeypatch):
    """A process looks for a kernel without taking its lock first (``_load_cached``), and
    removes a library without its .json as damaged. So a build never shows one: at each
    rename into the cache, a reader that looks then finds a miss or the whole kernel, and
    removes nothing (the library was once removed under its builder, whose own load then
    found no file)."""
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(tmp_path))
    spec = GemmSpec("float32", 12, 24, "nk", bias=True, activation="relu")
    path = cache.kernel_path(spec)
    cache.make_private_dir(path.parent)
    looks, real_replace = [], os.replace

    def replace(src, dst):
        real_replace(src, dst)
        if Path(dst) in (path, cache.meta_path(path)):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (a "corrupt" warning fails the test)
                looks.append(cache._load_cached(path, spec.name()) is not None)

    monkeypatch.setattr(os, "replace", replace)
    cache._export(path, spec)
    assert looks == [False, True]  # the .json alone: a miss; then the whole kernel
    assert cache.is_intact(path)


def test_no_compile_mode_names_the_missing_kernel(tmp_path):
    proc = run_child(tmp_path, TVM_GEMM_NO_COMPILE="1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "TVM_GEMM_NO_COMPILE" in err and "gemm_gemm_float32_nk_n12_k24_bias_relu" in err


def test_unwritable_cache_dir_builds_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(blocker / "cache"))
    spec = GemmSpec("float32", n=6, k=5, b_layout="kn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = cache.load_or_build(spec)
    assert any("not writable" in str(w.message) for w in caught)
    a, b, out = torch.randn(3, 5), torch.randn(5, 6), torch.empty(3, 6)
    fn(a, b, out)
    torch.testing.assert_close(out, a @ b)


def test_key_changes_with_what_changes_the_binary():
    base = GemmSpec("float32", n=8, k=8, b_layout="kn")
    others = [
        GemmSpec("float64", n=8, k=8, b_layout="kn"),
        GemmSpec("float32", n=9, k=8, b_layout="kn"),
        GemmSpec("float32", n=8, k=None, b_layout="kn"),
        GemmSpec("float32", n=8, k=8, b_layout="nk"),
        GemmSpec("float32", n=8, k=8, b_layout="kn", bias=True),
        GemmSpec("float32", n=8, k=8, b_layout="kn", activation="relu"),
        GemmSpec("float32", n=8, k=8, b_layout="kn", variant="gemv"),
    ]
    paths = {cache.kernel_path(s) for s in [base, *others]}
    assert len(paths) == 1 + len(others)
    key = cache.full_key(base)
    assert {"target", "tvm", "schedule_version"} <= key.keys()


def test_threads_follow_torch():
    import tvm_ffi

    loader.ensure_runtime()
    tvm_threads = tvm_ffi.get_global_func("runtime.NumThreads")
    before = torch.get_num_threads()
    a = torch.randn(64, 64)
    try:
        for n in sorted({1, len(os.sched_getaffinity(0))}):
            torch.set_num_threads(n)
            torch.testing.assert_close(torch.ops.tvm_gemm.matmul(a, a), a @ a)
            assert tvm_threads() == n
        # The pool set from Python, then a call on whichever impl path is active: each path
        # must see the pool as it is (a stale per-path record once left it at 1 thread).
        torch.set_num_threads(1)
        loader.sync_threads()
        torch.set_num_threads(before)
        torch.ops.tvm_gemm.matmul(a, a)
        assert tvm_threads() == before
    finally:
        torch.set_num_threads(before)
