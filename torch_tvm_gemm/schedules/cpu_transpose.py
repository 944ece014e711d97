"""A 16 x 16 float32 transpose in AVX-512 registers, as a TensorIR intrinsic.

The packed kernel's pack of a "nk" weight (``cpu._transpose_in_tiles``) turns 16 x 16 tiles
of the weight around, from 16 rows of the weight to 16 rows of a panel. Left to LLVM, the
tile's 16 vector loads were taken apart in 128-bit pieces: ~12 shuffles and 4 narrow stores
per 16 values. The intrinsic spells the transpose out as four rounds of 16 two-input
shuffles (pairs of rows interleaved, then pairs of 64-bit halves, then 128-bit lanes twice),
which LLVM emits as vunpck*ps / vunpck*pd / vshuff64x2: 4 shuffles and one full store per
16 values. Its operands are the tile in the weight and in the panel, each with a row stride
of its own.
"""

from __future__ import annotations

import functools

SIZE = 16  # float32 values in an AVX-512 vector
NAME = "tvm_gemm_transpose_16x16_f32"


@functools.cache
def intrinsic() -> str:
    """Register (once) and name the transpose intrinsic."""
    from tvm.s_tir import TensorIntrin

    if TensorIntrin.get(NAME, allow_missing=True) is None:
        TensorIntrin.register(NAME, *_desc_impl())
    return NAME


def _desc_impl():
    from tvm import s_tir
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (SIZE, SIZE), "float32", offset_factor=1)
        C = T.match_buffer(c, (SIZE, SIZE), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(A[0:SIZE, 0:SIZE])
            T.writes(C[0:SIZE, 0:SIZE])
            for i, j in T.grid(SIZE, SIZE):
                with T.sblock("transpose"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vj, vi] = A[vi, vj]

    # The implementation's body (``_shuffles``) is built in Python: 16 loads, 64 shuffles and
    # 16 stores. TVMScript gives its signature and root block.
    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        sa, sc = T.int64(), T.int64()
        A = T.match_buffer(a, (SIZE, SIZE), "float32", offset_factor=1, strides=[sa, 1])
        C = T.match_buffer(c, (SIZE, SIZE), "float32", offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(A[0:SIZE, 0:SIZE])
            T.writes(C[0:SIZE, 0:SIZE])
            T.evaluate(0)

    realize, root = impl.body, impl.body.block
    body = _shuffles(*impl.params)  # buffers are typed variables
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                        root.alloc_buffers, root.match_buffers, root.annotations)  # fmt: skip
    return desc, impl.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, root))


def _shuffles(a, c):
    """Rows of ``a`` -> rows of ``c``, transposed: 16 vector loads, four rounds of shuffles,
    16 vector stores."""
    from tvm import tirx

    stmts = []
    row = tirx.Ramp(tirx.const(0, "int64"), tirx.const(1, "int64"), SIZE)

    def bind(name: str, value):
        var = tirx.Var(name, f"float32x{SIZE}")
        stmts.append(tirx.LetStmt(var, value))  # binds var for the statements after it
        return var

    def shuffle(x, y, indices: list[int]):  # indices into x's values then y's (0..31)
        return tirx.Shuffle([x, y], [tirx.const(i, "int32") for i in indices])

    def index(i: int):
        return tirx.const(i, "int64")

    r = [bind(f"r{i}", tirx.BufferLoad(a, [index(i), row])) for i in range(SIZE)]
    # Round 1: rows 2i and 2i + 1 interleaved within each 128-bit lane.
    t = []
    for i in range(0, SIZE, 2):
        t.append(bind(f"t{i}", shuffle(r[i], r[i + 1], _interleave(0))))
        t.append(bind(f"t{i + 1}", shuffle(r[i], r[i + 1], _interleave(2))))
    # Round 2: then u[4g + c], in its 128-bit lane L, holds column 4L + c of rows 4g .. 4g + 3.
    u = []
    for g in range(0, SIZE, 4):
        for first in (t[g], t[g + 1]):
            second = t[g + 2] if first is t[g] else t[g + 3]
            u.append(bind(f"u{len(u)}", shuffle(first, second, _pairs(0))))
            u.append(bind(f"u{len(u)}", shuffle(first, second, _pairs(2))))
    # Rounds 3 and 4: the lanes of the four groups of rows brought together. Column 4L + c is
    # lane L of u[c], u[4 + c], u[8 + c] and u[12 + c].
    for col in range(4):
        x = [bind(f"x{col}_{h}", shuffle(u[col], u[4 + col], _lanes(h))) for h in (0, 1)]
        y = [bind(f"y{col}_{h}", shuffle(u[8 + col], u[12 + col], _lanes(h))) for h in (0, 1)]
        for lane in range(4):
            value = shuffle(x[lane % 2], y[lane % 2], _lanes(lane // 2))
            stmts.append(tirx.BufferStore(c, value, [index(4 * lane + col), row]))
    return tirx.SeqStmt(stmts)


def _interleave(at: int) -> list[int]:
    """In each 128-bit lane, values ``at`` and ``at`` + 1 of the first vector, each followed
    by the same of the second (unpcklps: 0, unpckhps: 2)."""
    return [src + 4 * lane + at + j for lane in range(4) for j in (0, 1) for src in (0, SIZE)]


def _pairs(at: int) -> list[int]:
    """In each 128-bit lane, the 64-bit pair at ``at`` of the first vector, then of the
    second (unpcklpd: 0, unpckhpd: 2)."""
    return [src + 4 * lane + at + j for lane in range(4) for src in (0, SIZE) for j in (0, 1)]


def _lanes(odd: int) -> list[int]:
    """128-bit lanes 0 and 2 (``odd`` = 1: 1 and 3) of the first vector, then the same of the
    second (vshuff64x2 0x88 / 0xdd)."""
    return [src + 4 * lane + j for src in (0, SIZE) for lane in (odd, odd + 2) for j in range(4)]
