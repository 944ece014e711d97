"""Tensor-core intrinsics for ``schedules/cuda.py``: ldmatrix and mma.sync m16n8k16 in fp16
and bf16 (fp32 accumulation), reading operands from dynamic shared memory.

TVM 0.27 registers these for float16 only (``tvm.s_tir.tensor_intrin.cuda``); bf16 uses the
same 16-bit ldmatrix and the ``mma.sync ... .bf16.bf16.f32`` instruction, so we describe
both dtypes here with one generator each, plus the fill and store of the fp32 accumulator.

Fragment layout: a 16x16 tile of a 16-bit matrix is held by the 32 lanes of a warp, 8
elements per lane; element (i, j) lives in lane ``4 * (i % 8) + (j % 8) // 2`` at slot
``4 * (j // 8) + 2 * (i // 8) + j % 2`` (the PTX ISA's m16n8k16 register layout, two n8
halves side by side). The accumulator uses the same map.
"""

from __future__ import annotations

import functools

TILE = 16  # M, N and K of one tensorized step (two m16n8k16 instructions along N)
WARP = 32
SLOTS = TILE * TILE // WARP  # elements of a 16x16 fragment per lane
_ABBR = {"float16": "fp16", "bfloat16": "bf16"}


def fragment_layout(i, j):
    """(lane, slot) of element (i, j) of a 16x16 fragment."""
    return 4 * (i % 8) + (j % 8) // 2, 4 * (j // 8) + 2 * (i // 8) + j % 2


def fragment_index_map(i, j):
    """Index map for ``transform_layout``: (i, j) of a warp tile -> (ti, tj, lane, slot)."""
    lane, slot = fragment_layout(i % TILE, j % TILE)
    return i // TILE, j // TILE, lane, slot


def lane_local(elem_offset):
    """The per-lane offset of a fragment of an A / B operand buffer in "warp" scope.

    TVM 0.27's LowerWarpMemory rewrites only the first "warp" allocation of a kernel (here
    the accumulators, written through TVM's fill/store intrinsics): the operand fragments
    keep their whole-warp size (32 x 8 per fragment) and lane-qualified offsets
    (``elem_offset + 8 * lane``), which put them in local memory (spills). So the operand
    intrinsics address them per lane already: fragment f's 8 slots at ``8 * f``; the unused
    rest of the declared array is dead and nvcc keeps the live part in registers.
    """
    return elem_offset // WARP


def _ldmatrix(dtype: str, operand: str, k_major: bool):
    """ldmatrix.x4 loading one 16x16 fragment of ``operand`` ("A" or "B") from shared.dyn.

    ``k_major``: the shared tile is stored [.., k] with K contiguous (A always; B when it is
    an ``nk`` weight). A B stored [k, n] is loaded with ``.trans`` instead.
    """
    from tvm.script import tirx as T

    # Lane t gives the address of one 8-element row: rows 0-15 of the first 8 columns come
    # from lanes 0-15, of the second 8 columns from lanes 16-31 (matrices 0,1 / 2,3), except
    # for B stored [n, k], whose matrices are ordered n-half first.
    if operand == "B" and k_major:

        def offset(tx, stride):
            return stride * 8 * (tx // 16) + stride * (tx % 8) + 8 * ((tx % 16) // 8)
    else:

        def offset(tx, stride):
            return stride * (tx % 16) + 8 * (tx // 16)

    trans = operand == "B" and not k_major

    @T.prim_func(s_tir=True)
    def desc(warp_h: T.handle, shared_h: T.handle) -> None:
        shared = T.match_buffer(
            shared_h, (TILE, TILE), dtype, align=64, offset_factor=TILE, scope="shared.dyn"
        )
        warp = T.match_buffer(
            warp_h, (WARP, SLOTS), dtype, align=64, offset_factor=TILE, scope="warp"
        )
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:SLOTS])
            for a0, a1 in T.grid(TILE, TILE):
                with T.sblock("load"):
                    v0, v1 = T.axis.remap("SS", [a0, a1])
                    # The fragment is indexed (row, k) for A and (k, col) for B.
                    r, c = T.meta_var((v0, v1) if operand == "A" or not k_major else (v1, v0))
                    lane, slot = T.meta_var(fragment_layout(r, c))
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
            dtype,
            align=64,
            offset_factor=TILE,
            scope="shared.dyn",
            strides=[s0, s1],
        )
        warp = T.match_buffer(
            warp_h, (WARP, SLOTS), dtype, align=64, offset_factor=TILE, scope="warp"
        )
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:SLOTS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(
                    T.ptx_legacy.ldmatrix(
                        trans,
                        4,
                        ".b16",
                        warp.data,
                        lane_local(warp.elem_offset),
                        shared.access_ptr("r"),
                        offset(tx, s0),
                        dtype=dtype,
                    )
                )

    return desc, impl


def _mma(dtype: str):
    """acc[16x16] += A[16x16] @ B[16x16] on fragments: two mma.sync.m16n8k16 (n halves)."""
    from tvm.script import tirx as T

    ab = _ABBR[dtype]

    def frag(handle, dt):
        return T.match_buffer(handle, (WARP, SLOTS), dt, align=64, offset_factor=TILE, scope="warp")

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = frag(a, dtype)
        B = frag(b, dtype)
        C = frag(c, "float32")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS], A[0:WARP, 0:SLOTS], B[0:WARP, 0:SLOTS])
            T.writes(C[0:WARP, 0:SLOTS])
            for i, j, k in T.grid(TILE, TILE, TILE):
                with T.sblock("mma"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    lc, sc = T.meta_var(fragment_layout(vi, vj))
                    la, sa = T.meta_var(fragment_layout(vi, vk))
                    lb, sb = T.meta_var(fragment_layout(vk, vj))
                    T.reads(C[lc, sc], A[la, sa], B[lb, sb])
                    T.writes(C[lc, sc])
                    C[lc, sc] = C[lc, sc] + T.Cast("float32", A[la, sa]) * T.Cast(
                        "float32", B[lb, sb]
                    )

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = frag(a, dtype)
        B = frag(b, dtype)
        C = frag(c, "float32")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS], A[0:WARP, 0:SLOTS], B[0:WARP, 0:SLOTS])
            T.writes(C[0:WARP, 0:SLOTS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for half in T.unroll(2):  # columns 0-7, then 8-15
                    T.evaluate(
                        T.ptx_legacy.mma(
                            "m16n8k16",
                            "row",
                            "col",
                            ab,
                            ab,
                            "fp32",
                            A.data,
                            lane_local(A.elem_offset),
                            B.data,
                            lane_local(B.elem_offset) + half * (SLOTS // 2),
                            C.data,
                            C.elem_offset + tx * SLOTS + half * (SLOTS // 2),
                            False,
                            dtype="float32",
                        )
                    )

    return desc, impl


def accumulator_fill():
    """Zero a 16x16 fp32 accumulator fragment."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, SLOTS), "float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:SLOTS])
            for a0, a1 in T.grid(TILE, TILE):
                with T.sblock("fill"):
                    i, j = T.axis.remap("SS", [a0, a1])
                    lane, slot = T.meta_var(fragment_layout(i, j))
                    T.reads()
                    T.writes(C[lane, slot])
                    C[lane, slot] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, SLOTS), "float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:SLOTS])
            for _tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(SLOTS, C.data, C.elem_offset, dtype="float32"))

    return desc, impl


def accumulator_store():
    """Write a 16x16 fp32 accumulator fragment to shared.dyn (each lane its 8 values)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(c_frag: T.handle, c: T.handle) -> None:
        F = T.match_buffer(c_frag, (WARP, SLOTS), "float32", scope="warp")
        C = T.match_buffer(c, (TILE, TILE), "float32", scope="shared.dyn")
        with T.sblock("root"):
            T.reads(F[0:WARP, 0:SLOTS])
            T.writes(C[0:TILE, 0:TILE])
            for a0, a1 in T.grid(TILE, TILE):
                with T.sblock("store"):
                    i, j = T.axis.remap("SS", [a0, a1])
                    lane, slot = T.meta_var(fragment_layout(i, j))
                    T.reads(F[lane, slot])
                    T.writes(C[i, j])
                    C[i, j] = F[lane, slot]

    @T.prim_func(s_tir=True)
    def impl(c_frag: T.handle, c: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        F = T.match_buffer(c_frag, (WARP, SLOTS), "float32", scope="warp", offset_factor=1)
        C = T.match_buffer(
            c, (TILE, TILE), "float32", scope="shared.dyn", offset_factor=1, strides=[s0, s1]
        )
        with T.sblock("root"):
            T.reads(F[0:WARP, 0:SLOTS])
            T.writes(C[0:TILE, 0:TILE])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for slot in T.serial(SLOTS):  # the inverse of fragment_layout for this lane
                    C[8 * (slot % 4 // 2) + tx // 4, 8 * (slot // 4) + tx % 4 * 2 + slot % 2] = F[
                        tx, slot
                    ]

    return desc, impl


@functools.cache
def intrinsics(dtype: str, b_k_major: bool) -> dict[str, str]:
    """Register (once) and name the intrinsics for one operand dtype and B layout."""
    # (Not tvm.s_tir.tensor_intrin.cuda: importing it parses ~100 intrinsics, 18 s.)
    from tvm.s_tir import TensorIntrin

    ab = _ABBR[dtype]
    names = {
        "load_a": f"tvm_gemm_ldmatrix_{ab}_a",
        "load_b": f"tvm_gemm_ldmatrix_{ab}_b_{'nk' if b_k_major else 'kn'}",
        "compute": f"tvm_gemm_mma_{ab}_f32",
        "init": "tvm_gemm_mma_fill_f32",
        "store": "tvm_gemm_mma_store_f32_shared_dyn",
    }
    makers = {
        "load_a": lambda: _ldmatrix(dtype, "A", True),
        "load_b": lambda: _ldmatrix(dtype, "B", b_k_major),
        "compute": lambda: _mma(dtype),
        "init": accumulator_fill,
        "store": accumulator_store,
    }
    for role, name in names.items():
        if TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *makers[role]())
    return names
