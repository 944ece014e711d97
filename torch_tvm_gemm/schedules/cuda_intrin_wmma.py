"""Tensor-core intrinsics of the WMMA schedule (sm_70 / sm_75) for ``schedules/cuda.py``.

Volta and Turing have no ldmatrix and no bf16 mma; their tensor cores are reached through
the CUDA C++ WMMA API (nvcuda::wmma::load_matrix_sync / mma_sync / store_matrix_sync on
16x16x16 fp16 fragments), which nvcc lowers to HMMA.884 (sm_70) or HMMA.1688 (sm_75). The
fragment layout is opaque, so the fragments keep their logical 16x16 shape in the
"wmma.matrix_a" / "wmma.matrix_b" / "wmma.accumulator" scopes, and TVM's codegen declares
them as wmma::fragment arrays. (TVM registers the same intrinsics in
tvm.s_tir.tensor_intrin.cuda, whose import parses ~100 intrinsics; these are the four we use.)
"""

from __future__ import annotations

import functools

from .cuda_intrin import TILE

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
