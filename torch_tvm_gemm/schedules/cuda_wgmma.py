"""The Hopper (sm_90a) GEMM: TMA loads + wgmma, written in TVM 0.27's TIRx.

``schedules/cuda.py`` gives a linear-shaped spec this schedule on an sm_90a target (see
``supports``); every other spec, and every other GPU, keeps ldmatrix + mma.sync. It computes

    C[M, N] = act(A[M, K] @ B[N, K]^T  (+ bias[N]))      fp16 or bf16 in, fp32 sums

i.e. ``torch.nn.functional.linear`` with both operands K-major, which is wgmma's native
layout (no transpose bits). N and K are fixed (multiples of the block tile), M is symbolic:
TMA fills the rows past M with zeros and the epilogue does not store them.

How it is written (TVM 0.27, ``tir_pipeline="tirx"``):

- TMA: the TIRx tile primitive ``T.tile.copy_async(smem_region, global_region,
  dispatch="tma_auto", mbar=...)``. It plans the TensorMap (box 64 x rows, 128-byte swizzle,
  read off the shared buffer's layout from ``tma_utils.mma_shared_layout``), makes the host
  encode it at launch from the tensors' shapes (``runtime.cuTensorMapEncodeTiled``, in
  ``libtvm_runtime_cuda.so``) and passes it as a ``__grid_constant__ CUtensorMap`` kernel
  parameter -> ``UTMALDG.2D`` in SASS.
- wgmma: TVM 0.27's ``gemm_async`` tile primitive has only a ``tcgen05`` (sm_100) dispatch,
  no wgmma one, so the MMA is issued through the PTX dialect: ``T.ptx["wgmma.mma_async.sync.
  aligned.m64nNk16.f32.f16.f16"](acc..., desc_a, desc_b, scale_d, 1, 1, 0, 0)`` with shared
  memory matrix descriptors from ``T.cuda.wgmma.encode_matrix_descriptor`` (128B swizzle,
  SBO = 1024 bytes), and ``wgmma.fence`` / ``commit_group`` / ``wait_group``
  -> ``HGMMA.64xNx16.F32`` in SASS.
- Warp specialization: warpgroup 0 is the producer (one thread issues the TMA loads of a
  ``stages``-deep ring, waiting on per-stage "empty" mbarriers); warpgroups 1..BM/64 are
  consumers (each a 64-row slice of the block tile; wait on the stage's "full" mbarrier,
  4 wgmma k16 steps, commit, keep one wgmma group in flight, release the previous stage).
  A producer branch *inside* the consumer loop makes ptxas serialize every wgmma
  (C7514 "wgmma.mma_async instructions are serialized"): the split into roles avoids it.
- Epilogue: accumulator fragments (row = warp*16 + lane/4 (+8), col = 8j + 2*(lane%4) (+1))
  (+ bias, relu), rounded to the output dtype and stored straight to global, a column pair
  per 32-bit store.

Checked without a GPU by ``tests/test_cuda_wgmma.py`` (SASS: HGMMA, UTMALDG, no spills, no
wgmma serialization, accumulators read only after the last wait); on an H200 by
``tests/test_cuda_ops.py`` through the ops (docs/wgmma.md has the figures).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..kernels import epilogue

ARCH = "sm_90a"


@dataclass(frozen=True)
class WgmmaConfig:
    """Block tile and pipeline depth. BM is 64 per consumer warpgroup; BK = 64 fp16 is one
    128-byte swizzle row; BN is the wgmma N (8..256, multiple of 8; <= 128 keeps the
    accumulator at BN/2 = 64 registers per thread without setmaxnreg)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4

    @property
    def consumers(self) -> int:
        return self.block_m // 64

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    def smem_bytes(self) -> int:
        # 1 KiB for the mbarriers (keeps the operand tiles 1024-byte aligned), then the ring.
        return 1024 + self.stages * (self.block_m + self.block_n) * self.block_k * 2

    def validate(self, m: int | None, n: int, k: int) -> None:
        if self.block_m % 64 or not 64 <= self.block_m <= 256:
            raise ValueError("block_m must be 64, 128, 192 or 256 (64 rows per warpgroup)")
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError("block_n must be a multiple of 8 in [8, 256] (wgmma N)")
        if self.block_k != 64:
            raise ValueError("block_k must be 64 (one 128-byte swizzle row of fp16)")
        if self.stages < 2:
            raise ValueError("stages must be >= 2")
        if (m is not None and m % self.block_m) or n % self.block_n or k % self.block_k:
            raise ValueError(
                f"wgmma kernel needs N, K (and a static M) multiples of the tile "
                f"({self.block_m}, {self.block_n}, {self.block_k}); got ({m}, {n}, {k})"
            )
        if self.smem_bytes() > 227 * 1024:
            raise ValueError(f"{self.smem_bytes()} bytes of shared memory > 227 KiB")


@functools.lru_cache(maxsize=1)
def wgmma_available() -> tuple[bool, str]:
    """Whether this TVM has what the kernel needs: (ok, reason if not)."""
    try:
        import tvm  # noqa: F401
        from tvm.backend.cuda.ptx import table
        from tvm.backend.cuda.tile_primitive import tma_utils  # noqa: F401
        from tvm.backend.cuda.tile_primitive.copy_async import tma  # noqa: F401
        from tvm.script import tirx as T
    except ImportError as err:
        return False, f"TVM without the TIRx CUDA backend ({err})"
    if "wgmma_f16_ss" not in getattr(table, "TABLE", {}):
        return False, "TVM's PTX table has no wgmma.mma_async f16 entry"
    if not hasattr(T, "tile") or not hasattr(T.tile, "copy_async"):
        return False, "TVM has no T.tile.copy_async tile primitive"
    if not hasattr(T, "SMEMPool"):
        return False, "TVM has no T.SMEMPool"
    return True, ""


PTX_TYPES = {"float16": "f16", "bfloat16": "bf16"}
# Two neighbouring outputs (an accumulator fragment's column pair) are rounded and stored as
# one 32-bit word: (C type, pair type, float2 -> pair conversion) per dtype.
PAIR_TYPES = {
    "float16": ("half", "__half2", "__floats2half2_rn"),
    "bfloat16": ("nv_bfloat16", "__nv_bfloat162", "__floats2bfloat162_rn"),
}


def _store_pair(dtype: str) -> tuple[str, str]:
    """(name, CUDA source) of the helper storing two floats as a pair of ``dtype``."""
    scalar, pair, pack = PAIR_TYPES[dtype]
    name = f"tvm_gemm_store_pair_{PTX_TYPES[dtype]}"
    source = f"""
__device__ __forceinline__ void {name}({scalar}* p, float a, float b) {{
    *reinterpret_cast<{pair}*>(p) = {pack}(a, b);
}}
"""
    return name, source


def wgmma_gemm_func(
    m: int | None,
    n: int,
    k: int,
    *,
    dtype: str = "float16",
    bias: bool = False,
    relu: bool = False,
    cfg: WgmmaConfig | None = None,
):
    """The TIRx PrimFunc ``main(A[m,k], B[n,k], [bias[n],] C[m,n])``, all of ``dtype``
    (float16 or bfloat16); ``m=None``: M symbolic (any M, one kernel)."""
    from tvm.backend.cuda.tile_primitive.tma_utils import SwizzleMode, mma_shared_layout
    from tvm.script import tirx as T

    cfg = cfg or WgmmaConfig()
    cfg.validate(m, n, k)
    if dtype not in PTX_TYPES:
        raise ValueError(f"wgmma kernel: dtype must be float16 or bfloat16, got {dtype}")
    bm_, bn_, bk_, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    consumers = cfg.consumers
    k_tiles = k // bk_
    acc_regs = bn_ // 2  # m64nNk16 f32 accumulator: N/2 registers per thread
    k_steps = bk_ // 16
    stage_bytes = (bm_ + bn_) * bk_ * 2
    swizzle = SwizzleMode.SWIZZLE_128B_ATOM
    a_layout = mma_shared_layout(dtype, swizzle, (stages, bm_, bk_))
    b_layout = mma_shared_layout(dtype, swizzle, (stages, bn_, bk_))
    ab = PTX_TYPES[dtype]
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn_}k16.f32.{ab}.{ab}"
    # Matrix descriptor of a K-major operand in 128B-swizzled rows of 64 16-bit values:
    # leading byte offset unused (1), stride byte offset = 8 rows * 128 B = 1024 B (in
    # 16-byte units: 64), swizzle 3 = 128B. A k16 step moves the start address by 32 bytes.
    lbo, sbo, desc_swizzle = 1, 64, 3

    store_pair, store_pair_source = _store_pair(dtype)

    def epilogue_value(acc_value, bias_value):
        if bias:
            acc_value = acc_value + bias_value
        if relu:
            acc_value = epilogue.relu(acc_value, "float32")  # (NaN stays NaN)
        return acc_value

    def body(A, B, bias_buf, C, m_rows):
        # The body is shared by the two signatures below (with and without bias).
        T.device_entry()
        bx, by = T.cta_id([n // bn_, T.ceildiv(m_rows, bm_)])
        wg = T.warpgroup_id([consumers + 1])
        tid = T.thread_id_in_wg([128])
        pool = T.SMEMPool()
        full = pool.alloc((stages,), "uint64", align=8)
        empty = pool.alloc((stages,), "uint64", align=8)
        pool.move_base_to(1024)
        As = pool.alloc((stages, bm_, bk_), dtype, align=1024, layout=a_layout)
        Bs = pool.alloc((stages, bn_, bk_), dtype, align=1024, layout=b_layout)
        pool.commit()
        if wg == 0 and tid == 0:
            for s in range(stages):
                T.ptx["mbarrier.init.shared::cta.b64"](full.ptr_to([s]), T.uint32(1))
                T.ptx["mbarrier.init.shared::cta.b64"](empty.ptr_to([s]), T.uint32(consumers * 128))
        T.ptx["fence.proxy.async.shared::cta"]()
        T.ptx["fence.mbarrier_init.release.cluster"]()
        T.cuda.cta_sync()
        if wg == 0:
            # Producer: one thread keeps `stages` k-tiles in flight. (Rows of A past M: the
            # TensorMap knows M, TMA fills them with zeros and still counts their bytes.)
            if tid == 0:
                for kt in range(k_tiles):
                    if kt >= stages:
                        # wait until the consumers released this slot's previous k-tile
                        T.cuda.mbarrier_wait(empty.ptr_to([kt % stages]), (kt // stages + 1) % 2)
                    T.tile.copy_async(
                        As[kt % stages, :, :],
                        A[by * bm_ : by * bm_ + bm_, kt * bk_ : kt * bk_ + bk_],
                        dispatch="tma_auto",
                        mbar=full.ptr_to([kt % stages]),
                    )
                    T.tile.copy_async(
                        Bs[kt % stages, :, :],
                        B[bx * bn_ : bx * bn_ + bn_, kt * bk_ : kt * bk_ + bk_],
                        dispatch="tma_auto",
                        mbar=full.ptr_to([kt % stages]),
                    )
                    T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](
                        full.ptr_to([kt % stages]), T.uint32(stage_bytes)
                    )
        else:
            # Consumers: warpgroup wg computes rows (wg - 1) * 64 .. + 64 of the block tile.
            acc = T.alloc_local((acc_regs,), "float32")
            desc_a = T.alloc_local((1,), "uint64")
            desc_b = T.alloc_local((1,), "uint64")
            for kt in range(k_tiles):
                T.cuda.mbarrier_wait(full.ptr_to([kt % stages]), (kt // stages) % 2)
                T.ptx.wgmma.fence.sync.aligned()
                for kk in T.unroll(k_steps):
                    T.cuda.wgmma.encode_matrix_descriptor(
                        desc_a.ptr_to([0]),
                        As.ptr_to([kt % stages, (wg - 1) * 64, kk * 16]),
                        lbo,
                        sbo,
                        desc_swizzle,
                    )
                    T.cuda.wgmma.encode_matrix_descriptor(
                        desc_b.ptr_to([0]),
                        Bs.ptr_to([kt % stages, 0, kk * 16]),
                        lbo,
                        sbo,
                        desc_swizzle,
                    )
                    # scale_d = 0 on the very first k16 step: D = A*B (no zero-fill needed)
                    T.ptx[mma](
                        *[acc[i] for i in range(acc_regs)],
                        desc_a[0],
                        desc_b[0],
                        kt * k_steps + kk > 0,
                        1,
                        1,
                        0,
                        0,
                    )
                T.ptx.wgmma.commit_group.sync.aligned()
                # keep this k-tile's wgmma group in flight; the previous one is done, so
                # its shared-memory slot goes back to the producer. After the last k-tile
                # wait for all, *inside* the loop: with wait_group(0) after the loop, ptxas
                # 13.0 scheduled the epilogue's first accumulator reads above it (an H200
                # gave wrong values in columns 0-39 of each tile).
                if kt == k_tiles - 1:
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                else:
                    T.ptx.wgmma.wait_group.sync.aligned(1)
                if kt > 0:
                    T.ptx["mbarrier.arrive.shared::cta.b64"](empty.ptr_to([(kt - 1) % stages]))
            bias_pair = T.alloc_local((2,), "float32")  # (read once for both rows)
            for j in T.unroll(bn_ // 8):
                row = T.meta_var(by * bm_ + (wg - 1) * 64 + (tid // 32) * 16 + (tid % 32) // 4)
                col = T.meta_var(bx * bn_ + j * 8 + (tid % 4) * 2)
                if bias:
                    bias_pair[0] = T.cast(bias_buf[col], "float32")
                    bias_pair[1] = T.cast(bias_buf[col + 1], "float32")
                for half in T.unroll(2):  # rows row and row + 8: registers 4j + 2 * half + (0, 1)
                    if row + half * 8 < m_rows:
                        T.cuda.func_call(
                            store_pair,
                            T.address_of(C[row + half * 8, col]),
                            epilogue_value(acc[j * 4 + half * 2], bias_pair[0]),
                            epilogue_value(acc[j * 4 + half * 2 + 1], bias_pair[1]),
                            source_code=store_pair_source,
                        )

    body = T.macro(body)

    if bias:

        @T.prim_func
        def main(a: T.handle, b: T.handle, bias_h: T.handle, c: T.handle):
            rows = T.int32() if m is None else m
            A = T.match_buffer(a, (rows, k), dtype)
            B = T.match_buffer(b, (n, k), dtype)
            Bias = T.match_buffer(bias_h, (n,), dtype)
            C = T.match_buffer(c, (rows, n), dtype)
            body(A, B, Bias, C, rows)

    else:

        @T.prim_func
        def main(a: T.handle, b: T.handle, c: T.handle):
            rows = T.int32() if m is None else m
            A = T.match_buffer(a, (rows, k), dtype)
            B = T.match_buffer(b, (n, k), dtype)
            C = T.match_buffer(c, (rows, n), dtype)
            body(A, B, None, C, rows)

    return main


def wgmma_gemm_module(m: int | None, n: int, k: int, **kwargs):
    """IRModule holding ``main`` (see :func:`wgmma_gemm_func`)."""
    import tvm

    return tvm.IRModule({"main": wgmma_gemm_func(m, n, k, **kwargs)})


def supports(spec) -> bool:
    """Whether this kernel computes ``spec`` (on an sm_90a GPU): a linear-shaped product
    (weight ``(N, K)``), fp16/bf16, bias per column or none, relu or no activation, N and K
    multiples of the block tile, the "gemm" variant (M > 16: the "gemv" one stays)."""
    cfg = WgmmaConfig()
    return (
        spec.dtype in PTX_TYPES
        and spec.b_layout == "nk"
        and spec.variant == "gemm"
        and spec.bias_axis == "n"
        and spec.activation in ("none", "relu")
        and spec.k is not None
        and spec.n % cfg.block_n == 0
        and spec.k % cfg.block_k == 0
    )


def schedule_gemm(spec):
    """The IRModule for ``spec`` (``supports(spec)``), M symbolic."""
    return wgmma_gemm_module(
        None,
        spec.n,
        spec.k,
        dtype=spec.dtype,
        bias=spec.bias,
        relu=spec.activation == "relu",
    )


def target():
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": ARCH})
