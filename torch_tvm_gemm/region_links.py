"""A converted region's graph computes with the model's current layers, parameters and buffers.

The graph module that ``convert`` keeps for a region holds references of its own: to the
layers it calls, to the tensors it reads (``get_attr``: a LLaMA RMSNorm's weight, a buffer),
and, in the fused layers it made, to the model's parameters. Writes into those tensors are
seen (the objects are shared), but replacing an object on the model is not:
``load_state_dict(..., assign=True)``, ``layer.weight = nn.Parameter(...)``, ``to_empty()``,
a buffer that ``.to()`` / ``.double()`` replaced, a layer swapped for another. The graph would
go on computing with the old object: a wrong answer.

So each region keeps ``Links``, made when the region is converted (and again after a copy or
pickle of the model): for every tensor the graph reads that is the model's own (its
parameters, buffers, and the parameters of the layers the fusions made), the slot on the
model it comes from; for every layer it calls or took into a fusion, the slot that holds it.
Before each call the graph is pointed at the tensors those slots hold now (a few dict lookups
a region: ~0.1 us an object); where a layer was replaced, the region runs its module's own
forward instead (on the swapped layers: correct, without the fusions), as it does where a
layer that the graph computes in a fusion (a linear with its activation, a conv with its BN)
has a forward or backward hook: the graph never calls that layer, so its hooks would not run.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, fx, nn

from .inplace_adds import FRESH_OUTPUT
from .nn import HOOK_DICTS

_MISSING = object()


def _slot(owner: object, name: str) -> dict | None:
    """The dict that holds attribute ``name`` of ``owner`` (a module's parameters, buffers,
    submodules or plain attributes), or None."""
    if isinstance(owner, nn.Module):
        for table in (owner._parameters, owner._buffers, owner._modules):
            if name in table:
                return table
    table = getattr(owner, "__dict__", None)
    return table if table is not None and name in table else None


def _parent(root: nn.Module, target: str) -> tuple[object, str]:
    """(the object holding the last part of ``target``, that part); (None, name) if the path
    does not exist under ``root``."""
    *path, name = target.split(".")
    owner: object = root
    for part in path:
        table = _slot(owner, part)
        if table is None:
            return None, name
        owner = table[part]
    return owner, name


@dataclass
class Links:
    """``follow``: (graph-side dict, model-side dict, key): the graph's entry is the model's.
    ``guards``: (model-side dict, key, object): a layer a fusion stands for, still there."""

    follow: list[tuple[dict, dict, str]]
    guards: list[tuple[dict, str, object]]
    # The hook dicts of the model's layers that the graph does not call (a fusion computes
    # them): a hook registered on one would not run, so the region's own forward runs then.
    hooks: list[dict]

    def update(self) -> bool:
        """Point the graph at the model's current objects; False if a layer a fusion stands
        for, or an object the graph reads, is no longer on the model, or a layer the graph
        does not call has a hook."""
        for graph_side, model_side, key in self.follow:
            value = model_side.get(key, _MISSING)
            if value is _MISSING:
                return False
            if graph_side.get(key) is not value:
                graph_side[key] = value
        if not all(model_side.get(key) is obj for model_side, key, obj in self.guards):
            return False
        return not any(self.hooks)

    def watch_hooks(self, layer: nn.Module) -> None:
        self.hooks += [getattr(layer, name) for name in HOOK_DICTS]


def make_links(gm: fx.GraphModule, module: nn.Module, absorbed=()) -> Links | None:
    """The links between ``gm`` (the region's graph) and ``module`` (the region), or None
    where they already disagree (the model changed since the graph was made): the region
    then runs its own forward. ``absorbed``: (path, module) of each module a fusion took in (an
    activation after a linear, a BN after a conv), which must stay the model's."""
    links = Links([], [], [])
    for path, layer in absorbed:
        owner, key = _parent(module, path)
        table = _slot(owner, key) if owner is not None else None
        if table is None:
            return None
        links.guards.append((table, key, layer))
        links.watch_hooks(layer)
    paths = None  # id -> path of the region's modules, for the layers a fusion stands for
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        graph_owner, name = _parent(gm, node.target)
        model_owner, _ = _parent(module, node.target)
        graph_side = _slot(graph_owner, name)
        ours = graph_side[name]
        model_side = _slot(model_owner, name) if model_owner is not None else None
        theirs = model_side[name] if model_side is not None else _MISSING
        if node.op == "get_attr" and not isinstance(ours, nn.Module):
            # A tensor the graph reads: whatever the model holds there now (a constant the
            # trace stored has a name of its own, not on the model).
            if isinstance(theirs, Tensor):
                links.follow.append((graph_side, model_side, name))
            elif theirs is not _MISSING:
                return None
        elif ours is theirs:
            # A layer the graph calls: not followed, since the graph may write into its
            # output, which another layer may not allocate for the call (inplace_adds);
            # nor hooked, for that write would change an output a hook has seen.
            links.guards.append((model_side, name, theirs))
            if isinstance(theirs, FRESH_OUTPUT):
                links.watch_hooks(theirs)
        elif node.op == "get_attr":
            if theirs is not _MISSING:
                return None
            # (a layer kept under a name of its own for code that reads its attributes)
        else:  # a layer a fusion made from the model's layer at this path
            layer = ours.__dict__.get(_STANDS_FOR)
            if layer is None:  # (first linked: it shares that layer's parameters)
                if not isinstance(theirs, nn.Module) or not _stands_for(ours, theirs):
                    return None
                layer = ours.__dict__[_STANDS_FOR] = theirs  # (a copy of the model keeps it)
            for key in ours._parameters:
                links.follow.append((ours._parameters, layer._parameters, key))
            links.guards.append((model_side, name, layer))
            links.watch_hooks(layer)
            if paths is None:
                paths = {id(m): path for path, m in module.named_modules()}
            for source in getattr(ours, "sources", ()):  # (TVMConv2dBN: the conv and the BN)
                if id(source) not in paths:
                    return None
                owner, key = _parent(module, paths[id(source)])
                links.guards.append((_slot(owner, key), key, source))
                links.watch_hooks(source)
    return links


# Set on a layer a fusion made: the model's layer it stands for, whose parameters it follows.
_STANDS_FOR = "_tvm_stands_for"


def _stands_for(fused: nn.Module, layer: nn.Module) -> bool:
    """Whether ``fused`` (made by a fusion) computes with ``layer``'s parameters: each of its
    parameters is the layer's of the same name."""
    for key, tensor in fused._parameters.items():
        if layer._parameters.get(key, _MISSING) is not tensor:
            return False
    return bool(fused._parameters) or bool(getattr(fused, "sources", ()))
