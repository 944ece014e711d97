"""Tracing a user's module with ``torch.fx`` without changing it.

fx runs the module's Python ``forward`` on proxies, and records tensor operations only: a
Python side effect on a module (``self.last_input = x``, ``self.calls += 1``,
``self.cache.append(x)``) leaves no node in the graph, so the traced graph would silently skip
it, and the trace itself writes a ``Proxy`` onto the user's module. ``unchanged_by_trace``
snapshots every module of the traced tree, puts each attribute back after the trace (whether
it succeeded or failed) and raises ``SideEffect`` when the trace assigned something. Lists,
dicts and sets are watched down to a few levels of nesting; other objects a module holds are
not (their attributes could change for harmless reasons, e.g. a cached property).

fx itself stores the tensors a trace computes without proxies (constants) on the traced root,
as ``_tensor_constant0`` and the like, for the GraphModule to read: build the GraphModule
inside the block; those attributes are removed afterwards too, and are no side effect.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

_DICTS = ("_parameters", "_buffers", "_modules")
_CONTAINERS = (list, dict, set)
# The attributes fx's Tracer.create_arg sets on the root for constants it meets.
_FX_CONSTANT = re.compile(
    r"_(tensor_constant|torchbind_obj|tree_spec_constant|opaque_obj)\d+|_\w+_constant_\d+"
)


class SideEffect(Exception):
    """The traced forward changed a module attribute: its graph would not do that."""


@contextmanager
def unchanged_by_trace(root: nn.Module) -> Iterator[None]:
    """Restore every module under ``root`` after the block; raise ``SideEffect`` naming the
    first attribute the block changed (only if the block itself raised nothing)."""
    names = {id(m): name or "<top>" for name, m in root.named_modules(remove_duplicate=False)}
    saved = [(m, _snapshot(m)) for m in root.modules()]
    changed = None
    try:
        yield
    finally:
        for module, before in saved:
            attribute = _restore(module, before)
            if changed is None and attribute is not None:
                changed = f"{names[id(module)]}.{attribute}".removeprefix("<top>.")
    if changed is not None:
        raise SideEffect(f"tracing it changes {changed}, a side effect its traced graph would skip")


def _snapshot(module: nn.Module) -> dict:
    """Shallow copies of the module's attributes, of its parameter / buffer / child dicts,
    and of the lists, dicts and sets among its attributes, with those nested in them
    (``self.state["seen"].append(x)``) down to NESTED_DEPTH levels, NESTED_MAX in all."""
    attrs = dict(module.__dict__)
    top = [(key, value) for key, value in attrs.items() if key in _DICTS]
    top += [(key, value) for key, value in attrs.items() if type(value) in _CONTAINERS]
    inner = [(key, value, type(value)(value)) for key, value in top]  # (name, it, its copy)
    seen = {id(value) for _, value in top}
    todo = [(key, value, 1) for key, value in top if key not in _DICTS]
    while todo and len(inner) < NESTED_MAX:  # (only the nested ones are capped)
        name, value, depth = todo.pop()
        if depth > 1:
            if id(value) in seen:
                continue
            seen.add(id(value))
            inner.append((name, value, type(value)(value)))
        if depth < NESTED_DEPTH and not isinstance(value, set):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            todo += [(f"{name}[{k!r}]", v, depth + 1) for k, v in items if type(v) in _CONTAINERS]
    return {"attrs": attrs, "inner": inner}


# How deep into nested containers the snapshot looks (1: the module's own attributes, always
# copied, as are its parameter / buffer / child dicts), and how many it copies at most per
# module: a bound on its cost.
NESTED_DEPTH = 3
NESTED_MAX = 1000


def _restore(module: nn.Module, before: dict) -> str | None:
    """Put ``module`` back as ``before``; the name of an attribute that had changed, or None."""
    changed = []
    now = module.__dict__
    for key in [k for k in now if k not in before["attrs"]]:
        if not _FX_CONSTANT.fullmatch(key):
            changed.append(key)
        del now[key]
    for key, value in before["attrs"].items():
        if now.get(key, _MISSING) is not value:
            changed.append(key)
            now[key] = value
    for name, value, saved in before["inner"]:
        if not _same_contents(value, saved):
            changed.append(f"{name.lstrip('_')}[{_first_difference(value, saved)!r}]")
            if isinstance(value, list):
                value[:] = saved
            else:
                value.clear()
                value.update(saved)
    return changed[0] if changed else None


_MISSING = object()


def _same_contents(value, saved) -> bool:
    """Same elements by identity (``==`` on tensors would compare their values)."""
    if len(value) != len(saved):
        return False
    if isinstance(value, dict):
        return all(value.get(k, _MISSING) is v for k, v in saved.items())
    if isinstance(value, set):
        return {id(v) for v in value} == {id(v) for v in saved}
    return all(a is b for a, b in zip(value, saved, strict=False))


def _first_difference(value, saved):
    if isinstance(value, dict):
        for key in {**saved, **value}:
            if value.get(key, _MISSING) is not saved.get(key, _MISSING):
                return key
    if isinstance(value, list):
        return next(
            (i for i, (a, b) in enumerate(zip(value, saved, strict=False)) if a is not b),
            len(saved),
        )
    return "..."
