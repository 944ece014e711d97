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


def _fill():
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


def _store():
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
        "init": _fill,
        "store": _store,
    }
    for role, name in names.items():
        if TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *makers[role]())
    return names


# --- WMMA (sm_70 / sm_75) -------------------------------------------------------------------
#
# Volta and Turing have no ldmatrix and no bf16 mma; their tensor cores are reached through
# the CUDA C++ WMMA API (nvcuda::wmma::load_matrix_sync / mma_sync / store_matrix_sync on
# 16x16x16 fp16 fragments), which nvcc lowers to HMMA.884 (sm_70) or HMMA.1688 (sm_75). The
# fragment layout is opaque, so the fragments keep their logical 16x16 shape in the
# "wmma.matrix_a" / "wmma.matrix_b" / "wmma.accumulator" scopes, and TVM's codegen declares
# them as wmma::fragment arrays. (TVM registers the same intrinsics in
# tvm.s_tir.tensor_intrin.cuda, whose import parses ~100 intrinsics; these are the four we use.)

WMMA_SCOPE = {"A": "wmma.matrix_a", "B": "wmma.matrix_b", "C": "wmma.accumulator"}


def _wmma_fragment_index(buf, stride):
    """Index of the 16x16 fragment that ``buf`` views in its fragment array (row-major,
    ``stride`` elements per row): TVM's codegen turns the array into wmma::fragment[n]."""
    return buf.elem_offset // stride // TILE * (stride // TILE) + buf.elem_offset % stride // TILE


def _wmma_load(operand: str, col_major: bool):
    """shared.dyn 16x16 fp16 tile -> an A or B fragment. ``col_major``: B stored [n, k]
    (an ``nk`` weight); the tile is then indexed (n, k) on both sides."""
    from tvm.script import tirx as T

    scope, layout = WMMA_SCOPE[operand], "col_major" if col_major else "row_major"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(
            a, (TILE, TILE), "float16", align=64, offset_factor=TILE, scope="shared.dyn"
        )
        C = T.match_buffer(c, (TILE, TILE), "float16", align=64, offset_factor=TILE, scope=scope)
        with T.sblock("root"):
            T.reads(A[0:TILE, 0:TILE])
            T.writes(C[0:TILE, 0:TILE])
            for i, j in T.grid(TILE, TILE):
                with T.sblock("load"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1, s0, d1, d0 = T.int32(), T.int32(), T.int32(), T.int32()
        A = T.match_buffer(
            a,
            (TILE, TILE),
            "float16",
            align=64,
            offset_factor=TILE,
            scope="shared.dyn",
            strides=[s1, s0],
        )
        C = T.match_buffer(
            c, (TILE, TILE), "float16", align=64, offset_factor=TILE, scope=scope, strides=[d1, d0]
        )
        with T.sblock("root"):
            T.reads(A[0:TILE, 0:TILE])
            T.writes(C[0:TILE, 0:TILE])
            T.evaluate(
                T.tvm_load_matrix_sync(
                    C.data,
                    TILE,
                    TILE,
                    TILE,
                    _wmma_fragment_index(C, d1),
                    A.access_ptr("r", ptr_type="float16"),
                    s1,
                    layout,
                    dtype="void",
                )
            )

    return desc, impl


def _wmma_mma(b_k_major: bool):
    """acc[16x16] (fp32) += A[16x16] @ B[16x16] (fp16); B indexed (n, k) when ``b_k_major``."""
    from tvm.script import tirx as T

    def frag(handle, dt, role):
        return T.match_buffer(
            handle, (TILE, TILE), dt, align=64, offset_factor=TILE, scope=WMMA_SCOPE[role]
        )

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A, B, C = frag(a, "float16", "A"), frag(b, "float16", "B"), frag(c, "float32", "C")
        with T.sblock("root"):
            T.reads(C[0:TILE, 0:TILE], A[0:TILE, 0:TILE], B[0:TILE, 0:TILE])
            T.writes(C[0:TILE, 0:TILE])
            for i, j, k in T.grid(TILE, TILE, TILE):
                with T.sblock("mma"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    b0, b1 = T.meta_var((vj, vk) if b_k_major else (vk, vj))
                    C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast(
                        "float32", B[b0, b1]
                    )

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        a1, a0 = T.int32(), T.int32()
        b1, b0 = T.int32(), T.int32()
        c1, c0 = T.int32(), T.int32()
        A = T.match_buffer(
            a,
            (TILE, TILE),
            "float16",
            align=64,
            offset_factor=TILE,
            scope=WMMA_SCOPE["A"],
            strides=[a1, a0],
        )
        B = T.match_buffer(
            b,
            (TILE, TILE),
            "float16",
            align=64,
            offset_factor=TILE,
            scope=WMMA_SCOPE["B"],
            strides=[b1, b0],
        )
        C = T.match_buffer(
            c,
            (TILE, TILE),
            "float32",
            align=64,
            offset_factor=TILE,
            scope=WMMA_SCOPE["C"],
            strides=[c1, c0],
        )
        with T.sblock("root"):
            T.reads(C[0:TILE, 0:TILE], A[0:TILE, 0:TILE], B[0:TILE, 0:TILE])
            T.writes(C[0:TILE, 0:TILE])
            T.evaluate(
                T.tvm_mma_sync(
                    C.data,
                    _wmma_fragment_index(C, c1),
                    A.data,
                    _wmma_fragment_index(A, a1),
                    B.data,
                    _wmma_fragment_index(B, b1),
                    C.data,
                    _wmma_fragment_index(C, c1),
                    dtype="void",
                )
            )

    return desc, impl


def _wmma_fill():
    """Zero a 16x16 fp32 accumulator fragment."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(
            c, (TILE, TILE), "float32", align=64, offset_factor=TILE, scope=WMMA_SCOPE["C"]
        )
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:TILE, 0:TILE])
            for i, j in T.grid(TILE, TILE):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        d1, d0 = T.int32(), T.int32()
        C = T.match_buffer(
            c,
            (TILE, TILE),
            "float32",
            align=64,
            offset_factor=TILE,
            scope=WMMA_SCOPE["C"],
            strides=[d1, d0],
        )
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:TILE, 0:TILE])
            T.evaluate(
                T.tvm_fill_fragment(
                    C.data,
                    TILE,
                    TILE,
                    TILE,
                    _wmma_fragment_index(C, d1),
                    T.float32(0),
                    dtype="void",
                )
            )

    return desc, impl


def _wmma_store():
    """A 16x16 fp32 accumulator fragment -> shared.dyn (row-major)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(
            a, (TILE, TILE), "float32", align=64, offset_factor=TILE, scope=WMMA_SCOPE["C"]
        )
        C = T.match_buffer(
            c, (TILE, TILE), "float32", align=64, offset_factor=TILE, scope="shared.dyn"
        )
        with T.sblock("root"):
            T.reads(A[0:TILE, 0:TILE])
            T.writes(C[0:TILE, 0:TILE])
            for i, j in T.grid(TILE, TILE):
                with T.sblock("store"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1, s0, d1, d0 = T.int32(), T.int32(), T.int32(), T.int32()
        A = T.match_buffer(
            a,
            (TILE, TILE),
            "float32",
            align=64,
            offset_factor=TILE,
            scope=WMMA_SCOPE["C"],
            strides=[d1, d0],
        )
        C = T.match_buffer(
            c,
            (TILE, TILE),
            "float32",
            align=64,
            offset_factor=TILE,
            scope="shared.dyn",
            strides=[s1, s0],
        )
        with T.sblock("root"):
            T.reads(A[0:TILE, 0:TILE])
            T.writes(C[0:TILE, 0:TILE])
            T.evaluate(
                T.tvm_store_matrix_sync(
                    A.data,
                    TILE,
                    TILE,
                    TILE,
                    _wmma_fragment_index(A, d1),
                    C.access_ptr("w", ptr_type="float32"),
                    s1,
                    "row_major",
                    dtype="void",
                )
            )

    return desc, impl


@functools.cache
def wmma_intrinsics(b_k_major: bool) -> dict[str, str]:
    """Register (once) and name the WMMA intrinsics (fp16 in, fp32 accumulation)."""
    from tvm.s_tir import TensorIntrin

    b = "nk" if b_k_major else "kn"
    makers = {
        "load_a": ("tvm_gemm_wmma_load_a", lambda: _wmma_load("A", False)),
        "load_b": (f"tvm_gemm_wmma_load_b_{b}", lambda: _wmma_load("B", b_k_major)),
        "compute": (f"tvm_gemm_wmma_f16_f32_{b}", lambda: _wmma_mma(b_k_major)),
        "init": ("tvm_gemm_wmma_fill_f32", _wmma_fill),
        "store": ("tvm_gemm_wmma_store_f32_shared_dyn", _wmma_store),
    }
    for name, make in makers.values():
        if TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *make())
    return {role: name for role, (name, _) in makers.items()}


# --- TF32 (fp32 inputs, sm_80+) ---------------------------------------------------------------
#
# mma.sync.m16n8k8 with .tf32 operands: fp32 registers whose low 13 mantissa bits the tensor
# core ignores (truncation; the inputs are not rounded first). One 16x16x16 step is four
# instructions (2 K halves x 2 N halves). The accumulator map is the one above; A and B have
# their own (PTX ISA, m16n8k8 .tf32: a0..a3 at (g, t), (g+8, t), (g, t+4), (g+8, t+4);
# b0, b1 at k = t, t+4, n = g; g = lane // 4, t = lane % 4), with slots ordered so that each
# instruction reads consecutive registers: A slots 4*kh..4*kh+3, B slots 4*kh+2*nh, +1.
#
# Operands are read from shared memory with plain 32-bit loads (ldmatrix moves 16-bit
# elements: it cannot transpose a [k, n] fp32 tile). The schedule pads the shared rows so
# that the 32 lanes of each load hit 32 different banks.


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
        "init": ("tvm_gemm_mma_fill_f32", _fill),
        "store": ("tvm_gemm_mma_store_f32_shared_dyn", _store),
    }
    for name, make in makers.values():
        if TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *make())
    return {role: name for role, (name, _) in makers.items()}
