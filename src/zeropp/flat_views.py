"""The tensors a flat buffer hands out: its module attributes, one leaf per original
parameter (`ParamInfo`) on the storage of the flat's full weights; and which flat
owns each of them and each master shard (`owner_of`).

[Note: how the full weights reach the module and come back in backward]
`full` is one flat buffer whose storage is allocated for a gather and resized to zero bytes to free
it; the storage object lives on, so tensors autograd saved in forward see the weights again once
backward re-gathers into it. The module attributes are `params`: one leaf tensor per original
parameter, made once on `full`'s storage (`set_`, not a view: each has a version counter of its own,
so the collectives writing into `full` do not trip autograd's in-place check). Outside a gather each
shows 0 elements (its `.data` swapped to an empty tensor, and back to its view of `full` when a
gather completes; `.data` moves no version counter, so a leaf autograd saved finds its view again):
a freed weight read by mistake is an empty tensor, not freed memory, and DeepSpeed's rule (a ZeRO-3
parameter is 0-sized unless gathered, `ds_shape` its shape) holds for code written against it. A
unit whose backward reads no weights is not gathered for it: its attributes take their shapes on the
empty storage for that backward (flat_param.py, SHAPED), as autograd checks a leaf's shape when its
gradient arrives. Each one's gradient goes to the flat's (flat_grad.py, "how a unit's gradient is
assembled").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class ParamInfo:
    """One original parameter: where it sits in the flat buffer and who holds it."""

    fqns: list[str]                     # every name it is reachable under (tied: several)
    registrations: list[tuple[nn.Module, str]]
    shape: torch.Size
    numel: int
    offset: int


class FlatViews:
    """The attributes (`params`) of the parameters `infos` places in `full`."""

    def __init__(self, infos: list[Any], full: torch.Tensor) -> None:
        self.infos = infos
        self.params = [_on(full, info) for info in infos]
        self._empty = full.new_empty(0)
        self.renew(full)

    def renew(self, full: torch.Tensor) -> None:
        """What the attributes show when gathered: their places in `full` (a new
        buffer: the old one lives on for whoever took a tensor from it)."""
        self._views = [_on(full, info) for info in self.infos]

    def show(self, gathered: bool) -> None:
        """The attributes show their views of `full`, or 0 elements."""
        for t, view in zip(self.params, self._views):
            # `.data`, not set_(): no version bump; autograd's saved leaves stay valid.
            t.data = view if gathered else self._empty

    def install(self, gathered: bool) -> None:
        """The modules' attributes are these tensors again (code may have replaced one)."""
        self.show(gathered)
        for t, info in zip(self.params, self.infos):
            for mod, attr in info.registrations:
                mod.__dict__[attr] = t  # plain attribute: the Parameter was removed


# owner_of's table: id(tensor) -> (the tensor, its FlatParam), both weakly (tensors
# compare elementwise), for every master shard and module attribute zeropp hands out.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(t: Any) -> Any:
    """The FlatParam whose master shard or module attribute `t` is, or None."""
    entry = _OWNERS.get(id(t))
    return entry[1]() if entry is not None and entry[0]() is t else None


def own(flat: Any, tensors: list[torch.Tensor]) -> None:
    """`flat` (a FlatParam) is the owner of `tensors` while both live."""
    for t in tensors:
        key = id(t)
        _OWNERS[key] = (weakref.ref(t, lambda _r, k=key: _OWNERS.pop(k, None)), weakref.ref(flat))


def _on(full: torch.Tensor, info: Any) -> torch.Tensor:
    """A tensor of `info.shape` on `full`'s storage at `info.offset`."""
    return full.new_empty(0).set_(full.untyped_storage(), info.offset, info.shape)
