"""The packed kernels' last tile of rows, cut to the rows that are left.

The packed kernels (``cpu._schedule_packed``, "gemm" and "rows", the batched one, and the
K-blocked one, whose tiles sum a chunk of K at a time) pad M to whole register tiles of MR
rows, and every tile sums all MR rows: at M = 128 (a transformer at batch 1, or attention's
S = 128 in each batch entry) the 6-row tile runs 132 rows, 3% of the products on padding.
Each tile of rows now picks one of three copies of its product loop (the loop over K) by
the rows it has left: the whole tile, or a tail of 2 MR / 3 or MR / 3 rows (4 or 2 of 6),
the fewest that cover them. The tile's init and store are not copied (the store already
skips rows past M; with a copy of its store a gelu kernel took 28 s to build instead of
8.4).

Kernels alone, weights (or the batched operands) cycled through 8 copies, 2 threads, Intel
Xeon (Emerald Rapids), both builds loaded in one process and called in turn, each order
once, time with the tails over time without, M = 128: 768 x 768 0.97 / 0.98, 3072 x 768
0.98 / 0.98, 1376 x 512 1.00 / 0.96, 512 x 512 0.99 / 0.99, "kn" 2304 x 768 0.97 / 0.95;
K = 64 (256 x 64, 768 x 64) 0.99-1.03; attention at S = 128, B*H = 12 and 96, two runs:
`P @ V` 0.90-0.98, `Q @ K^T` 0.99-1.02; the K-blocked kernel, N = 4096 K = 11008 (two
weights of 180 MB), M = 128 0.98 / 0.89, M = 64 0.99 / 0.98.

TensorIR cannot pick a loop by a run-time row count (one block, one loop nest), so the
copies are made on the scheduled module, as ``cpu_pack_prefetch`` adds its prefetches; the
copies' loop and block variables are then made distinct by ``ConvertSSA``.
"""

from __future__ import annotations

from .tir_rewrite import block_bindings, replace_loops, with_body


def tail_rows(mr: int) -> tuple[int, ...]:
    """The two tails' row counts for a tile of ``mr`` rows, the larger first (none where
    ``mr`` is not a multiple of 3)."""
    return (2 * mr // 3, mr // 3) if mr % 3 == 0 and mr >= 3 else ()


def cut_last_tiles(mod, mr: int, blocks: tuple[str, str] = ("acc_init", "acc_update")):
    """``mod`` (a scheduled packed kernel, register tiles of ``mr`` rows, its output the last
    parameter, M its second last dimension) with each tile of rows running only the rows it
    has left, in copies of its product loop (see above). ``blocks``: the tile's init and
    product blocks (the K-blocked kernel's: "partial_init", "partial_update"). Raises
    RuntimeError where the tile loop is not found (a schedule change this rewrite does not
    know)."""
    from tvm import s_tir, tirx

    tails = tail_rows(mr)
    if not tails:
        return mod
    out = mod["main"].params[-1]
    m = out.ty.shape[-2]
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731  (the kernel's indices)

    def replace(loop):
        parts = loop.body.seq if isinstance(loop.body, tirx.SeqStmt) else []
        if len(parts) < 3:
            return None
        init, product, stores = parts[0], parts[1], parts[2:]
        if not (_names(init) == {blocks[0]} and _names(product) == {blocks[1]}):
            return None
        if any(_names(store) & set(blocks) for store in stores):
            return None
        # The tile's first row: the product's row binding (tile base * MR + row in the tile).
        row = block_bindings(product, blocks[1])[-3]  # (..., row, column, k)
        if not isinstance(row, tirx.Add):
            raise RuntimeError(f"cpu_tail_tile: the tile's row binding has another shape: {row}")
        rows_left = m - row.a
        # the whole tile where more rows are left than the larger tail has, else the smaller
        # of the tails that covers them; the init and the store once, around the choice
        big, small = tails
        tail = tirx.IfThenElse(
            rows_left > i64(small), _rows_cut(product, mr, big), _rows_cut(product, mr, small)
        )
        choice = tirx.IfThenElse(rows_left > i64(big), product, tail)
        body = tirx.SeqStmt([init, choice, *stores])
        return with_body(loop, body)

    mod, found = replace_loops(mod, replace)
    if not found:
        raise RuntimeError("cpu_tail_tile: the packed kernel's tile loop was not found")
    return s_tir.transform.ConvertSSA()(mod)


def _rows_cut(product, mr: int, rows: int):
    """The product loop (over K) with its loop over the tile's ``mr`` rows cut to ``rows``."""
    import tvm
    from tvm import tirx

    def cut(loop):
        unrolled = loop.kind == tirx.ForKind.UNROLLED and isinstance(loop.extent, tirx.IntImm)
        if unrolled and int(loop.extent) == mr:
            return tirx.For(loop.loop_var, loop.min, tirx.const(rows, "int64"),
                            loop.kind, loop.body, loop.thread_binding, loop.annotations)  # fmt: skip
        return None

    # (replace_loops walks a module: the product loop alone, wrapped in one)
    wrapped = tvm.IRModule({"main": tirx.PrimFunc([], product)})
    wrapped, found = replace_loops(wrapped, cut)
    if not found:
        raise RuntimeError("cpu_tail_tile: the tile's loop over its rows was not found")
    return wrapped["main"].body


def _names(stmt) -> set[str]:
    """The names of the blocks in ``stmt``."""
    from tvm import s_tir, tirx

    if isinstance(stmt, s_tir.SBlockRealize):
        return {stmt.block.name_hint} | _names(stmt.block.body)
    if isinstance(stmt, s_tir.SBlock | tirx.For):
        return _names(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        return set().union(*(_names(s) for s in stmt.seq))
    if isinstance(stmt, tirx.IfThenElse):
        return _names(stmt.then_case) | (_names(stmt.else_case) if stmt.else_case else set())
    return set()
