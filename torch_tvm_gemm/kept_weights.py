"""Tensors a conv module derives from its weights and keeps between calls, made again when one
of the weights changes.

Two modules keep one: ``TVMConv2dBN`` (``fold.py``) its BN fold, and ``TVMConv2dBiasReLU``
(``conv_module.py``) a copy of its weight in the memory format the op reads in place
(``conv_ops.weight_layout``). Each call compares a key of the source tensors with the one the
kept tensors were made from:

- the version torch counts for every in-place write (``load_state_dict``, an optimizer step,
  ``copy_``, ``.to()``);
- a write the version misses (through ``tensor.data``, or a numpy view made after the
  derivation) by a copy-on-write mark on the sources' storage (``_arm``): the first write
  through any alias, or anything that takes a writable pointer, clears it. Nothing is copied:
  no one else shares the buffer, so the writer keeps it;
- a source replaced by another tensor, by the tensors themselves (weak references: a replaced
  one that died cannot come back as another's of the same version and address, and what is
  kept does not keep its sources alive).

A numpy view made before the derivation writes unseen: ``forget()`` (the modules' ``refold()``)
after writing through one.

What the kept tensors hold in memory, by kind, is ``kept_bytes()`` (``torch_tvm_gemm.kept_bytes``).

With gradients wanted (a model in eval mode called outside ``torch.no_grad()``, or a frozen BN
fine-tuned), ``with_gradient`` hands the kept tensors to autograd as a function of their
sources: the forward reads them as kept, the backward differentiates the derivation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd import forward_ad


class KeptWeights:
    """The tensors ``derive()`` made from ``sources`` for inputs of one ``image``, kept while
    neither changes. ``kind`` names them in ``kept_bytes()``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._key: tuple | None = None
        self._seen: list[weakref.ref] | None = None
        self.value: tuple | None = None
        _ALL.add(self)

    def __getstate__(self) -> dict:
        # (a copy or a pickle derives again: weak references do not travel)
        return {"kind": self.kind}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.get("kind", "kept weights"))

    def nbytes(self) -> int:
        """The memory of the kept tensors that are copies (not a source handed on as it is)."""
        value, seen = self.value or (), [r() for r in self._seen or ()]
        copies = [t for t in value if t is not None and not any(t is s for s in seen)]
        return sum(t.numel() * t.element_size() for t in copies)

    def get(
        self, sources: list[Tensor], plain: bool, image: tuple, derive: Callable[[], tuple]
    ) -> tuple:
        """The kept tensors, made again by ``derive()`` where ``sources`` or ``image`` changed.
        ``plain``: the sources are a module's own parameters and buffers (else one is computed
        at each read, e.g. a parametrization's weight: derived at every call)."""
        key = _key(sources, image) if plain else None
        seen = self._seen
        same = (
            seen is not None
            and len(seen) == len(sources)
            and all(s is r() for s, r in zip(sources, seen, strict=True))
        )
        if key is None or key != self._key or not same:
            with torch.no_grad():
                value = derive()
            # A source handed on as it is needs no mark: the op reads it (taking its buffer
            # for writing, which would clear the mark at every call), always current.
            if key is not None and not any(v is s for v in value for s in sources):
                _arm(sources)
                key = _key(sources, image)
            self.value = value  # (before the key: a thread that sees the key sees it)
            self._key, self._seen = key, [weakref.ref(t) for t in sources]
        return self.value

    def forget(self) -> None:
        """Derive again at the next call."""
        self._key = self._seen = self.value = None


# Every KeptWeights alive, for kept_bytes() (a weak set: it keeps none alive)
_ALL: weakref.WeakSet[KeptWeights] = weakref.WeakSet()


def kept_bytes() -> dict[str, int]:
    """The memory that the copies the TVM modules keep between calls hold now, in bytes, by
    kind: ``"bn folds"`` (``TVMConv2dBN``), ``"relaid conv weights"`` (``TVMConv2dBiasReLU``
    reading a weight in another memory format) and ``"autocast casts"`` (weights' casts kept
    across autocast regions). Each is freed with its module or weight, and made only where a
    call needs it."""
    found: dict[str, int] = {}
    for kept in list(_ALL):
        found[kept.kind] = found.get(kept.kind, 0) + kept.nbytes()
    return found


def _key(tensors: list[Tensor], image: tuple) -> tuple | None:
    """What tensors kept from ``tensors`` for inputs of ``image`` were made from: each tensor's
    version and, while its storage is marked copy-on-write (``_arm``), that mark, else its
    address (a tensor given another buffer, ``.data = ...``); None for inference tensors,
    which have no version (derived at every call). The address is read only where the mark is
    gone: reading it takes the buffer for writing, which clears the mark."""
    try:
        # (a new dtype or device means new tensors: the first one's stand for all)
        marks = [(t._version, "marked" if _marked(t) else t.data_ptr()) for t in tensors]
    except RuntimeError:
        return None
    return (marks, tensors[0].dtype, tensors[0].device, image)


# Whether a tensor's storage still carries the copy-on-write mark of ``_arm`` (never, in a
# torch without copy-on-write storage: the key then holds addresses).
_marked = getattr(torch._C, "_is_cow_tensor", lambda t: False)


def _arm(tensors: list[Tensor]) -> None:
    """Marks the storage of ``tensors`` copy-on-write, by making a lazy clone of each and
    dropping it. The first write through any alias then clears the mark (``_marked``): a
    write through torch (``.data`` included) and anything that takes a writable pointer
    (``.numpy()``, ``data_ptr()``). The clone is gone, so the writer keeps its buffer: nothing
    is copied, then or ever. A tensor whose storage cannot be marked (``torch.from_numpy``'s:
    torch does not own the buffer), or on another device than the CPU (not measured there),
    keeps its address in the key instead."""
    lazy_clone = getattr(torch, "_lazy_clone", None)
    for t in tensors:
        if lazy_clone is None or t.device.type != "cpu":
            continue
        try:
            lazy_clone(t.detach())
        except RuntimeError:
            continue


def with_gradient(
    kept: tuple,
    sources: tuple,
    derive_from: Callable[..., tuple] | None = None,
    vjp: Callable[..., tuple] | None = None,
) -> tuple:
    """``kept``, what ``derive_from(*sources)`` made (``sources`` may hold None), as outputs of
    an autograd node whose backward is ``derive_from``'s: gradients reach the sources, and the
    forward makes no new tensor. Deriving with autograd at every call instead (a pass over the
    weight, and one more for a layout copy, in fresh memory each time): a converted ResNet-50
    called outside ``no_grad()`` read 0.36-0.59x eager, 0.75-0.77x with this (Intel Xeon,
    batch 1; the rest was the ops' reference cycle, ``func_autograd.py``).

    Instead of ``derive_from``, ``vjp(*grads)``, the sources' gradients, where the derivation
    is one whose backward is that simple (a cast, a layout copy): the backward then neither
    derives again nor runs autograd over it (a LLaMA-style training step under autocast: 2
    such backward passes a weight)."""
    if (derive_from is None) == (vjp is None):
        raise TypeError("with_gradient: give derive_from or vjp, one of them")
    return _Derived.apply(derive_from, vjp, kept, *sources)


def gradient_keepable() -> bool:
    """Whether ``with_gradient`` may stand for the derivation: not under a torch.func transform
    or forward-mode AD (its node has no vmap or jvp rule; there the derivation runs as torch
    ops, as before)."""
    return torch._C._functorch.peek_interpreter_stack() is None and forward_ad._current_level < 0


class _Derived(torch.autograd.Function):
    @staticmethod
    def forward(ctx, derive_from, vjp, kept, *sources):
        ctx.derive_from, ctx.vjp = derive_from, vjp
        if vjp is None:
            ctx.save_for_backward(*sources)
        return tuple(t.detach() for t in kept)  # (new tensors on the kept buffers)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.vjp is not None:
            return (None, None, None, *ctx.vjp(*grads))
        sources = ctx.saved_tensors
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        with torch.enable_grad():  # (derived again: the backward's one pass over the weight)
            derived = ctx.derive_from(*sources)
        pairs = [(d, g) for d, g in zip(derived, grads, strict=True) if d.requires_grad]
        found = torch.autograd.grad(
            [d for d, _ in pairs],
            [sources[i] for i in wanted],
            [g for _, g in pairs],
            allow_unused=True,
            create_graph=torch.is_grad_enabled(),  # (a double backward: the engine's grad mode)
        )
        result = [None] * len(sources)
        for i, g in zip(wanted, found, strict=True):
            result[i] = g
        return (None, None, None, *result)
