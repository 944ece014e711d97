"""The packed kernel's tile store where N is no whole number of vectors: whole panels apart.

The output stage ("out") stores each MR x NR register tile with a predicate that holds the
rows below M and the columns below N. Where N is not a multiple of the vector width, the
column test depends on the vector lane, and TVM then stores the tile one value at a time
unless it can split the loop itself, which it could not once the tasks ran in halves of the
panels (``cpu.task_order``: the panel index then comes out of a division by the symbolic
chunk count). ``split_full_panels`` gives every tile two copies of its store: where the whole
panel lies below N (all panels but the last), the copy without the column test, whose
vectors are stored whole; else the store value by value, its rows' test taken out of the
loops over the columns. A task runs every row tile of its chunk of rows (up to 1032 rows)
whatever M is, and a row tile below M stores nothing: with that test tested for each of a
tile's MR x NR values, the task of the last panel spent ~37 us a call on row tiles past M
(measured, 2 threads, AMD EPYC: linear 64 -> 440 at M = 1 to 192, 43-67 us against 6-32
us for 64 -> 448; 6-32 us with the test taken out).

TensorIR cannot express this (one block, one predicate), so it is done on the scheduled
module, as ``cpu_pack_prefetch`` adds its prefetches.
"""

from __future__ import annotations

from .tir_rewrite import fresh_copy, replace_loops, with_body


def split_full_panels(mod, n: int, nr: int):
    """``mod`` (the scheduled packed kernel, its output N columns wide) with its tile store
    split as above (left as it is where its predicate has another shape: right, only slower;
    the tests check that the split is made)."""
    return replace_loops(mod, lambda loop: _split_store(loop, n, nr))[0]


def splits(mod) -> bool:
    """Whether ``mod``'s tile store has its whole-panel copy, and the other copy its rows'
    test outside its column loops (for tests: read off the printed module)."""
    text = mod.script()
    lines = [line.strip() for line in text.splitlines()]
    rows_first = any(
        line == "else:" and lines[i + 1].startswith("for ") and lines[i + 2].startswith("if ")
        for i, line in enumerate(lines[:-2])
    )
    return text.count('T.sblock("out")') == 2 and rows_first


def _split_store(loop, n: int, nr: int):
    """``loop`` (the tile store's outermost loop: over its rows) as ``if the panel is whole:
    the store without its column test, else: the store``; None if ``loop`` is not that."""
    from tvm import s_tir, tirx

    loops = [loop]
    while isinstance(loops[-1].body, tirx.For):
        loops.append(loops[-1].body)
    realize = loops[-1].body
    if not (isinstance(realize, s_tir.SBlockRealize) and realize.block.name_hint == "out"):
        return None
    # The predicate: (the rows' tests) and (panel's first column) + (column in the tile) < N.
    # Another shape of it: the store stays as it is (right, only slower).
    predicate, inner = realize.predicate, [each.loop_var for each in loops]
    column_test = predicate.b if isinstance(predicate, tirx.And) else None
    if not (isinstance(column_test, tirx.LT) and isinstance(column_test.a, tirx.Add)):
        return loop
    first, offset = column_test.a.a, column_test.a.b
    if _uses(first, inner) or not _uses(offset, inner):
        return loop
    rest = predicate.a
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731  (the kernel's indices)
    whole = tirx.LE(first + i64(nr), i64(n))
    stmt = s_tir.SBlockRealize(realize.iter_values, rest, realize.block)
    for outer in reversed(loops):
        stmt = with_body(outer, stmt)
    return tirx.IfThenElse(whole, fresh_copy(stmt), _rows_tested_first(loops, realize, rest))


def _rows_tested_first(loops, realize, rows_test):
    """The store as it was, but with ``rows_test`` (the predicate's rows part) tested once a
    row, outside the loops over the row's columns, where it reads only the row loop (the
    first of ``loops``) and the loops outside the store; else the store as it was."""
    from tvm import s_tir, tirx

    if len(loops) < 2 or _uses(rows_test, [each.loop_var for each in loops[1:]]):
        return loops[0]
    column_test = realize.predicate.b
    stmt = s_tir.SBlockRealize(realize.iter_values, column_test, realize.block)
    for inner in reversed(loops[1:]):
        stmt = with_body(inner, stmt)
    return with_body(loops[0], tirx.IfThenElse(rows_test, stmt, None))


def _uses(expr, variables) -> bool:
    """Whether ``expr`` reads one of ``variables``."""
    from tvm import tirx

    free = tirx.analysis.undefined_vars(expr, [])
    return any(v.same_as(w) for v in free for w in variables)
