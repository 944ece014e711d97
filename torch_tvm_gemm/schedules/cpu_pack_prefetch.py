"""Software prefetches in the packed kernel's pack of B (``prefetch_pack_reads`` for a "nk"
weight, ``prefetch_copy_reads`` for a "kn" one) and of the weight's next chunk in the
K-blocked kernel (``prefetch_next_chunk``).

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

The batched kernel's "nk" B (attention's K, read as K^T) is packed the same way: `Q @ K^T`,
B*H = 96, S = 128, D = 64, against torch.bmm, with -> without, four runs on 2 threads and two
on one: +0.3% to +10% (BH = 12: +0 to +1%).

A "kn" B (transformers' Conv1D weight, x @ W) is packed by a copy of NR values from each of
its K rows (in vectors), rows N values apart: each row now first asks for the row AHEAD_ROWS
further. Same measurement (GPT-2's 2304 x 768, 768 x 768, 3072 x 768, 768 x 3072; against
torch.addmm): M = 128 -0.4% to +3.9%, M = 256 -0.6% to +5.5%, M = 1024 -1.4% to +3%; the pack
alone (M = 6, one thread) +6% to +13%. 16 rows ahead: about the same. (On a Xeon of KVM model
167, with the copy in vectors, without the prefetch read 7-11% faster kernels alone on a ring
of 8 weights at M = 128, but through the op GPT-2's shapes lost up to 14% at M = 32 and the
GPT-2 model lost 2-3% at batch 1: kept.)

The K-blocked kernel (a 64-wide panel of half the L2 or more: K >= 2048 on a 1 MB L2) packs a
chunk of 256 values of K of its task's panels at a time, then runs every tile of A over it.
With the weight from memory the packs waited for it; now the next chunk's piece is asked for
into the L2 while the tiles of this one run (``prefetch_next_chunk``). Measured on an AMD
EPYC (Zen 5, 1 MB L2), 2 threads, weights cycled through 96 MB or more, both kernels in one
process called in turn, without -> with: 4096 x 11008 M = 128 +6.7%, 768 x 3072 M = 128
+5.9%, 4096 x 4096 M = 128 +0.2%, M = 256 +0.8% to +1%. Built for every M, separate runs
read M = 512 -1% and -6%, M = 768 0% and -4%, M = 1024 -2% to -4% (4096 x 11008): there the
chunk of A (M KB) fills the L2 and the prefetched lines push it out. So the prefetch runs
only while that chunk takes at most a third of the L2 (docs/inference-shapes.md section 21),
and only on CPUs with an L2 of at most 1 MB: on an Intel Xeon with 2 MB it cost 5-30% at
every M it ran at (``cpu.NEXT_CHUNK_PREFETCH_MAX_L2``).

TensorIR's schedule primitives cannot place a prefetch, so it is added to the scheduled
module: the pack's loop over tiles along K ("nk") or over rows ("kn") gets the prefetches
first in its body."""

from __future__ import annotations

from .tir_rewrite import block_bindings, fresh_copy, replace_loops, with_body

AHEAD = 64  # values ahead along a row (4 cache lines of float32: 4 tiles)
AHEAD_ROWS = 8  # "kn": rows ahead
LINE = 16  # float32 values in a 64-byte cache line


def with_pack_prefetch(sch, spec, pack_loops, nr: int, vec: int):
    """The module of the scheduled packed kernel ``sch``, its pack of B prefetching (float32;
    ``pack_loops``: what the schedule returned, None where the pack has no such loops)."""
    if pack_loops is None or spec.dtype != "float32":
        return sch.mod
    loops = [None if loop is None else sch.get(loop).loop_var for loop in pack_loops]
    if spec.b_layout == "nk":
        return prefetch_pack_reads(sch.mod, *loops, vec)
    return prefetch_copy_reads(sch.mod, *loops, nr, vec)


def prefetch_pack_reads(mod, k_tiles, rows_in_tile, vec: int):
    """``mod`` with the prefetches above. ``k_tiles``: the loop variable of the pack's loop
    over tiles along K; ``rows_in_tile``: that of its (unrolled) loop over a tile's rows, or
    None where a tile is one block (``cpu_transpose``: its bindings count whole tiles)."""
    from tvm import tirx

    b = mod["main"].params[1]  # buffers are typed variables: the weight, ([batch,] N, K)
    n, k = b.ty.shape[-2:]
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    if rows_in_tile is None:
        rows_in_tile = tirx.Var("r", "int64")
        *batch, tile, _ = block_bindings(mod["main"].body, "B_pad_o")
        row = tile * i64(vec) + rows_in_tile
    else:
        *batch, row, _ = block_bindings(mod["main"].body, "B_pad")
    at = k_tiles * i64(vec) + i64(AHEAD)
    index = [*batch, tirx.min(row + i64(vec) * (at // k), n - i64(1)), at % k]
    loop = tirx.For(rows_in_tile, i64(0), i64(vec), tirx.ForKind.UNROLLED, _prefetch(b, index))
    return _first_in(mod, k_tiles, loop)


def prefetch_copy_reads(mod, k_rows, vectors, lanes, nr: int, vec: int):
    """The same for the pack of a "kn" weight, a copy of each row's NR columns in vectors
    (``vectors``, ``lanes``: those loops' variables): each row first asks for the row
    AHEAD_ROWS further (its NR values: NR / 16 cache lines)."""
    from tvm import tirx

    b = mod["main"].params[1]  # (K, N)
    k, n = b.ty.shape
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    row, column = block_bindings(mod["main"].body, "B_pad")
    index = [tirx.min(row + i64(AHEAD_ROWS), k - i64(1)), tirx.min(column, n - i64(1))]
    # One prefetch a cache line (the unrolled loop keeps the vectors at whole lines), at a
    # vector's first value.
    wanted = tirx.EQ(tirx.floormod(vectors * i64(vec), i64(LINE)), i64(0))
    ask = tirx.IfThenElse(wanted, _prefetch(b, index), None)
    body = tirx.SeqStmt([tirx.LetStmt(lanes, i64(0)), ask])  # (TVM 0.27: a bind, no body)
    loop = tirx.For(vectors, i64(0), i64(nr // vec), tirx.ForKind.UNROLLED, body)
    return _first_in(mod, k_rows, loop)


def prefetch_next_chunk(mod, loops, chunks: int, task_width: int, kc: int, nk: bool,
                        max_tiles: int):  # fmt: skip
    """The K-blocked kernel (``cpu._schedule_packed_kblocked``) with the weight's piece for
    the task's next chunk (after its last chunk: the next task's first, which the parallel
    loop gives the same thread) asked for into the L2 while this chunk's tiles run, spread
    over them: first in the body of the loop over tiles. ``loops``: the variables of the
    loops over the tasks (``task_width`` columns of the result each), the chunks (``kc``
    values of K each) and the tiles; at most ``max_tiles`` tiles (a call's M, known at run
    time), past which the chunk of A takes the L2 and the prefetched lines would push it
    out (figures at the top)."""
    from tvm import tirx

    b = mod["main"].params[1]  # (N, K) if nk else (K, N)
    n, k = b.ty.shape if nk else b.ty.shape[::-1]
    task, chunk, tile = loops
    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    # the piece, line by line: task_width rows of kc values ("nk"), kc rows of task_width
    per_row = (kc if nk else task_width) // LINE
    lines = per_row * (task_width if nk else kc)
    last = tirx.EQ(chunk, i64(chunks - 1))
    next_task = tirx.Select(last, task + i64(1), task)
    next_chunk = tirx.Select(last, i64(0), chunk + i64(1))
    line = tirx.Var("line", "int64")

    def replace(loop):
        if not loop.loop_var.same_as(tile):
            return None
        per_tile = (i64(lines) + loop.extent - i64(1)) // loop.extent
        at = tile * per_tile + line
        row, column = at // i64(per_row), at % i64(per_row) * i64(LINE)  # in the piece
        if nk:  # rows of the weight across N, K along them
            index = [next_task * i64(task_width) + row, next_chunk * i64(kc) + column]
        else:  # rows of B along K, N along them
            index = [next_chunk * i64(kc) + row, next_task * i64(task_width) + column]
        bounds = [n, k] if nk else [k, n]
        index = [tirx.min(i, bound - i64(1)) for i, bound in zip(index, bounds, strict=True)]
        ask = tirx.IfThenElse(at < i64(lines), _prefetch(b, index, locality=2), None)
        prefetches = tirx.For(line, i64(0), per_tile, tirx.ForKind.SERIAL, ask)
        prefetches = fresh_copy(tirx.IfThenElse(loop.extent <= i64(max_tiles), prefetches, None))
        return with_body(loop, tirx.SeqStmt([prefetches, loop.body]))

    mod, found = replace_loops(mod, replace)
    if not found:
        raise RuntimeError("cpu_pack_prefetch: the K-blocked kernel's tile loop was not found")
    return mod


def _prefetch(b, index, locality: int = 3):
    from tvm import tirx

    # llvm.prefetch(address, read, locality (3: every cache level, prefetcht0; 2: prefetcht1,
    # into the L2), data)
    read, keep, data = (tirx.const(v, "int32") for v in (0, locality, 1))
    address = tirx.address_of(tirx.BufferLoad(b, index))
    return tirx.Evaluate(
        tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, read, keep, data)
    )


def _first_in(mod, loop_var, stmt):
    """``mod`` with ``stmt`` first in the body of the loop over ``loop_var``; ``stmt`` reuses
    variables of the loops inside, so it is given its own (``fresh_copy``)."""
    from tvm import tirx

    stmt = fresh_copy(stmt)

    def replace(loop):
        if loop.loop_var.same_as(loop_var):
            return with_body(loop, tirx.SeqStmt([stmt, loop.body]))
        return None

    mod, found = replace_loops(mod, replace)
    if not found:
        raise RuntimeError("cpu_pack_prefetch: the pack's loop was not found")
    return mod
