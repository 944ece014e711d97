"""Property tests: random shapes and epilogues against PyTorch (hypothesis).

N takes few values so that the kernels (one per N) are compiled once and reused across
examples; M and K vary freely (both are symbolic in the matmul kernel, M in the linear one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_tvm_gemm as tg

dims = st.integers(min_value=1, max_value=70)
settings.register_profile("tvm_gemm", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("tvm_gemm")


@given(
    m=dims,
    k=dims,
    n=st.sampled_from([1, 7, 33]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matmul_matches_torch(m, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    assert_close(tg.matmul(a, b), a.double() @ b.double(), k)


@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    m=dims,
    act=st.sampled_from(["none", "relu", "gelu"]),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_torch(lead, m, act, has_bias, seed):
    g = torch.Generator().manual_seed(seed)
    k, n = 24, 17
    x = torch.randn(*lead, m, k, generator=g)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g) if has_bias else None
    ref = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}[act](F.linear(x, w, b))
    assert_close(tg.linear(x, w, b, act), ref, k)
