"""Shared fixtures: one kernel cache per test session, tolerances, random inputs."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# One cache for the whole session, set before torch_tvm_gemm is imported: each kernel is
# compiled once per session however many tests use it. Tests of the cache itself use their
# own directories.
_SESSION_CACHE = tempfile.mkdtemp(prefix="tvm_gemm_test_cache_")
os.environ.setdefault("TVM_GEMM_CACHE_DIR", _SESSION_CACHE)

import torch_tvm_gemm  # noqa: E402,F401

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def tolerance(dtype: torch.dtype, k: int = 1) -> dict:
    """One tolerance table: fp32/fp64 near torch's defaults; narrow dtypes scaled with K."""
    if dtype == torch.float64:
        return {"rtol": 1e-7, "atol": 1e-7 * max(1, k) ** 0.5}
    if dtype == torch.float32:
        return {"rtol": 1.3e-5, "atol": 1e-5 * max(1, k) ** 0.5}
    eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
    return {"rtol": 2 * eps, "atol": 2 * eps * max(1, k) ** 0.5}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, k: int = 1) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), **tolerance(actual.dtype, k))


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
    yield
