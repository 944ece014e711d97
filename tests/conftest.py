"""Shared fixtures: one kernel cache per test session, tolerances, random inputs."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# One cache for the whole session, set before torch_tvm_gemm is imported: each kernel is
# compiled once per session however many tests use it, and the directory removed at exit
# (a full run leaves ~45 MB of kernels). A TVM_GEMM_CACHE_DIR set by the caller is used
# instead, and kept. pytest-xdist's workers (-n) inherit the directory from the process that
# starts them, so they share it and its kernels. Tests of the cache itself use their own
# directories.
if "TVM_GEMM_CACHE_DIR" not in os.environ:
    os.environ["TVM_GEMM_CACHE_DIR"] = tempfile.mkdtemp(prefix="tvm_gemm_test_cache_")
    atexit.register(shutil.rmtree, os.environ["TVM_GEMM_CACHE_DIR"], ignore_errors=True)

import torch_tvm_gemm  # noqa: E402,F401
from torch_tvm_gemm.measure import tolerance  # noqa: E402 (the package's one table)

# The variant rule depends on the thread count (schedules/cpu.py rows_split_wins: from three
# threads on, the row halves serve more weights below ROWS_MIN_M): the tests' expected
# variants are those of two threads, as on the 2-core machines CI runs on.
torch.set_num_threads(min(2, torch.get_num_threads()))

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, k: int = 1) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), **tolerance(actual.dtype, k))


def run_on(path: str, fn):
    """``fn()`` with the ops served by the ``"cpp"`` or ``"python"`` impls, then as before."""
    previous = torch_tvm_gemm.ops.use_impl(path)
    try:
        return fn()
    finally:
        torch_tvm_gemm.ops.use_impl(previous)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
    yield


class WeightCasts:
    """Counts the casts (``aten._to_copy``) of tensors of ``shape`` while active."""

    def __init__(self, shape):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._to_copy.default and args[0].shape == shape:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self.mode = 0, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
