"""A software prefetch in the packed kernel's pack of a "nk" weight (``prefetch_pack_reads``).

The pack (``cpu._transpose_in_tiles``) reads VEC rows of the weight at a time, a VEC x VEC
tile per step along K. From L3, where a model's weights are, it ran far below the L3's rate
for one core: on one thread of the Intel Xeon, a ring of eight 768 x 768 weights packed at
~6 GB/s, where a plain sum over the same ring read 26 GB/s. Each step now first asks for
the lines AHEAD values further along the same rows (past the end of the rows, the same place
in the next VEC rows, which the pack reads next).

Measured (kernels alone, a ring of 8 weights and inputs, against F.linear, 2 threads, Intel
Xeon, two runs, the packed kernel over "nk" weights of BERT and LLaMA-style layers: 768 x
768, 3072 x 768, 768 x 3072, 512 x 512, 1376 x 512, 512 x 1376): M = 128 -2% to +6% (10 of
the 12 readings +0.6% or more), M = 256 -0.4% to +3.5%, M = 1024 -2.5% to +4%; the pack
alone (M = 6, one thread, 768 x 768) +22%. 128 values ahead measured about the same, with
two readings at -10%; 256 and 512, +18% and +13% on the pack alone.

TensorIR's schedule primitives cannot place a prefetch, so it is added to the scheduled
module: the loop over the tiles along K gets, first in its body, VEC prefetches."""

from __future__ import annotations

AHEAD = 64  # values ahead along a row (4 cache lines of float32: 4 tiles)


def prefetch_pack_reads(mod, k_tiles, rows_in_tile, vec: int):
    """``mod`` with the prefetches above. ``k_tiles``: the loop variable of the pack's loop
    over tiles along K; ``rows_in_tile``: that of its (unrolled) loop over a tile's rows."""
    from tvm import s_tir, tirx

    func = mod["main"]
    b = func.params[1]  # buffers are typed variables: the weight, (N, K)
    n, k = b.ty.shape
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    row = _pack_row(func.body)
    at = k_tiles * i64(vec) + i64(AHEAD)
    index = [tirx.min(row + i64(vec) * (at // k), n - i64(1)), at % k]
    read, keep, data = (tirx.const(v, "int32") for v in (0, 3, 1))
    address = tirx.address_of(tirx.BufferLoad(b, index))
    prefetch = tirx.Evaluate(
        tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, read, keep, data)
    )
    # The prefetch loop reuses the rows' loop variable, then gets its own (renew_defs).
    loop = tirx.For(rows_in_tile, i64(0), i64(vec), tirx.ForKind.UNROLLED, prefetch)
    loop = s_tir.renew_defs(tirx.PrimFunc([], loop)).body

    def rewrite(stmt):
        if isinstance(stmt, tirx.For):
            if stmt.loop_var.same_as(k_tiles):
                return _with_body(stmt, tirx.SeqStmt([loop, stmt.body]))
            body = rewrite(stmt.body)
            return stmt if body.same_as(stmt.body) else _with_body(stmt, body)
        if isinstance(stmt, tirx.SeqStmt):
            seq = [rewrite(s) for s in stmt.seq]
            if all(new.same_as(old) for new, old in zip(seq, stmt.seq, strict=True)):
                return stmt
            return tirx.SeqStmt(seq)
        if isinstance(stmt, s_tir.SBlockRealize):
            block = rewrite(stmt.block)
            if block.same_as(stmt.block):
                return stmt
            return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, block)
        if isinstance(stmt, s_tir.SBlock):
            body = rewrite(stmt.body)
            if body.same_as(stmt.body):
                return stmt
            return s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body,
                                stmt.init, stmt.alloc_buffers, stmt.match_buffers,
                                stmt.annotations)  # fmt: skip
        return stmt

    body = rewrite(func.body)
    if body.same_as(func.body):
        raise RuntimeError("prefetch_pack_reads: the pack's loop over K tiles was not found")
    mod["main"] = func.with_body(body)
    return mod


def _pack_row(stmt):
    """The row of the weight the pack ("B_pad") reads: its first binding."""
    from tvm import s_tir, tirx

    if isinstance(stmt, s_tir.SBlockRealize):
        if stmt.block.name_hint == "B_pad":
            return stmt.iter_values[0]
        return _pack_row(stmt.block.body)
    if isinstance(stmt, s_tir.SBlock | tirx.For):
        return _pack_row(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            found = _pack_row(s)
            if found is not None:
                return found
    return None


def _with_body(loop, body):
    from tvm import tirx

    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                    loop.annotations)  # fmt: skip
