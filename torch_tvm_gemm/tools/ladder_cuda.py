"""The CUDA optimization ladder: schedules of the same GEMM math for NVIDIA GPUs.

Built and checked here only as far as a machine without a GPU allows: each step compiles
for ``sm_80`` (TVM emits CUDA C++ without a GPU; see the notes) and the tests read the
generated source for the feature the step adds. Timing them needs a GPU: not done yet.

    simple     one thread per output column, one block row per output row
    tiled      16x16 thread blocks over 16x16 output tiles, k innermost per thread
    shared     A and B tiles staged in shared memory, fetched cooperatively by the block
    register   64x64 block tiles, 4x4 outputs per thread in registers, float4 fetches
    pipelined  the shared-memory fetch of the next k tile overlaps this one's math
               (software pipelining, asynchronous cp.async copies on sm_80)
    unrolled   the per-thread loops unrolled
    wmma       fp16 tensor cores through WMMA (dlight's matmul rule)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..kernels.gemm import GemmSpec, gemm_compute
from .ladder import inline_operands

CUDA_TARGET = {"kind": "cuda", "arch": "sm_80"}
BK = 16  # k tile staged in shared memory


def cuda_spec(n: int, k: int, dtype: str = "float32") -> GemmSpec:
    return GemmSpec(dtype=dtype, n=n, k=k, b_layout="kn", device="cuda")


def simple(spec: GemmSpec):
    from tvm import s_tir

    sch = s_tir.Schedule(gemm_compute(spec))
    inline_operands(sch)
    acc = sch.get_sblock("acc")
    i, j, _ = sch.get_loops(acc)
    jo, ji = sch.split(j, [None, 128])
    sch.bind(i, "blockIdx.y")
    sch.bind(jo, "blockIdx.x")
    sch.bind(ji, "threadIdx.x")
    sch.reverse_compute_at(sch.get_sblock("out"), ji)  # one kernel: the sum in a register
    sch.set_scope(acc, 0, "local")
    return sch.mod


def _block_tiles(sch, bm: int, bn: int, tm: int, tn: int):
    """Split the output into (bm, bn) block tiles of (bm/tm, bn/tn) threads, each thread
    owning a (tm, tn) tile kept in registers; returns (acc block, k loop, thread x/y)."""
    acc = sch.get_sblock("acc")
    i, j, k = sch.get_loops(acc)
    by, ty, ti = sch.split(i, [None, bm // tm, tm])
    bx, tx, tj = sch.split(j, [None, bn // tn, tn])
    ko, ki = sch.split(k, [None, BK])
    sch.reorder(by, bx, ty, tx, ko, ki, ti, tj)
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.reverse_compute_at(sch.get_sblock("out"), tx)
    sch.set_scope(acc, 0, "local")
    return acc, ko, ki, (ti, tj)


def tiled(spec: GemmSpec):
    from tvm import s_tir

    sch = s_tir.Schedule(gemm_compute(spec, 16, 16))
    inline_operands(sch)
    acc, ko, _, _ = _block_tiles(sch, 16, 16, 1, 1)
    sch.decompose_reduction(acc, ko)
    return sch.mod


def _stage_shared(sch, ko, threads: int, vec: int) -> None:
    """A and B tiles into shared memory at ``ko``, each fetched by all ``threads`` of the
    block together (``vec`` elements per thread per step).

    The padding stages "A_pad" / "B_pad" become the shared copies: their reads clamp the
    padded rows, so each tile has a constant shape (a cache_read of A itself would not).
    """
    for name in ("A_pad", "B_pad"):
        block = sch.get_sblock(name)
        sch.set_scope(block, 0, "shared")
        sch.compute_at(block, ko)
        fused = sch.fuse(*sch.get_loops(block)[-2:])
        factors = [None, threads // 16, 16] + ([vec] if vec > 1 else [])
        parts = sch.split(fused, factors)
        sch.bind(parts[1], "threadIdx.y")
        sch.bind(parts[2], "threadIdx.x")
        if vec > 1:
            sch.vectorize(parts[3])


def shared(spec: GemmSpec):
    from tvm import s_tir

    sch = s_tir.Schedule(gemm_compute(spec, 16, 16))
    acc, ko, _, _ = _block_tiles(sch, 16, 16, 1, 1)
    _stage_shared(sch, ko, threads=256, vec=1)
    sch.decompose_reduction(acc, ko)
    return sch.mod


def _register_tiled(pipelined: bool, unrolled: bool) -> Callable[[GemmSpec], Any]:
    def schedule(spec: GemmSpec):
        from tvm import s_tir

        sch = s_tir.Schedule(gemm_compute(spec, 64, 64))
        acc, ko, ki, (ti, tj) = _block_tiles(sch, 64, 64, 4, 4)
        _stage_shared(sch, ko, threads=256, vec=4)
        if pipelined:
            # Stage 0: the two copies of tile k+1 (async on sm_80); stage 1: math of tile k.
            sch.annotate(ko, "software_pipeline_stage", [0, 0, 1])
            sch.annotate(ko, "software_pipeline_order", [0, 1, 2])
            sch.annotate(ko, "software_pipeline_async_stages", [0])
        if unrolled:
            sch.unroll(ki)
            sch.unroll(ti)
            sch.unroll(tj)
        sch.decompose_reduction(acc, ko)
        return sch.mod

    return schedule


def wmma(spec: GemmSpec):
    """fp16 tensor cores: dlight's GPU matmul rule tensorizes with WMMA fragments."""
    import tvm
    from tvm import s_tir
    from tvm.ir import IRModule
    from tvm.s_tir import dlight as dl

    # Inline the casts into the reduction: sum(f32(A) * f32(B)) is the pattern the rule
    # maps onto fp16 x fp16 -> fp32 fragments.
    sch = s_tir.Schedule(gemm_compute(spec))
    inline_operands(sch)
    _import_tensor_intrinsics()
    with tvm.target.Target(CUDA_TARGET):
        return dl.ApplyDefaultSchedule(dl.gpu.Matmul())(IRModule({"main": sch.mod["main"]}))


def _import_tensor_intrinsics() -> None:
    """Import TVM's tensor intrinsics (the rule tensorizes with them) without the slow path.

    Each of its ~500 intrinsics is a TVMScript function whose decorator calls
    ``inspect.stack()``; for every frame whose file is not on disk (the import machinery's
    ``<frozen importlib._bootstrap>``) ``inspect`` scans all of ``sys.modules`` again, as its
    file -> module cache never holds such a name. With torch loaded (~2000 modules) the import
    took 96-260 s on a 2-core Xeon. Recording those two names in that cache first (they are
    exactly the modules named): 10 s."""
    import importlib
    import inspect
    import os

    for name in ("importlib._bootstrap", "importlib._bootstrap_external"):
        filename = f"<frozen {name}>"
        for key in (
            filename,
            os.path.abspath(filename),
            os.path.normcase(os.path.abspath(filename)),
        ):
            inspect.modulesbyfile.setdefault(key, name)
    importlib.import_module("tvm.s_tir.tensor_intrin")


# (name, schedule, dtype): the tensor-core step needs fp16 inputs.
CUDA_STEPS: list[tuple[str, Callable[[GemmSpec], Any], str]] = [
    ("simple", simple, "float32"),
    ("tiled", tiled, "float32"),
    ("shared", shared, "float32"),
    ("register", _register_tiled(False, False), "float32"),
    ("pipelined", _register_tiled(True, False), "float32"),
    ("unrolled", _register_tiled(True, True), "float32"),
    ("wmma", wmma, "float16"),
]


def cuda_source(schedule: Callable[[GemmSpec], Any], spec: GemmSpec) -> str:
    """Compile for sm_80 (no GPU needed) and return the generated CUDA C++."""
    import tvm

    executable = tvm.compile(schedule(spec), target=tvm.target.Target(CUDA_TARGET))
    return executable.mod.imports[0].inspect_source()
