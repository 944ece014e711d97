"""CUDA schedules for the GEMM math of ``kernels/gemm.py``.

fp16 / bf16 ("mma" schedule, sm_80+): tensor cores through TensorIR tensorize. Each thread
block computes a BM x BN tile of the (padded) output with a grid of warps; per K step of BK,
the "A_pad" / "B_pad" stages *are* the global -> shared copies (16-byte vector loads, made
``cp.async`` and software-pipelined over ``STAGES`` buffers; rows padded by 8 elements so the
ldmatrix reads of 8 rows hit different banks). Each warp loads 16x16 fragments with
``ldmatrix`` and accumulates with ``mma.sync.m16n8k16`` (fp32) in registers. The epilogue
goes through shared memory: the accumulators are stored there, then the whole block reads
them back row-wise, adds the bias, applies the activation once and writes coalesced rows of
``out`` (the only stage with bounds checks on M and N).

M, N and K are padded to the tile in the math itself (``gemm_compute``): padded rows and
columns read clamped in-bounds inputs, padded K reads zero, so the main loop carries no
predicate and symbolic M needs none either.

fp32 / fp64 ("simt" schedule, any arch, also fp16/bf16 below sm_80): classic shared-memory
tiling with a register-blocked TM x TN micro-tile per thread, FMA on CUDA cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.gemm import GemmSpec, gemm_compute
from . import cuda_intrin

SCHEDULE_VERSION = 1  # part of the cache key: bump when a schedule changes the binary
MIN_ARCH = 70  # below Volta: no kernels (ops.py raises a clear error)
MMA_MIN_ARCH = 80  # ldmatrix + mma.sync m16n8k16 with bf16, cp.async


@dataclass(frozen=True)
class MmaConfig:
    bm: int  # block tile (rows of the output)
    bn: int
    bk: int  # K per pipeline stage
    warps_m: int  # warp grid inside the block
    warps_n: int
    stages: int  # shared-memory buffers in flight (software pipeline depth)

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def smem_bytes(self, dtype_bytes: int = 2) -> int:
        """Shared memory of one block: the pipelined A/B tiles (rows padded by 8) and the
        fp32 accumulator tile of the epilogue, which reuses nothing (a safe upper bound)."""
        ab = (self.bm + self.bn) * (self.bk + 8) * dtype_bytes * self.stages
        return ab + self.bm * self.bn * 4


@dataclass(frozen=True)
class SimtConfig:
    bm: int
    bn: int
    bk: int
    tm: int  # outputs per thread along M and N (register tile)
    tn: int

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


# Large M: 128x128 blocks of 4 warps (64x64 each: 4x4 fragments, 128 fp32 accumulators per
# lane). Small M ("gemv" variant, M <= 16): one fragment row, many blocks along N.
MMA_CONFIGS = {
    "gemm": MmaConfig(bm=128, bn=128, bk=32, warps_m=2, warps_n=2, stages=3),
    "gemv": MmaConfig(bm=16, bn=64, bk=64, warps_m=1, warps_n=2, stages=3),
}
SIMT_CONFIGS = {
    "gemm": SimtConfig(bm=64, bn=64, bk=16, tm=4, tn=4),
    "gemv": SimtConfig(bm=16, bn=64, bk=32, tm=1, tn=4),
}


def arch_number(arch: str) -> int:
    """ "sm_90a" -> 90."""
    return int("".join(ch for ch in arch.split("_")[-1] if ch.isdigit()))


def uses_tensor_cores(spec: GemmSpec, arch: str) -> bool:
    return spec.dtype in ("float16", "bfloat16") and arch_number(arch) >= MMA_MIN_ARCH


def launch_config(spec: GemmSpec, arch: str) -> dict:
    """Threads per block and shared memory the schedule of ``spec`` uses (for checks)."""
    if uses_tensor_cores(spec, arch):
        cfg = MMA_CONFIGS[spec.variant]
        return {"threads": cfg.threads, "smem_bytes": cfg.smem_bytes(), "schedule": "mma"}
    cfg = SIMT_CONFIGS[spec.variant]
    item = 8 if spec.dtype == "float64" else 4
    smem = (cfg.bm + cfg.bn) * cfg.bk * item
    return {"threads": cfg.threads, "smem_bytes": smem, "schedule": "simt"}


def schedule_gemm(spec: GemmSpec, arch: str):
    """The scheduled IRModule for ``spec`` on a GPU of compute capability ``arch``."""
    if uses_tensor_cores(spec, arch):
        return schedule_mma(spec, MMA_CONFIGS[spec.variant])
    return schedule_simt(spec, SIMT_CONFIGS[spec.variant])


# --- tensor cores -----------------------------------------------------------------------------


def schedule_mma(spec: GemmSpec, cfg: MmaConfig, func=None, vector: int | None = None):
    """``func`` / ``vector``: another math with gemm_compute's blocks and "nk" B, padded to
    ``cfg``'s tiles, and its load width (the conv's implicit GEMM, schedules/cuda_conv2d.py)."""
    from tvm import s_tir

    tile = cuda_intrin.TILE
    vector = vector or load_vector(spec)
    if func is None:
        func = gemm_compute(spec, cfg.bm, cfg.bn, cfg.bk, operand_dtype=spec.dtype, granule=vector)
    sch = s_tir.Schedule(_int32_indices(func))
    names = cuda_intrin.intrinsics(spec.dtype, spec.b_layout == "nk")
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    a_pad, b_pad = sch.get_sblock("A_pad"), sch.get_sblock("B_pad")

    # Split each axis into (16-wide fragment) x (the rest) and make the 16x16x16 step a block:
    # the unit that tensorize replaces with two mma.sync.
    i, j, k = sch.get_loops(acc)
    i, i_tc = sch.split(i, [None, tile])
    j, j_tc = sch.split(j, [None, tile])
    k, k_tc = sch.split(k, [None, tile])
    sch.reorder(i, j, k, i_tc, j_tc, k_tc)
    outer = sch.blockize(i_tc)

    frag_m = cfg.bm // cfg.warps_m // tile  # fragments per warp along M / N
    frag_n = cfg.bn // cfg.warps_n // tile
    i0, i1, i2 = sch.split(i, [None, cfg.warps_m, frag_m])
    j0, j1, j2 = sch.split(j, [None, cfg.warps_n, frag_n])
    k0, k1 = sch.split(k, [None, cfg.bk // tile])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    # blockIdx.x runs along N: blocks launched together share the same rows of A (L2 reuse).
    sch.bind(i0, "blockIdx.y")
    sch.bind(j0, "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")

    # Global -> shared: the padding stages themselves, one BM x BK / BK x BN tile per k0.
    for stage in (a_pad, b_pad):
        # (scope first: compute_at then sizes the tile for all warps of the block, since
        # thread loops are relaxed for shared memory)
        sch.set_scope(stage, 0, "shared.dyn")
        sch.compute_at(stage, k0)
        _spread_copy(sch, stage, cfg, vector)
        # +8 elements per row: ldmatrix's 8 row addresses fall in different banks.
        sch.storage_align(stage, 0, axis=-2, factor=32, offset=8)

    # Shared -> registers (fragments), per k1 step.
    a_frag = sch.cache_read(outer, _read_index(sch, outer, "A_pad"), "warp")
    b_frag = sch.cache_read(outer, _read_index(sch, outer, "B_pad"), "warp")
    sch.compute_at(a_frag, k1)
    sch.compute_at(b_frag, k1)

    # Accumulators: registers -> the block's fp32 tile in shared memory ("acc") -> "out".
    c_frag = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_frag, warp)
    sch.set_scope(c_frag, 0, "shared.dyn")
    sch.reverse_compute_at(out, j0)
    _epilogue(sch, out, cfg, math.gcd(4, spec.n))

    sch.decompose_reduction(outer, k0)

    def fragments(block):  # split the block's last two loops into 16x16 fragments
        r, c = sch.get_loops(block)[-2:]
        r0, r1 = sch.split(r, [None, tile])
        c0, c1 = sch.split(c, [None, tile])
        sch.reorder(r0, c0, r1, c1)
        return r1

    load_a, load_b, store_c = fragments(a_frag), fragments(b_frag), fragments(c_frag)
    sch.transform_layout(a_frag, ("write", 0), cuda_intrin.fragment_index_map)
    if spec.b_layout == "nk":  # the fragment is labelled (k, n) whatever the storage order
        sch.transform_layout(
            b_frag,
            ("write", 0),
            lambda n, k: (
                cuda_intrin.fragment_index_map(k, n)[1::-1]
                + cuda_intrin.fragment_index_map(k, n)[2:]
            ),
        )
    else:
        sch.transform_layout(b_frag, ("write", 0), cuda_intrin.fragment_index_map)
    sch.transform_layout(c_frag, ("read", 0), cuda_intrin.fragment_index_map)

    sch.tensorize(load_a, names["load_a"])
    sch.tensorize(load_b, names["load_b"])
    sch.tensorize(sch.get_loops(sch.get_sblock("acc"))[-3], names["compute"])
    sch.tensorize(sch.get_loops(sch.get_sblock("acc_init"))[-2], names["init"])
    sch.tensorize(store_c, names["store"])

    _pipeline(sch, k0, cfg)
    return sch.mod


def load_vector(spec: GemmSpec) -> int:
    """Elements per global load: 8 (16 bytes, one cp.async) when K and N allow it.

    A row of A or B starts 16-byte aligned only if its length is a multiple of 8; odd shapes
    get narrower (still correct) loads.
    """
    if spec.k is None:
        raise ValueError("CUDA GEMM kernels are specialised on K (spec.k must be set)")
    return math.gcd(8, spec.k, spec.n)


def _int32_indices(func):
    """The math with int32 indices (GPU kernels index in 32 bits; ops.py checks sizes).

    Besides being cheaper, TVM's warp-memory lowering only recognises int32 lane indices:
    with int64 ones the fragments stay whole-warp arrays (1024 halves per thread).
    """
    import tvm
    from tvm.tirx.transform import ForceNarrowIndexToInt32

    mod = ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))
    return mod["main"]


def _read_index(sch, block, buffer_name: str) -> int:
    reads = sch.get(block).reads
    for idx, region in enumerate(reads):
        if region.source.name.startswith(buffer_name):  # set_scope renames: A_pad_shared_dyn
            return idx
    raise RuntimeError(f"block reads no buffer {buffer_name}: {[str(r.source) for r in reads]}")


def _spread_copy(sch, block, cfg, vector: int) -> None:
    """Spread a 2-D tile copy over all threads of the block, ``vector`` elements each."""
    loops = sch.get_loops(block)[-2:]
    fused = sch.fuse(*loops)
    _, ty, tx, vec = sch.split(fused, [None, cfg.warps_m * cfg.warps_n, 32, vector])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)


def _epilogue(sch, out, cfg, vector: int) -> None:
    """out = act(acc + bias), read from shared memory row-wise, ``vector`` outputs per
    thread stored at once (the bounds checks hold for whole vectors: N % vector == 0)."""
    r, c = sch.get_loops(out)[-2:]
    fused = sch.fuse(r, c)
    _, ty, tx, vec = sch.split(fused, [None, cfg.warps_m * cfg.warps_n, 32, vector])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if vector > 1:
        sch.vectorize(vec)


def _pipeline(sch, k0, cfg) -> None:
    """Software pipelining: ``stages`` - 1 copies of A/B tiles in flight (cp.async) while
    the mma of the current one runs."""
    sch.annotate(k0, "software_pipeline_stage", [0, 0, cfg.stages - 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
    sch.annotate(k0, "software_pipeline_async_stages", [0])


# --- SIMT ---------------------------------------------------------------------------------------


def schedule_simt(spec: GemmSpec, cfg: SimtConfig, func=None, vector: int | None = None):
    """Each thread accumulates a TM x TN register tile; A and B tiles staged in shared
    memory (converted to the accumulation dtype once, in the copy). Thread (ty, tx) owns
    rows ``ty*TM + r`` and columns ``tx*TN + c``: a contiguous tile, so that the epilogue's
    per-thread region (and the register array) is exactly TM x TN. ``func`` / ``vector``:
    as in ``schedule_mma``."""
    from tvm import s_tir

    vector = vector or math.gcd(4, spec.k, spec.n)
    if func is None:
        func = gemm_compute(spec, cfg.bm, cfg.bn, cfg.bk, granule=vector)
    sch = s_tir.Schedule(_int32_indices(func))
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    ty_n, tx_n = cfg.bm // cfg.tm, cfg.bn // cfg.tn

    i, j, k = sch.get_loops(acc)
    i0, i1, i2 = sch.split(i, [None, ty_n, cfg.tm])
    j0, j1, j2 = sch.split(j, [None, tx_n, cfg.tn])
    k0, k1 = sch.split(k, [None, cfg.bk])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(i0, "blockIdx.y")
    sch.bind(j0, "blockIdx.x")
    sch.bind(i1, "threadIdx.y")
    sch.bind(j1, "threadIdx.x")

    for name in ("A_pad", "B_pad"):
        stage = sch.get_sblock(name)
        sch.set_scope(stage, 0, "shared")
        sch.compute_at(stage, k0)
        loops = sch.get_loops(stage)[-2:]
        _, ty, tx, vec = sch.split(sch.fuse(*loops), [None, ty_n, tx_n, vector])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vec)

    sch.set_scope(acc, 0, "local")
    sch.reverse_compute_at(out, j1)
    sch.decompose_reduction(acc, k0)
    sch.unroll(k1)
    sch.unroll(i2)
    sch.unroll(j2)
    return sch.mod
