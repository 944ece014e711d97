"""``convert(model)``: put a whole model on the TVM ops, whatever its forward does.

``torch.fx`` cannot trace most real models at the top level (transformers' models branch
on their config and arguments, check shapes, build caches). ``convert`` does not need it to:

1. It looks for the largest submodules that ``torch.fx`` can trace, top down: a module that
   traces is a *region*; for one that does not, its children are tried (a forward that
   fails inside a helper function it calls is first traced again with that helper kept as
   one opaque call: ``_helper_that_failed``; a forward with a side effect on a module,
   which the graph would skip, does not count as traceable: ``trace_guard``). Inside a region,
   conv -> (BN) -> activation chains (ReLU, ReLU6, hardswish, SiLU, leaky ReLU, sigmoid,
   hardsigmoid) become one
   ``tvm_gemm.conv2d_bias_relu`` call and a linear
   layer whose output feeds only an activation (ReLU, GELU, tanh-GELU, SiLU) becomes one
   ``tvm_gemm.linear`` call with that activation. A residual add (or a gating product, as
   in LLaMA's MLP) of a TVM layer's output that nothing else reads goes into that output, in
   place (``inplace_adds``). A region with convs on TVM ops runs its graph channels-last
   for an NCHW input (``region_layout`` says which).
2. Every linear layer (``nn.Linear``, subclasses that keep its forward, transformers'
   ``Conv1D``) is swapped for its TVM module in place, parameters shared, and the experts of
   transformers' mixture-of-experts layers run their products on the linear op
   (``moe_experts.py``).
3. Every ``nn.MaxPool2d`` pools on a channels_last copy (``pooling.py``: torch's NCHW max
   pool is scalar code, its channels_last one vectorised; ResNet's stem pool 3.2 -> 0.7 ms).

The model object stays the user's: same class, same attributes, same call signature and
outputs, same ``state_dict`` keys. A region with fusions runs its traced, fused graph
(kept out of the module tree, so it adds no ``state_dict`` entries) from a ``forward`` set on
that module; a call the trace does not cover (an argument that was ``None`` or a flag at
trace time now set otherwise, or the module switched between eval and training mode since)
runs the module's own forward, on the swapped layers.
"""

from __future__ import annotations

import copy
import inspect
import logging
import traceback
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from .fold import TVMConv2dBN
from .fusion import FusionTracer, TVMConv2dBiasReLU, fuse_convs_in_graph, is_impure
from .inplace_adds import inplace_residual_adds
from .linear_subclasses import note_subclasses
from .model_precompile import PrecompileSummary, precompile, split_example_inputs
from .moe_experts import convert_experts, is_experts
from .nn import (
    TVMConv1D,
    TVMLinear,
    activation_name,
    is_conv1d,
    linear_kind,
    swap_linear_layers,
    tvm_module_for,
)
from .pooling import ChannelsLastMaxPool2d, swap_max_pools
from .region_layout import restore_contiguous, runs_channels_last, to_channels_last
from .region_links import make_links
from .trace_guard import SideEffect, unchanged_by_trace

log = logging.getLogger("torch_tvm_gemm")


# --- the summary ----------------------------------------------------------------------------


@dataclass
class ConversionSummary:
    """What ``convert`` did to each layer.

    ``layers`` maps the qualified name of every ``nn.Linear`` / ``Conv1D`` / ``nn.Conv2d``
    found to what it became (``"swapped"``, ``"fused: ..."``) or why it was left alone
    (``"left alone: <reason>"``). ``regions`` lists the traced submodules that run a fused
    graph; ``untraced`` maps each module ``torch.fx`` could not trace to the reason;
    ``precompiled``, when ``convert`` was given example inputs, what ``precompile`` did;
    ``pools`` the ``nn.MaxPool2d`` put on ``ChannelsLastMaxPool2d``.
    """

    model: str = ""
    layers: dict[str, str] = field(default_factory=dict)
    # fqn -> "linear" | "conv1d" | "conv2d" | "experts" (a MoE layer's experts: moe_experts.py)
    kinds: dict[str, str] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)
    untraced: dict[str, str] = field(default_factory=dict)
    pools: list[str] = field(default_factory=list)
    precompiled: PrecompileSummary | None = None

    @property
    def fused(self) -> list[str]:
        return [
            f"{fqn}: {what[7:]}" for fqn, what in self.layers.items() if what.startswith("fused")
        ]

    @property
    def skipped(self) -> list[str]:
        return [f"{fqn}: {what}" for fqn, what in self.layers.items() if what.startswith("left")]

    def converted(self, kind: str | None = None) -> int:
        """How many layers (of ``kind``) run on a TVM op."""
        return sum(
            1
            for fqn, what in self.layers.items()
            if not what.startswith("left") and (kind is None or self.kinds[fqn] == kind)
        )

    def found(self, kind: str | None = None) -> int:
        return sum(1 for k in self.kinds.values() if kind is None or k == kind)

    def line(self) -> str:
        """One line for the log."""
        parts = []
        for kind in ("linear", "conv1d", "conv2d", "experts"):
            if self.found(kind):
                parts.append(f"{self.converted(kind)}/{self.found(kind)} {kind}")
        fused = len(self.fused)
        left = len(self.skipped)
        pools = f", {len(self.pools)} max pools channels-last" if self.pools else ""
        return (
            f"convert({self.model}): {', '.join(parts) or 'no layers'} on TVM ops, {fused} fused, "
            f"{left} left alone, {len(self.regions)} traced regions, "
            f"{len(self.untraced)} untraceable modules{pools}"
        )

    def __str__(self) -> str:
        lines = [self.line()]
        lines += [f"  {fqn}: {what}" for fqn, what in self.layers.items()]
        lines += [f"  untraceable {fqn or '<top>'}: {why}" for fqn, why in self.untraced.items()]
        lines += [f"  {fqn or '<top>'}: max pool on a channels_last copy" for fqn in self.pools]
        return "\n".join(lines)


# --- tracing --------------------------------------------------------------------------------


class _Tracer(FusionTracer):
    """torch.fx's tracer, with the layers the passes rewrite kept as single calls."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        leaves = (nn.MultiheadAttention, TVMLinear, TVMConv1D, TVMConv2dBiasReLU)
        if isinstance(m, leaves + (ChannelsLastMaxPool2d,)):
            return True
        if is_conv1d(m) or activation_name(m) is not None or linear_kind(m)[0] is not None:
            return True
        return super().is_leaf_module(m, qualname)

    def create_arg(self, a):
        # fx turns a dict subclass (transformers' ModelOutput) into a plain dict: the traced
        # module would not return what the module returns.
        if isinstance(a, dict) and type(a) not in (dict, OrderedDict):
            raise _Untraceable(f"it returns a {type(a).__name__}, which fx would turn into a dict")
        return super().create_arg(a)


class _Untraceable(Exception):
    pass


_UNLINKED = object()


@dataclass
class _Traced:
    """A region's fused graph and what its trace assumed about the arguments."""

    gm: fx.GraphModule
    signature: inspect.Signature
    concrete: dict  # argument name -> the non-tensor value the trace was specialised on
    n_tensors: int  # leading positional tensor arguments
    # The region's mode at trace time: fx fixed its `self.training` branches, and the fusion
    # dropped its eval-mode Dropouts; in the other mode the module's own forward runs.
    training: bool
    # Whether an NCHW input runs the graph channels-last (``region_layout``)
    channels_last: bool = False
    # (path, module) of each module the trace called that a fusion took in (an activation,
    # a BN, a Dropout)
    absorbed: tuple[tuple[str, nn.Module], ...] = ()

    def run(self, module: nn.Module, args: tuple, kwargs: dict):
        if module.training != self.training or not self.linked(module):
            return type(module).forward(module, *args, **kwargs)
        if not kwargs and len(args) == self.n_tensors and all(isinstance(a, Tensor) for a in args):
            return self._call(args)  # the common call: tensors only, defaults for the rest
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return type(module).forward(module, *args, **kwargs)  # raises the usual error
        bound.apply_defaults()
        for name, value in bound.arguments.items():
            if name in self.concrete:
                expected = self.concrete[name]
                same = value is expected or (type(value) is type(expected) and value == expected)
            else:
                same = isinstance(value, Tensor)
            if not same:  # the trace does not cover this call
                return type(module).forward(module, *args, **kwargs)
        return self._call(tuple(bound.arguments.values()))  # (fx renames specialised args)

    def linked(self, module: nn.Module) -> bool:
        """Point the graph at ``module``'s current layers and tensors (``region_links``);
        False where the graph no longer stands for the module."""
        links = self.__dict__.get("_links", _UNLINKED)
        if links is _UNLINKED:  # (converted just now, or a copy of a converted model)
            links = self.__dict__["_links"] = make_links(self.gm, module, self.absorbed)
        return links is not None and links.update()

    def __getstate__(self) -> dict:
        # (the links hold the dicts of this model's modules: a copy makes its own)
        return {key: value for key, value in self.__dict__.items() if key != "_links"}

    def _call(self, args: tuple):
        converted = to_channels_last(args) if self.channels_last else None
        if converted is None:
            return self.gm(*args)
        return restore_contiguous(self.gm(*converted))


class _RegionForward:
    """The ``forward`` set on a converted region: its fused graph when the trace covers the
    call. An object rather than a bound function so that the model pickles and deep-copies."""

    def __new__(cls, module: nn.Module):
        # Each region runs its own copy of ``__call__``'s code: torch.compile keeps at most
        # ``recompile_limit`` (8) compiled versions of one code object, and each converted
        # model compiled in a process (or the same one after a parameter was replaced) took
        # one of them; past eight, torch.compile(fullgraph=True) raised.
        call = cls.__call__
        code = call.__code__.replace()  # (a new code object: a cache of its own)
        fresh = types.FunctionType(code, call.__globals__, call.__name__, call.__defaults__)
        return object.__new__(type(cls.__name__, (cls,), {"__call__": fresh}))

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        return module.__dict__["_tvm_traced"].run(module, args, kwargs)

    def __reduce__(self):
        return (_RegionForward, (self.module,))


def _trace(module: nn.Module) -> tuple[fx.GraphModule, inspect.Signature, dict, int]:
    forward = type(module).forward
    signature = inspect.signature(types.MethodType(forward, module))
    concrete = {}
    n_tensors = 0
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise _Untraceable("its forward takes *args / **kwargs")
        if param.kind is param.KEYWORD_ONLY:
            raise _Untraceable("its forward takes keyword-only arguments")
        if param.default is not param.empty and not isinstance(param.default, Tensor):
            concrete[param.name] = param.default  # traced with its default, and guarded
        elif not concrete:
            n_tensors += 1
    wrapped: list[Callable] = []
    while True:
        try:
            with unchanged_by_trace(module):
                graph = _Tracer(autowrap_functions=tuple(wrapped)).trace(
                    module, concrete_args=concrete or None
                )
                # (built here: it copies the constants fx stored on the module)
                gm = fx.GraphModule(module, graph, class_name=f"Traced{type(module).__name__}")
            break
        except _Untraceable:
            raise
        except SideEffect as err:
            raise _Untraceable(str(err)) from None
        except Exception as err:
            helper = _helper_that_failed(err)
            if helper is None or helper in wrapped or len(wrapped) == _MOST_WRAPPED_HELPERS:
                raise _Untraceable(f"{type(err).__name__}: {_first_line(err)}") from None
            wrapped.append(helper)
    return gm, signature, concrete, n_tensors


# A forward that calls a module-level helper which branches on its input's shape (MobileNet's
# TensorFlow-style padding, ``apply_tf_padding(features, self.convolution)``) does not trace;
# traced again with that helper as one opaque call, the rest of the forward (conv -> BN ->
# activation) does. The helper then runs as written, on the real tensors, at every call.
_MOST_WRAPPED_HELPERS = 8


def _helper_that_failed(err: Exception) -> Callable | None:
    """The plain function (defined at a module's top level, outside torch) that a module's
    ``forward`` called and inside which tracing failed, or None."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    forwards = [
        i
        for i, frame in enumerate(frames)
        if frame.f_code.co_name == "forward" and isinstance(frame.f_locals.get("self"), nn.Module)
    ]
    if not forwards or forwards[-1] + 1 == len(frames):
        return None
    callee = frames[forwards[-1] + 1]
    helper = callee.f_globals.get(callee.f_code.co_name)
    if not inspect.isfunction(helper) or helper.__code__ is not callee.f_code:
        return None  # a method, a closure, a lambda
    if (helper.__module__ or "").split(".")[0] == "torch":
        return None  # torch's own code (fx's tracing machinery among it)
    return helper


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:160] if text else ""


# --- linear + activation in a graph ---------------------------------------------------------

_FUNCTIONAL_ACTIVATIONS = {F.relu: "relu", torch.relu: "relu", F.silu: "silu"}
_METHOD_ACTIVATIONS = {"relu": "relu"}


def _activation_of(gm_modules: dict, node: fx.Node) -> str | None:
    """The activation ``node`` applies to its single input, or None."""
    if node.op == "call_module":
        return activation_name(gm_modules[node.target]) if len(node.args) == 1 else None
    if node.op == "call_function":
        if node.target is F.gelu and len(node.args) == 1:
            approximate = node.kwargs.get("approximate", "none")
            return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
        if node.target in _FUNCTIONAL_ACTIVATIONS and len(node.args) == 1:
            inplace = node.kwargs.get("inplace", False)
            return (
                None
                if node.kwargs.keys() - {"inplace"} or inplace not in (True, False)
                else (_FUNCTIONAL_ACTIVATIONS[node.target])
            )
        return None
    if node.op == "call_method" and node.target in _METHOD_ACTIVATIONS and len(node.args) == 1:
        return _METHOD_ACTIVATIONS[node.target]
    return None


def _is_transparent(modules: dict, node: fx.Node) -> bool:
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    mod = modules[node.target]
    return type(mod) is nn.Identity or (
        type(mod) is nn.Dropout and (not mod.training or mod.p == 0)
    )


def _fuse_linears(gm: fx.GraphModule, allowed: Callable[[str], bool], records: dict) -> int:
    """Linear-like module -> activation (single use) into one TVM module; the other linear
    calls onto TVM modules too. Returns the number of fusions."""
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or linear_kind(modules[node.target])[0] is None:
            continue
        if not allowed(node.target):
            continue
        activation, user, passed = "none", None, []
        if calls[node.target] == 1 and len(node.args) == 1 and not node.kwargs:
            user = next(iter(node.users)) if len(node.users) == 1 else None
            while user is not None and _is_transparent(modules, user) and len(user.users) == 1:
                passed.append(user)
                user = next(iter(user.users))
            act = _activation_of(modules, user) if user is not None else None
            if act is not None:
                activation = act
        new = tvm_module_for(modules[node.target], activation)
        parent, _, name = node.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, name, new)
        modules[node.target] = new
        if activation != "none":
            user.replace_all_uses_with(node)
            for dead in [user, *reversed(passed)]:
                gm.graph.erase_node(dead)
            records[node.target] = f"fused: {node.name} -> {user.name} ({activation})"
            fused += 1
        elif calls[node.target] != 1:
            records[node.target] = "swapped (called more than once: activation not fused)"
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return fused


# --- convert --------------------------------------------------------------------------------


def _live_fold(conv: nn.Conv2d, bn: nn.BatchNorm2d, activation: str) -> nn.Module:
    return TVMConv2dBN(conv, bn, activation)


def _convert_region(module, fqn, allowed, summary, records) -> None:
    """Trace ``module`` and fuse inside it, or recurse into its children if it won't trace."""
    if isinstance(module, nn.MultiheadAttention) or _is_layer(module):
        return
    if not _has_layers(module):
        return
    try:
        if type(module).forward is nn.Module.forward:  # a container (ModuleList, ModuleDict)
            raise _Untraceable("")
        gm, signature, concrete, n_tensors = _trace(module)
    except _Untraceable as why:
        if str(why):
            summary.untraced[fqn] = str(why)
        for name, child in module.named_children():
            _convert_region(child, f"{fqn}.{name}" if fqn else name, allowed, summary, records)
        return
    local: dict[str, str] = {}
    prefix = f"{fqn}." if fqn else ""
    traced_calls = {target: gm.get_submodule(target) for target in _called(gm)}
    conv_summary = fuse_convs_in_graph(gm, fold=_live_fold, records=local, root=module)
    fused = len(conv_summary.fused)
    fused += _fuse_linears(gm, lambda target: allowed(prefix + target), local)
    for target, what in local.items():
        records[prefix + target] = what
    if fused:
        inplace_residual_adds(gm)  # (its graph runs only where something was fused)
        channels_last = runs_channels_last(gm, whole_model=fqn == "")
        still_called = _called(gm)
        absorbed = tuple((t, m) for t, m in traced_calls.items() if t not in still_called)
        traced = _Traced(gm, signature, concrete, n_tensors, module.training, channels_last,
                         absorbed)  # fmt: skip
        module.__dict__["_tvm_traced"] = traced
        module.forward = _RegionForward(module)
        summary.regions.append(fqn or "<top>")


def _called(gm: fx.GraphModule) -> set[str]:
    return {node.target for node in gm.graph.nodes if node.op == "call_module"}


def _is_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv2d) or is_conv1d(module) or isinstance(module, nn.Linear)


def _has_layers(module: nn.Module) -> bool:
    return any(_is_layer(m) for m in module.modules())


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Conv2d):
        return "conv2d"
    if is_conv1d(module) or isinstance(module, TVMConv1D):
        return "conv1d"
    if isinstance(module, nn.Linear):
        return "linear"
    if is_experts(module):
        return "experts"
    return None


def convert(
    model: nn.Module,
    linear_filter: Callable[[nn.Module, str], bool] | None = None,
    inplace: bool = True,
    example_inputs=None,
) -> nn.Module:
    """Put ``model`` on the TVM ops: conv -> (BN) -> ReLU and linear -> activation fusion where
    ``torch.fx`` can trace, every linear layer swapped everywhere (and every ``nn.MaxPool2d``
    pooling on a channels_last copy: ``pooling.py``). Never gives up on a model. A region
    with convs on TVM ops runs channels-last inside for an NCHW input (``region_layout``).

    Returns ``model`` itself, converted in place (``inplace=False``: a converted deep copy):
    same class, call signature, outputs and ``state_dict`` keys. ``linear_filter(module,
    fqn)`` chooses the linear layers (and MoE experts modules) to convert (default: all).
    The summary (every Linear, Conv1D, Conv2d and MoE experts module found, what it became
    or why it was left alone) is logged as one line (logger ``torch_tvm_gemm``) and kept as
    ``model.conversion_summary``
    (a ``ConversionSummary``; ``print`` it for one line per layer).

    BN folding uses the running statistics of eval-mode BatchNorms (refolded when the conv
    or BN tensors change, e.g. after ``load_state_dict`` or a write through ``.data``:
    ``fold.TVMConv2dBN``); a BN in training mode is not
    folded, and one switched to training mode after conversion runs as plain torch ops.
    A fused region runs its graph only in the mode it was traced in (fx fixes branches on
    ``self.training``, the fusion drops eval-mode Dropouts); in the other mode the module's
    own forward runs, on the swapped layers: convert a model in the mode it will run in.

    ``example_inputs`` (default None: kernels build on first use): after converting, build
    every kernel ``model(*example_inputs)`` needs, in parallel (``precompile``; a tuple is
    the positional arguments, a dict the keyword ones, anything else the one argument).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"torch_tvm_gemm.convert: expected an nn.Module, got {type(model).__name__}"
        )
    if not inplace:
        model = copy.deepcopy(model)
    summary = ConversionSummary(model=type(model).__name__)
    seen: dict[int, str] = {}
    for fqn, module in model.named_modules():
        kind = _kind(module)
        if kind is not None and id(module) not in seen:
            seen[id(module)] = fqn
            summary.kinds[fqn] = kind

    def allowed(fqn: str) -> bool:
        if linear_filter is None or fqn not in summary.kinds:
            return True
        return _call_filter(linear_filter, model.get_submodule(fqn), fqn)

    records: dict[str, str] = {}
    summary.pools = swap_max_pools(model)  # (before tracing: the graphs call these objects)
    note_subclasses(model)  # (classifying traces: not while a region is traced)
    _convert_region(model, "", allowed, summary, records)
    # Module-level swap everywhere (inside regions too: a call their trace does not cover
    # runs the module's own forward, on these).
    records.update(
        {
            fqn: what
            for fqn, what in swap_linear_layers(model, linear_filter, False).items()
            if fqn not in records or what.startswith("left")
        }
    )
    records.update(convert_experts(model, allowed))
    for fqn, kind in summary.kinds.items():
        what = records.get(fqn)
        if what is None and isinstance(model.get_submodule(fqn), (TVMLinear, TVMConv1D)):
            what = "swapped (already a TVM module)"
        if what is None:
            what = _why_untouched(fqn, kind, summary)
        summary.layers[fqn] = what
    for module in model.modules():  # (after the swap: the graphs follow the swapped layers)
        if "_tvm_traced" in module.__dict__:
            module.__dict__["_tvm_traced"].linked(module)
    model.conversion_summary = summary
    log.info(summary.line())
    if example_inputs is not None:
        args, kwargs = split_example_inputs(example_inputs)
        summary.precompiled = precompile(model, *args, example_kwargs=kwargs)
        log.info(str(summary.precompiled))
    return model


def _call_filter(filter_fn, module: nn.Module, fqn: str) -> bool:
    try:
        return bool(filter_fn(module, fqn))
    except Exception as err:
        raise RuntimeError(
            f"torch_tvm_gemm.convert: linear_filter raised on {fqn!r} ({type(err).__name__}: {err})"
        ) from err


def _why_untouched(fqn: str, kind: str, summary: ConversionSummary) -> str:
    if kind != "conv2d":
        return "left alone: not reached"
    inside = [r for r in summary.untraced if r == "" or fqn.startswith(r + ".")]
    parent = fqn.rpartition(".")[0]
    if parent in summary.untraced:
        return (
            f"left alone: called from untraceable {parent or '<top>'} (no fusion outside a trace)"
        )
    if inside:
        return "left alone: not called from a traced graph (no fusion outside a trace)"
    return "left alone: not called by the traced graph"


__all__ = ["ConversionSummary", "convert"]
