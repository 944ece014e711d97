"""A first Hopper (sm_90a) GEMM: TMA loads + wgmma, written in TVM 0.27's TIRx.

Not the default CUDA path (that is ``schedules/cuda.py``: ldmatrix + mma.sync, which also
runs on sm_90). This module builds one fixed-shape kernel

    C[M, N] = A[M, K] @ B[N, K]^T  (+ bias[N]) (relu)      fp16 in, fp32 accumulate, fp16 out

i.e. ``torch.nn.functional.linear`` with both operands K-major, which is wgmma's native
layout (no transpose bits). M, N, K must be multiples of the block tile.

How it is written (TVM 0.27, ``tir_pipeline="tirx"``):

- TMA: the TIRx tile primitive ``T.tile.copy_async(smem_region, global_region,
  dispatch="tma_auto", mbar=...)``. It plans the TensorMap (box 64 x rows, 128-byte swizzle,
  read off the shared buffer's layout from ``tma_utils.mma_shared_layout``), makes the host
  encode it (``runtime.cuTensorMapEncodeTiled``, in ``libtvm_runtime_cuda.so``) and passes
  it as a ``__grid_constant__ CUtensorMap`` kernel parameter -> ``UTMALDG.2D`` in SASS.
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
  cast to fp16 and stored straight to global (optionally + bias, relu).

Checked without a GPU: ``tests/test_cuda_wgmma.py`` builds it with nvcc for sm_90a and reads
the SASS (HGMMA, UTMALDG, no local-memory spills, no wgmma serialization). Never run on a
GPU yet: see docs/wgmma.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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

    def validate(self, m: int, n: int, k: int) -> None:
        if self.block_m % 64 or not 64 <= self.block_m <= 256:
            raise ValueError("block_m must be 64, 128, 192 or 256 (64 rows per warpgroup)")
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError("block_n must be a multiple of 8 in [8, 256] (wgmma N)")
        if self.block_k != 64:
            raise ValueError("block_k must be 64 (one 128-byte swizzle row of fp16)")
        if self.stages < 2:
            raise ValueError("stages must be >= 2")
        if m % self.block_m or n % self.block_n or k % self.block_k:
            raise ValueError(
                f"wgmma kernel needs M, N, K multiples of the tile "
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


def wgmma_gemm_func(
    m: int,
    n: int,
    k: int,
    *,
    bias: bool = False,
    relu: bool = False,
    cfg: WgmmaConfig | None = None,
):
    """The TIRx PrimFunc of the kernel: (A[m,k], B[n,k], [bias[n],] C[m,n]), all fp16."""
    from tvm.backend.cuda.tile_primitive.tma_utils import SwizzleMode, mma_shared_layout
    from tvm.script import tirx as T

    cfg = cfg or WgmmaConfig()
    cfg.validate(m, n, k)
    bm_, bn_, bk_, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    consumers = cfg.consumers
    k_tiles = k // bk_
    acc_regs = bn_ // 2  # m64nNk16 f32 accumulator: N/2 registers per thread
    k_steps = bk_ // 16
    stage_bytes = (bm_ + bn_) * bk_ * 2
    swizzle = SwizzleMode.SWIZZLE_128B_ATOM
    a_layout = mma_shared_layout("float16", swizzle, (stages, bm_, bk_))
    b_layout = mma_shared_layout("float16", swizzle, (stages, bn_, bk_))
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn_}k16.f32.f16.f16"
    # Matrix descriptor of a K-major operand in 128B-swizzled rows of 64 fp16: leading byte
    # offset unused (1), stride byte offset = 8 rows * 128 B = 1024 B (in 16-byte units: 64),
    # swizzle 3 = 128B. A k16 step moves the start address by 32 bytes inside the row.
    lbo, sbo, desc_swizzle = 1, 64, 3

    def epilogue_value(acc_value, col, bias_buf):
        if bias:
            acc_value = acc_value + T.cast(bias_buf[col], "float32")
        if relu:
            # (not max(x, 0), which turns NaN into 0: see kernels/epilogue.py)
            acc_value = T.Select(acc_value < T.float32(0), T.float32(0), acc_value)
        return T.cast(acc_value, "float16")

    def body(A, B, bias_buf, C):
        # The body is shared by the two signatures below (with and without bias).
        T.device_entry()
        bx, by = T.cta_id([n // bn_, m // bm_])
        wg = T.warpgroup_id([consumers + 1])
        tid = T.thread_id_in_wg([128])
        pool = T.SMEMPool()
        full = pool.alloc((stages,), "uint64", align=8)
        empty = pool.alloc((stages,), "uint64", align=8)
        pool.move_base_to(1024)
        As = pool.alloc((stages, bm_, bk_), "float16", align=1024, layout=a_layout)
        Bs = pool.alloc((stages, bn_, bk_), "float16", align=1024, layout=b_layout)
        pool.commit()
        if wg == 0 and tid == 0:
            for s in range(stages):
                T.ptx["mbarrier.init.shared::cta.b64"](full.ptr_to([s]), T.uint32(1))
                T.ptx["mbarrier.init.shared::cta.b64"](empty.ptr_to([s]), T.uint32(consumers * 128))
        T.ptx["fence.proxy.async.shared::cta"]()
        T.ptx["fence.mbarrier_init.release.cluster"]()
        T.cuda.cta_sync()
        if wg == 0:
            # Producer: one thread keeps `stages` k-tiles in flight.
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
            for j in T.unroll(bn_ // 8):
                row = T.meta_var(by * bm_ + (wg - 1) * 64 + (tid // 32) * 16 + (tid % 32) // 4)
                col = T.meta_var(bx * bn_ + j * 8 + (tid % 4) * 2)
                C[row, col] = epilogue_value(acc[j * 4], col, bias_buf)
                C[row, col + 1] = epilogue_value(acc[j * 4 + 1], col + 1, bias_buf)
                C[row + 8, col] = epilogue_value(acc[j * 4 + 2], col, bias_buf)
                C[row + 8, col + 1] = epilogue_value(acc[j * 4 + 3], col + 1, bias_buf)

    body = T.macro(body)

    if bias:

        @T.prim_func
        def wgmma_gemm(
            A: T.Buffer((m, k), "float16"),
            B: T.Buffer((n, k), "float16"),
            Bias: T.Buffer((n,), "float16"),
            C: T.Buffer((m, n), "float16"),
        ):
            body(A, B, Bias, C)

    else:

        @T.prim_func
        def wgmma_gemm(
            A: T.Buffer((m, k), "float16"),
            B: T.Buffer((n, k), "float16"),
            C: T.Buffer((m, n), "float16"),
        ):
            body(A, B, None, C)

    return wgmma_gemm


def wgmma_gemm_module(m: int, n: int, k: int, **kwargs):
    """IRModule holding ``wgmma_gemm`` (see :func:`wgmma_gemm_func`)."""
    import tvm

    return tvm.IRModule({"wgmma_gemm": wgmma_gemm_func(m, n, k, **kwargs)})


def target():
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": ARCH})
