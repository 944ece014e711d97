"""The Hopper kernel (schedules/cuda_wgmma.py): TMA + wgmma for sm_90a, SASS checked.

No GPU needed: TVM generates the CUDA source, nvcc compiles it for sm_90a
(-gencode arch=compute_90a,code=sm_90a) and the SASS is read with cuobjdump. Skipped when
nvcc is missing or this TVM lacks the TIRx CUDA tile primitives.
"""

from __future__ import annotations

import re

import pytest

from torch_tvm_gemm.compiler import cuda_pack, wgmma
from torch_tvm_gemm.schedules import cuda_wgmma

_ok, _why = cuda_wgmma.wgmma_available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cuda_pack.nvcc_available(), reason="nvcc not found"),
    pytest.mark.skipif(not _ok, reason=f"TVM tile primitives unavailable: {_why}"),
]
needs_cuobjdump = pytest.mark.skipif(
    cuda_pack.find_cuobjdump() is None, reason="cuobjdump not found (nvidia-cuda-cuobjdump)"
)

SIZE = (None, 1024, 1024)  # M symbolic, as the ops build it
CFG = cuda_wgmma.WgmmaConfig()
VARIANTS = {"plain": {}, "bias_relu_bf16": {"dtype": "bfloat16", "bias": True, "relu": True}}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def built(request) -> dict:
    kwargs = VARIANTS[request.param]
    source = wgmma.wgmma_cuda_source(*SIZE, **kwargs)
    return {"name": request.param, "source": source, **kwargs}


@pytest.fixture(scope="module")
def sass(built) -> str:
    if cuda_pack.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (nvidia-cuda-cuobjdump)")
    fatbin = wgmma.wgmma_fatbin(built["source"])
    sections = cuda_pack.sass_by_arch(fatbin)
    assert list(sections) == ["sm_90a"]
    return sections["sm_90a"]


def _opcodes(sass: str) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass)


def test_source_uses_wgmma_and_tma(built):
    src = built["source"]
    ab = cuda_wgmma.PTX_TYPES[built.get("dtype", "float16")]
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ab}.{ab}" in src
    assert "cp.async.bulk.tensor.2d" in src
    assert "__grid_constant__ CUtensorMap" in src
    assert "mbarrier.try_wait.parity" in src


@needs_cuobjdump
def test_sass_has_hgmma_and_tma(sass):
    ops = _opcodes(sass)
    hgmma = [op for op in ops if op.startswith("HGMMA.64x128x16.F32")]
    assert hgmma, "no HGMMA (wgmma) in the sm_90a SASS"
    assert any(op.startswith("UTMALDG") for op in ops), "no TMA load (UTMALDG) in the SASS"
    assert "WARPGROUP.ARRIVE" in ops
    assert not [op for op in ops if op.startswith(("LDL", "STL"))], "local memory (spills)"


def _instructions(sass: str) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", sass)


def accumulator_read_before_wait(sass: str) -> str | None:
    """The first instruction after the last HGMMA that reads one of its accumulator
    registers before a ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` (all wgmma done), or None."""
    ins = _instructions(sass)
    last = max(i for i, text in enumerate(ins) if text.startswith("HGMMA."))
    n, base = map(int, re.search(r"HGMMA\.64x(\d+)x16\.\S+ R(\d+)", ins[last]).groups())
    acc = set(range(base, base + n // 2))  # m64nNk16: N / 2 fp32 accumulators per thread
    for text in ins[last + 1 :]:
        if text.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"):
            return None
        if acc & {int(r) for r in re.findall(r"\bR(\d+)\b", text)}:
            return text
    return None


@needs_cuobjdump
def test_accumulators_read_only_after_the_last_wait(sass):
    # On an H200 the epilogue once read the first accumulators while the last wgmma group
    # was still running: ptxas had scheduled them above the wait_group(0) that followed
    # the k loop (wrong values in columns 0-39 of each tile).
    assert accumulator_read_before_wait(sass) is None


@needs_cuobjdump
def test_wgmma_not_serialized_in_sass(sass):
    # ptxas serializes a wgmma pipeline it cannot prove safe: then every HGMMA carries its
    # own scoreboard wait. Here the 4 k16 steps of a k-tile issue back to back: only the
    # last of each group sets gsb0.
    lines = [line for line in sass.splitlines() if "HGMMA." in line]
    with_gsb = [line for line in lines if "gsb0" in line]
    assert len(with_gsb) < len(lines)


def test_ptxas_resources(built):
    report = wgmma.ptxas_report(built["source"])
    assert not report["wgmma_serialized"], report["log"][-2000:]
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0
    # 3 warpgroups (producer + 2 consumers) x 128 threads within the 64K register file
    assert 0 < report["registers"] * CFG.threads <= 65536
    assert report["stack"] == 0


def test_dynamic_shared_memory_fits(built):
    assert CFG.smem_bytes() <= 227 * 1024
    assert "extern __shared__" in built["source"]


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="multiples of the tile"):
        cuda_wgmma.wgmma_gemm_func(1000, 1024, 1024)
    with pytest.raises(ValueError, match="block_k"):
        cuda_wgmma.wgmma_gemm_func(1024, 1024, 1024, cfg=cuda_wgmma.WgmmaConfig(block_k=32))


def test_pack_holds_both_kernels_of_a_linear(tmp_path):
    """A pack for sm_90 and sm_90a: the linear's mma.sync library for sm_90 and its wgmma
    library (HGMMA in the sm_90a SASS) for sm_90a; a matmul (B stored (K, N)) stays mma."""
    from torch_tvm_gemm.cli.compile import parse_op
    from torch_tvm_gemm.compiler import pack_writer

    (spec,) = parse_op("linear:bfloat16:256:192:bias+relu", ["gemm"])
    entries = pack_writer.build_kernels(spec, ["sm_90", "sm_90a"], tmp_path)
    assert {e["schedule"]: e["arches"] for e in entries} == {
        "mma": ["sm_90"],
        "wgmma": ["sm_90a"],
    }
    if cuda_pack.find_cuobjdump():
        (wgmma_entry,) = [e for e in entries if e["schedule"] == "wgmma"]
        fatbin = cuda_pack.fatbin_from_library(tmp_path / wgmma_entry["file"])
        assert "HGMMA.64x128x16.F32.BF16" in cuda_pack.sass_by_arch(fatbin)["sm_90a"]
    (matmul,) = parse_op("matmul:bfloat16:256:192", ["gemm"])
    assert pack_writer.schedule_groups(matmul, ["sm_90a"]) == {"mma": ["sm_90a"]}
