"""Rewriting a scheduled module's loops: what the schedule primitives cannot place (a
prefetch, a second copy of a store) is added to the scheduled module by replacing loops.

TVM 0.27 has no Python IR mutator, so the walk rebuilds the nodes on the way down to the
loops it replaces (For, SeqStmt, SBlockRealize, SBlock) and keeps every other node as it is.
"""

from __future__ import annotations


def replace_loops(mod, replace):
    """``mod`` with every loop for which ``replace(loop)`` gives a statement replaced by it;
    where it gives None the walk goes on into the loop's body. Returns the new module and
    whether anything was replaced."""
    from tvm import s_tir, tirx

    def rewrite(node):
        if isinstance(node, tirx.For):
            new = replace(node)
            if new is not None:
                return new
            body = rewrite(node.body)
            return node if body.same_as(node.body) else with_body(node, body)
        if isinstance(node, tirx.SeqStmt):
            seq = [rewrite(s) for s in node.seq]
            if all(new.same_as(old) for new, old in zip(seq, node.seq, strict=True)):
                return node
            return tirx.SeqStmt(seq)
        if isinstance(node, s_tir.SBlockRealize):
            block = rewrite(node.block)
            if block.same_as(node.block):
                return node
            return s_tir.SBlockRealize(node.iter_values, node.predicate, block)
        if isinstance(node, s_tir.SBlock):
            body = rewrite(node.body)
            if body.same_as(node.body):
                return node
            return s_tir.SBlock(node.iter_vars, node.reads, node.writes, node.name_hint, body,
                                node.init, node.alloc_buffers, node.match_buffers,
                                node.annotations)  # fmt: skip
        return node

    func = mod["main"]
    body = rewrite(func.body)
    if body.same_as(func.body):
        return mod, False
    mod["main"] = func.with_body(body)
    return mod, True


def with_body(loop, body):
    """``loop`` with another body."""
    from tvm import tirx

    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                    loop.annotations)  # fmt: skip


def fresh_copy(stmt):
    """``stmt`` with its own loop and block variables (a statement's variables may be defined
    once in a function); the variables it reads from around it stay."""
    from tvm import s_tir, tirx

    return s_tir.renew_defs(tirx.PrimFunc([], stmt)).body


def block_bindings(stmt, name: str):
    """The iter values of block ``name`` in ``stmt`` (its first occurrence), or None."""
    from tvm import s_tir, tirx

    if isinstance(stmt, s_tir.SBlockRealize):
        if stmt.block.name_hint == name:
            return list(stmt.iter_values)
        return block_bindings(stmt.block.body, name)
    if isinstance(stmt, s_tir.SBlock | tirx.For):
        return block_bindings(stmt.body, name)
    if isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            found = block_bindings(s, name)
            if found is not None:
                return found
    return None
