"""The CUDA ladder steps compile for sm_80 without a GPU, each showing the feature it adds
in the generated CUDA C++ (running them needs a GPU: not tested here)."""

from __future__ import annotations

import pytest

from torch_tvm_gemm.tools import ladder_cuda as lc

FEATURES = {
    "simple": [],
    "tiled": ["threadIdx.y"],
    "shared": ["__shared__", "__syncthreads"],
    "register": ["__shared__", "float4"],
    "pipelined": ["cp.async"],
    "unrolled": ["cp.async"],
    "wmma": ["wmma::mma_sync"],
}
SLOW = {"wmma"}  # dlight imports TVM's tensor intrinsics: ~10-20 s on 2 cores


@pytest.mark.parametrize(
    ("name", "schedule", "dtype"),
    [
        pytest.param(*step, marks=[pytest.mark.slow] if step[0] in SLOW else [], id=step[0])
        for step in lc.CUDA_STEPS
    ],
)
def test_step_compiles_for_sm80(name, schedule, dtype):
    # dlight tensorizes only from N = K = 128 on; below, it falls back to plain code.
    src = lc.cuda_source(schedule, lc.cuda_spec(128, 128, dtype))
    assert "__global__" in src
    for feature in FEATURES[name]:
        assert feature in src, f"{name}: {feature} not in the generated CUDA"
