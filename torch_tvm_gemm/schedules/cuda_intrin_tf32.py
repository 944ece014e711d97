"""Tensor-core intrinsics of the TF32 schedule (fp32 inputs, sm_80+) for ``schedules/cuda.py``.

mma.sync.m16n8k8 with .tf32 operands: fp32 registers whose low 13 mantissa bits the tensor
core ignores (truncation; the inputs are not rounded first). One 16x16x16 step is four
instructions (2 K halves x 2 N halves). The accumulator map is the one above; A and B have
their own (PTX ISA, m16n8k8 .tf32: a0..a3 at (g, t), (g+8, t), (g, t+4), (g+8, t+4);
b0, b1 at k = t, t+4, n = g; g = lane // 4, t = lane % 4), with slots ordered so that each
instruction reads consecutive registers: A slots 4*kh..4*kh+3, B slots 4*kh+2*nh, +1.
Operands are read from shared memory with plain 32-bit loads (ldmatrix moves 16-bit
elements: it cannot transpose a [k, n] fp32 tile). The schedule pads the shared rows so
that the 32 lanes of each load hit 32 different banks.
"""

from __future__ import annotations

import functools

from .cuda_intrin import (
    SLOTS,
    TILE,
    WARP,
    accumulator_fill,
    accumulator_store,
    fragment_layout,
    lane_local,
)


def tf32_a_layout(i, k):
    """(lane, slot) of element (i, k) of a 16x16 A fragment."""
    return 4 * (i % 8) + k % 4, 4 * (k // 8) + 2 * ((k % 8) // 4) + i // 8


def tf32_b_layout(k, j):
    """(lane, slot) of element (k, j) of a 16x16 B fragment."""
    return 4 * (j % 8) + k % 4, 4 * (k // 8) + 2 * (j // 8) + (k % 8) // 4


def tf32_index_map(layout):
    """Index map for ``transform_layout``: (r, c) of a warp tile -> (tr, tc, lane, slot)."""

    def index_map(r, c):
        lane, slot = layout(r % TILE, c % TILE)
        return r // TILE, c // TILE, lane, slot

    return index_map


def tf32_a_element(lane, slot):
    """The inverse of ``tf32_a_layout``: (i, k) held by ``lane`` at ``slot``."""
    return lane // 4 + 8 * (slot % 2), lane % 4 + 4 * (slot // 2 % 2) + 8 * (slot // 4)


def tf32_b_element(lane, slot):
    """The inverse of ``tf32_b_layout``: (k, j) held by ``lane`` at ``slot``."""
    return lane % 4 + 4 * (slot % 2) + 8 * (slot // 4), lane // 4 + 8 * (slot // 2 % 2)


def _tf32_load(operand: str, k_major: bool):
    """shared.dyn 16x16 fp32 tile -> a "warp" fragment, each lane loading its 8 values.

    The fragment is indexed (i, k) for A and (k, j) for B; ``k_major``: the shared tile is
    stored [.., k] (A always; B when it is an ``nk`` weight, then indexed (j, k) there)."""
    from tvm.script import tirx as T

    if operand == "A":
        layout, element = tf32_a_layout, tf32_a_element
    elif k_major:  # shared (j, k) holds fragment element (k, j)

        def layout(j, k):
            return tf32_b_layout(k, j)

        def element(lane, slot):
            return tf32_b_element(lane, slot)[::-1]
    else:
        layout, element = tf32_b_layout, tf32_b_element

    @T.prim_func(s_tir=True)
    def desc(warp_h: T.handle, shared_h: T.handle) -> None:
        shared = T.match_buffer(
            shared_h, (TILE, TILE), "float32", align=64, offset_factor=TILE, scope="shared.dyn"
        )
        warp = T.match_buffer(
            warp_h, (WARP, SLOTS), "float32", align=64, offset_factor=TILE, scope="warp"
        )
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:SLOTS])
            for a0, a1 in T.grid(TILE, TILE):
                with T.sblock("load"):
                    v0, v1 = T.axis.remap("SS", [a0, a1])
                    lane, slot = T.meta_var(layout(v0, v1))
                    T.reads(shared[v0, v1])
                    T.writes(warp[lane, slot])
                    warp[lane, slot] = shared[v0, v1]

    @T.prim_func(s_tir=True)
    def impl(warp_h: T.handle, shared_h: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(
            shared_h,
            (TILE, TILE),
            "float32",
            align=64,
            offset_factor=TILE,
            scope="shared.dyn",
            strides=[s0, s1],
        )
        warp = T.match_buffer(
            warp_h, (WARP, SLOTS), "float32", align=64, offset_factor=TILE, scope="warp"
        )
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:SLOTS])
            # This lane's 8 registers, addressed per lane like the ldmatrix destinations
            # (see lane_local).
            regs = T.decl_buffer((WARP * SLOTS,), "float32", data=warp.data, scope="warp")
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for slot in T.unroll(SLOTS):
                    r, c = T.meta_var(element(tx, slot))
                    regs[lane_local(warp.elem_offset) + slot] = shared[r, c]

    return desc, impl


def _tf32_mma():
    """acc[16x16] += A[16x16] @ B[16x16] on fp32 fragments: four mma.sync.m16n8k8.tf32."""
    from tvm.script import tirx as T

    def frag(handle):
        return T.match_buffer(
            handle, (WARP, SLOTS), "float32", align=64, offset_factor=TILE, scope="warp"
        )

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = frag(a)
        B = frag(b)
        C = frag(c)
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS], A[0:WARP, 0:SLOTS], B[0:WARP, 0:SLOTS])
            T.writes(C[0:WARP, 0:SLOTS])
            for i, j, k in T.grid(TILE, TILE, TILE):
                with T.sblock("mma"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    lc, sc = T.meta_var(fragment_layout(vi, vj))
                    la, sa = T.meta_var(tf32_a_layout(vi, vk))
                    lb, sb = T.meta_var(tf32_b_layout(vk, vj))
                    T.reads(C[lc, sc], A[la, sa], B[lb, sb])
                    T.writes(C[lc, sc])
                    C[lc, sc] = C[lc, sc] + A[la, sa] * B[lb, sb]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = frag(a)
        B = frag(b)
        C = frag(c)
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS], A[0:WARP, 0:SLOTS], B[0:WARP, 0:SLOTS])
            T.writes(C[0:WARP, 0:SLOTS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for kh, nh in T.grid(2, 2):  # K halves x N halves, unrolled by nvcc
                    T.evaluate(
                        T.ptx_legacy.mma(
                            "m16n8k8",
                            "row",
                            "col",
                            "tf32",
                            "tf32",
                            "fp32",
                            A.data,
                            lane_local(A.elem_offset) + 4 * kh,
                            B.data,
                            lane_local(B.elem_offset) + 4 * kh + 2 * nh,
                            C.data,
                            C.elem_offset + tx * SLOTS + 4 * nh,
                            False,
                            dtype="float32",
                        )
                    )

    return desc, impl


@functools.cache
def tf32_intrinsics(b_k_major: bool) -> dict[str, str]:
    """Register (once) and name the TF32 intrinsics (fill and store: the fp32 ones above)."""
    from tvm.s_tir import TensorIntrin

    b = "nk" if b_k_major else "kn"
    makers = {
        "load_a": ("tvm_gemm_tf32_load_a", lambda: _tf32_load("A", True)),
        "load_b": (f"tvm_gemm_tf32_load_b_{b}", lambda: _tf32_load("B", b_k_major)),
        "compute": ("tvm_gemm_mma_tf32_f32", _tf32_mma),
        "init": ("tvm_gemm_mma_fill_f32", accumulator_fill),
        "store": ("tvm_gemm_mma_store_f32_shared_dyn", accumulator_store),
    }
    for name, make in makers.values():
        if TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *make())
    return {role: name for role, (name, _) in makers.items()}
