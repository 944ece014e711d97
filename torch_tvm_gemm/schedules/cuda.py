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

Hopper ("wgmma", sm_90a: an H100 / H200's arch with its own instructions): linear-shaped
fp16 / bf16 products go to ``cuda_wgmma`` (TMA + wgmma), see ``schedule_kind``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.gemm import GemmSpec, gemm_compute
from . import cuda_intrin, cuda_intrin_tf32, cuda_intrin_wmma, cuda_wgmma

SCHEDULE_VERSION = 4  # part of the cache key: bump when a schedule changes the binary
# (2: nvcc -maxrregcount=255, WMMA and TF32 schedules; 4: padded accumulator tile, wgmma)
MIN_ARCH = 70  # below Volta: no kernels (ops/checks.py raises a clear error)
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
        """Shared memory of one block, a safe upper bound: the pipelined A/B tiles (rows
        padded by up to 8 elements, B stored either way) and the fp32 accumulator tile of
        the epilogue (rows padded by 8), counted as if it reused nothing."""
        a = self.bm * (self.bk + 8)
        b = max(self.bn * (self.bk + 8), self.bk * (self.bn + 8))
        return (a + b) * dtype_bytes * self.stages + self.bm * (self.bn + 8) * 4


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
# WMMA (sm_70/75): 64x64 blocks of 4 warps (32x32 each), double-buffered without cp.async.
# Small tiles on purpose: Turing has 64 KB of shared memory per SM and Volta's fragments are
# twice as large per lane (HMMA.884 duplicates A/B across lane quads), so a 64x64 warp tile
# would not fit in registers. 37 KB of shared memory per block (no opt-in above 48 KB).
WMMA_CONFIGS = {
    "gemm": MmaConfig(bm=64, bn=64, bk=32, warps_m=2, warps_n=2, stages=2),
    "gemv": MmaConfig(bm=16, bn=64, bk=32, warps_m=1, warps_n=2, stages=2),
}
# TF32 (fp32 operands: twice the bytes per element): 128x128 blocks of 8 warps (64x32 each:
# 4x2 fragments, 64 accumulators and 48 operand registers per lane), K steps of 16.
TF32_CONFIGS = {
    "gemm": MmaConfig(bm=128, bn=128, bk=16, warps_m=2, warps_n=4, stages=3),
    "gemv": MmaConfig(bm=16, bn=64, bk=32, warps_m=1, warps_n=2, stages=3),
}
SIMT_CONFIGS = {
    "gemm": SimtConfig(bm=64, bn=64, bk=16, tm=4, tn=4),
    "gemv": SimtConfig(bm=16, bn=64, bk=32, tm=1, tn=4),
}


TENSOR_CORE_CONFIGS = {"mma": MMA_CONFIGS, "wmma": WMMA_CONFIGS, "tf32": TF32_CONFIGS}


def arch_number(arch: str) -> int:
    """ "sm_90a" -> 90."""
    return int("".join(ch for ch in arch.split("_")[-1] if ch.isdigit()))


def schedule_kind(spec: GemmSpec, arch: str) -> str:
    """Which schedule ``spec`` gets on ``arch``:

    - "mma": fp16/bf16 on sm_80+ (ldmatrix + mma.sync m16n8k16, cp.async);
    - "wmma": fp16 on sm_70/75 (WMMA fragments: HMMA.884 / HMMA.1688);
    - "tf32": fp32 with ``spec.tf32`` on sm_80+ (mma.sync m16n8k8 .tf32);
    - "simt": everything else, bf16 below sm_80 included (Volta and Turing tensor cores have
      no bf16 mode; their bf16 GEMMs run on CUDA cores, correct but slower: bf16 stays usable
      on a V100 / T4, as in torch, rather than raising), and exact fp32;
    - "wgmma": on sm_90a, what ``cuda_wgmma.supports`` (linear-shaped fp16/bf16 with N, K
      multiples of 128 and 64), unless TVM_GEMM_CUDA_WGMMA=0.
    """
    sm = arch_number(arch)
    if spec.tf32:
        return "tf32" if sm >= MMA_MIN_ARCH else "simt"
    if spec.dtype == "float16" and sm >= MIN_ARCH and forced_wmma():
        return "wmma"
    if arch.endswith("a") and sm == 90 and wgmma_enabled() and cuda_wgmma.supports(spec):
        return "wgmma"
    if spec.dtype in ("float16", "bfloat16") and sm >= MMA_MIN_ARCH:
        return "mma"
    if spec.dtype == "float16" and sm >= MIN_ARCH:
        return "wmma"
    return "simt"


# TVM_GEMM_CUDA_FORCE_WMMA=1: fp16 kernels use the WMMA schedule on every arch, so that the
# Volta/Turing fallback can be checked on the GPU at hand (benchmarks/gpu_check.sh builds a
# second pack with it for an H200). Such kernels get their own cache key (cache.full_key).
ENV_FORCE_WMMA = "TVM_GEMM_CUDA_FORCE_WMMA"


def forced_wmma() -> bool:
    import os

    return os.environ.get(ENV_FORCE_WMMA, "") == "1"


# TVM_GEMM_CUDA_WGMMA=0: Hopper runs the mma.sync kernels too (to compare the two on one GPU;
# its kernels get their own cache key, see cache.full_key).
ENV_WGMMA = "TVM_GEMM_CUDA_WGMMA"


def wgmma_enabled() -> bool:
    import os

    return os.environ.get(ENV_WGMMA, "") != "0"


def uses_tensor_cores(spec: GemmSpec, arch: str) -> bool:
    return schedule_kind(spec, arch) != "simt"


def launch_config(spec: GemmSpec, arch: str) -> dict:
    """Threads per block and shared memory the schedule of ``spec`` uses (for checks)."""
    kind = schedule_kind(spec, arch)
    if kind == "wgmma":
        cfg = cuda_wgmma.WgmmaConfig()
        return {"threads": cfg.threads, "smem_bytes": cfg.smem_bytes(), "schedule": kind}
    if kind in TENSOR_CORE_CONFIGS:
        cfg = TENSOR_CORE_CONFIGS[kind][spec.variant]
        item = 4 if kind == "tf32" else 2
        return {"threads": cfg.threads, "smem_bytes": cfg.smem_bytes(item), "schedule": kind}
    cfg = SIMT_CONFIGS[spec.variant]
    item = 8 if spec.dtype == "float64" else 4
    smem = (cfg.bm + cfg.bn) * cfg.bk * item
    return {"threads": cfg.threads, "smem_bytes": smem, "schedule": "simt"}


def pass_config(spec: GemmSpec, arch: str) -> dict:
    """TVM pass options for the kernel of ``spec`` on ``arch``: cp.async (sm_80+ only) for
    the global->shared copies of the "mma" and "tf32" schedules; no TIR CSE, which hides the lane index
    from the warp-memory lowering (nvcc does its own CSE).

    WMMA: no StorageRewrite. It lets the fp32 accumulator tile reuse a freed fp16 operand
    buffer when it fits (small tiles), and then TVM 0.27 rejects the fp32 pointer of
    wmma::store_matrix_sync into it ("tvm_access_ptr element type must match"). Shared
    memory is still reused: the dynamic shared allocations are merged by their own pass.
    """
    kind = schedule_kind(spec, arch)
    if kind == "wgmma":  # (written with its own copies and barriers: nothing to add)
        return {}
    return {
        "tirx.use_async_copy": kind in ("mma", "tf32"),
        "tirx.disable_cse_tir": True,
        "tirx.disable_storage_rewrite": kind == "wmma",
    }


def tir_pipeline(spec: GemmSpec, arch: str) -> str | None:
    """``tvm.compile``'s ``tir_pipeline`` for the kernel of ``spec``: "tirx" for the wgmma
    kernel (written in TIRx), else TVM's default."""
    return "tirx" if schedule_kind(spec, arch) == "wgmma" else None


def schedule_gemm(spec: GemmSpec, arch: str):
    """The scheduled IRModule for ``spec`` on a GPU of compute capability ``arch``."""
    kind = schedule_kind(spec, arch)
    if kind == "wgmma":
        return cuda_wgmma.schedule_gemm(spec)
    if kind in TENSOR_CORE_CONFIGS:
        return schedule_mma(spec, TENSOR_CORE_CONFIGS[kind][spec.variant], kind)
    return schedule_simt(spec, SIMT_CONFIGS[spec.variant])


# --- tensor cores -----------------------------------------------------------------------------


def schedule_mma(
    spec: GemmSpec, cfg: MmaConfig, kind: str = "mma", func=None, vector: int | None = None
):
    """The tensor-core schedules (``kind`` of ``schedule_kind``): "mma" (ldmatrix +
    mma.sync, fp16/bf16), "wmma" (WMMA fragments, fp16 on sm_70/75), "tf32" (mma.sync on
    fp32 operands). All tensorize the same 16x16x16 steps; they differ in the fragments'
    scope and layout, the shared-memory padding and the pipeline (no cp.async before sm_80).

    ``func`` / ``vector``: another math with gemm_compute's blocks and "nk" B, padded to
    ``cfg``'s tiles, and its load width (the conv's implicit GEMM, schedules/cuda_conv2d.py).
    """
    from tvm import s_tir

    tile = cuda_intrin.TILE
    vector = vector or load_vector(spec)
    if func is None:
        func = gemm_compute(spec, cfg.bm, cfg.bn, cfg.bk, operand_dtype=spec.dtype, granule=vector)
    sch = s_tir.Schedule(_int32_indices(func))
    b_k_major = spec.b_layout == "nk"
    scopes = {"A": "warp", "B": "warp", "C": "warp"}
    if kind == "wmma":
        names = cuda_intrin_wmma.wmma_intrinsics(b_k_major)
        scopes = cuda_intrin_wmma.WMMA_SCOPE
    elif kind == "tf32":
        names = cuda_intrin_tf32.tf32_intrinsics(b_k_major)
    else:
        names = cuda_intrin.intrinsics(spec.dtype, b_k_major)
    acc, out = sch.get_sblock("acc"), sch.get_sblock("out")
    a_pad, b_pad = sch.get_sblock("A_pad"), sch.get_sblock("B_pad")

    # Split each axis into (16-wide fragment) x (the rest) and make the 16x16x16 step a block:
    # the unit that tensorize replaces with two mma.sync (or one wmma::mma_sync).
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
    for stage, k_major in ((a_pad, True), (b_pad, b_k_major)):
        # (scope first: compute_at then sizes the tile for all warps of the block, since
        # thread loops are relaxed for shared memory)
        sch.set_scope(stage, 0, "shared.dyn")
        sch.compute_at(stage, k0)
        _spread_copy(sch, stage, cfg, vector)
        factor, offset = _row_padding(kind, k_major)
        sch.storage_align(stage, 0, axis=-2, factor=factor, offset=offset)

    # Shared -> registers (fragments), per k1 step.
    a_frag = sch.cache_read(outer, _read_index(sch, outer, "A_pad"), scopes["A"])
    b_frag = sch.cache_read(outer, _read_index(sch, outer, "B_pad"), scopes["B"])
    sch.compute_at(a_frag, k1)
    sch.compute_at(b_frag, k1)

    # Accumulators: registers -> the block's fp32 tile in shared memory ("acc") -> "out".
    c_frag = sch.cache_write(outer, 0, scopes["C"])
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
    if kind != "wmma":  # mma.sync: the fragments' lane/slot layout is explicit (WMMA's is opaque)
        _mma_fragment_layouts(sch, a_frag, b_frag, c_frag, b_k_major, kind == "tf32")

    sch.tensorize(load_a, names["load_a"])
    sch.tensorize(load_b, names["load_b"])
    sch.tensorize(sch.get_loops(sch.get_sblock("acc"))[-3], names["compute"])
    sch.tensorize(sch.get_loops(sch.get_sblock("acc_init"))[-2], names["init"])
    store_block = sch.blockize(store_c)
    sch.tensorize(store_block, names["store"])
    if kind != "wmma":
        # mma.sync's accumulator fragment: lane (g, t) writes row g, columns 2t, 2t+1. With
        # unpadded rows (a multiple of 32 floats) the 8 rows of a store hit the same 8 banks:
        # an 8-way conflict (ncu on an H200: 8.2-way, 76% of the shared-store wavefronts).
        # Rows 8 floats apart in bank space: 2 wavefronts per 256-byte store, the minimum.
        # (On the tensorized block: tensorize drops the annotations of the block it replaces.)
        sch.storage_align(store_block, 0, axis=-2, factor=32, offset=8)

    _pipeline(sch, k0, cfg, async_copy=kind != "wmma")
    return sch.mod


def _row_padding(kind: str, k_major: bool) -> tuple[int, int]:
    """``storage_align`` (factor, offset) of a shared tile's rows: row stride = offset
    (mod factor) elements, chosen so that the fragment loads of a warp are conflict-free.

    16-bit (ldmatrix; WMMA also needs 16-byte rows and 32-byte aligned fragments): +8
    elements, the 8 row addresses of an 8x8 matrix fall in different banks. TF32 (32-bit
    loads, lane (g, t) = (lane // 4, lane % 4)): a [.., k] tile reads row g, column t:
    stride = 4 (mod 8) puts the 32 lanes in 32 banks; a [k, n] tile reads row t, column g:
    stride = 8 (mod 16). Both keep rows 16-byte aligned for cp.async.
    """
    if kind != "tf32":
        return 32, 8
    return (8, 4) if k_major else (16, 8)


def _mma_fragment_layouts(sch, a_frag, b_frag, c_frag, b_k_major: bool, tf32: bool) -> None:
    """Lay the "warp" fragments out as (fragment, fragment, lane, slot): mma.sync's map."""
    if tf32:
        a_map = cuda_intrin_tf32.tf32_index_map(cuda_intrin_tf32.tf32_a_layout)
        b_map = cuda_intrin_tf32.tf32_index_map(cuda_intrin_tf32.tf32_b_layout)
    else:
        a_map = b_map = cuda_intrin.fragment_index_map
    sch.transform_layout(a_frag, ("write", 0), a_map)
    if b_k_major:  # the fragment is labelled (k, n) whatever the storage order
        sch.transform_layout(
            b_frag, ("write", 0), lambda n, k: (*b_map(k, n)[1::-1], *b_map(k, n)[2:])
        )
    else:
        sch.transform_layout(b_frag, ("write", 0), b_map)
    sch.transform_layout(c_frag, ("read", 0), cuda_intrin.fragment_index_map)


def load_vector(spec: GemmSpec) -> int:
    """Elements per global load: 16 bytes (one cp.async) when K and N allow it.

    A row of A or B starts 16-byte aligned only if its length is a multiple of 16 bytes;
    odd shapes get narrower (still correct) loads.
    """
    if spec.k is None:
        raise ValueError("CUDA GEMM kernels are specialised on K (spec.k must be set)")
    return math.gcd(4 if spec.dtype == "float32" else 8, spec.k, spec.n)


def _int32_indices(func):
    """The math with int32 indices (GPU kernels index in 32 bits; ops/checks.py checks sizes).

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


def _pipeline(sch, k0, cfg, async_copy: bool = True) -> None:
    """Software pipelining: ``stages`` - 1 copies of A/B tiles in flight while the mma of
    the current one runs; asynchronous (cp.async, sm_80+) with ``async_copy``, else plain
    double buffering (the next tile's loads are issued before this tile's mma)."""
    sch.annotate(k0, "software_pipeline_stage", [0, 0, cfg.stages - 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
    if async_copy:
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
