"""Guard rails: failures that would otherwise hang every rank or train silently wrong.

- `agree`: one rank's error is raised on every rank after one small exchange; raised alone, it
  would leave the others waiting in their next collective until the timeout.
- `check_same_model`: inside `shard`, one all-gather of a 32-byte digest finds ranks whose
  models differ (parameter names, shapes, dtypes, units); all raise the same error naming the
  first difference.
- `forget_parameters`: an optimizer built on the model's parameters *before* `shard` holds
  tensors that no longer receive gradients (its step would silently do nothing); a global
  pre-step hook catches it.
- `one_line`: a mistake in the user's config (a DeepSpeed key zeropp refuses) is the user's to
  fix, not a bug to debug: uncaught, it prints as one line, not a traceback per rank.

Everything here exchanges raw bytes in tensors (no pickle crosses ranks), each exchange opening
with a header (a mark, the exchange's name, the length) that every rank checks: a rank in
another collective meanwhile (a script calling a collective on one rank only) is named in one
line, never read as a message.
"""

from __future__ import annotations

import hashlib
import json
import sys
import weakref
import zlib
from itertools import zip_longest
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .collectives import _all_gather_flat, collective_device


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_MARK = 0x7A65726F707000  # "zeropp" and a 0: opens every exchange of this file


class MismatchedCollective(RuntimeError):
    """Ranks entered different collectives: one of them is not in this exchange."""


def all_gather_bytes(data: bytes, what: str = "exchange", hint: str = "") -> list[bytes]:
    """Every rank's `data` (any length), by rank: two all-gathers, the first of the header that
    `check_peers` checks (a rank in another collective raises MismatchedCollective, with `hint`)."""
    if not _distributed():
        return [data]
    dev, w = collective_device(), dist.get_world_size()
    sizes_l = check_peers(what, hint, len(data))
    buf = torch.zeros(max(sizes_l) or 1, dtype=torch.uint8, device=dev)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    out = torch.empty(w * buf.numel(), dtype=torch.uint8, device=dev)
    _all_gather_flat(out, buf)
    rows = out.view(w, -1).cpu()
    return [bytes(rows[r, :sizes_l[r]].numpy().tobytes()) for r in range(w)]


def check_peers(what: str, hint: str = "", size: int = 0) -> list[int]:
    """Collective (one all-gather of 24 bytes): every rank's `size`, after checking that every
    rank is in this exchange (`what`); MismatchedCollective names those that are not, and `hint`."""
    if not _distributed():
        return [size]
    dev, w, tag = collective_device(), dist.get_world_size(), zlib.crc32(what.encode())
    head = torch.tensor([_MARK, tag, size], dtype=torch.int64, device=dev)
    heads = torch.empty(3 * w, dtype=torch.int64, device=dev)
    _all_gather_flat(heads, head)
    rows = heads.view(w, 3).tolist()
    strangers = [r for r, (mark, t, n) in enumerate(rows)
                 if (mark, t) != (_MARK, tag) or not 0 <= n < 1 << 31]
    if strangers:
        who = f"rank {strangers[0]} is" if len(strangers) == 1 else f"ranks {strangers} are"
        raise MismatchedCollective(f"zeropp: {who} not in this {what} (in another "
                                   f"collective meanwhile){': ' + hint if hint else ''}")
    return [n for _, _, n in rows]


def agree(error: Optional[str], exc_type: type = RuntimeError, what: str = "agreement") -> None:
    """Collective: if any rank passes an error message, every rank raises `exc_type` with the
    lowest failing rank's message (and the list of ranks)."""
    msgs = all_gather_bytes((error or "").encode(), what)
    failed = [r for r, m in enumerate(msgs) if m]
    if failed:
        others = f" (ranks failing: {failed})" if len(failed) > 1 else ""
        where = f"rank {failed[0]}: " if len(msgs) > 1 else ""
        raise exc_type(where + msgs[failed[0]].decode(errors="replace") + others)


def in_one_line(e: BaseException) -> str:
    """`Type: message` of an exception, its whitespace (newlines too) collapsed."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def first_failure(error: Optional[str], what: str = "agreement", hint: str = "") -> str:
    """Collective: "rank r raised MESSAGE" for the lowest rank that passes an error (an exception
    it is about to re-raise), "" when none does. The ranks that left normally raise it
    themselves instead of going on alone into a collective."""
    msgs = all_gather_bytes((error or "").encode(), what, hint)
    r = next((r for r, m in enumerate(msgs) if m), None)
    return "" if r is None else f"rank {r} raised {msgs[r].decode(errors='replace')}"


# ---- the same model on every rank --------------------------------------------------
def model_signature(model: torch.nn.Module, unit_names: list[str]) -> list[list]:
    """What every rank must agree on before sharding: units and parameters."""
    return [["unit", n] for n in unit_names] + [
        ["param", name, list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad]
        for name, p in model.named_parameters(remove_duplicate=False)]


def _describe(item: Optional[list]) -> str:
    if item is None or item[0] == "unit":
        return f"unit {item[1] or '<root>'!r}" if item else "nothing"
    return f"parameter {item[1]!r} shape {tuple(item[2])} {item[3]}" + (
        "" if item[4] else " (frozen)")


def check_same_model(model: torch.nn.Module, unit_names: list[str]) -> None:
    """Collective: the same ValueError on every rank unless all hold the same units and parameters
    (names, shapes, dtypes, trainability); first a TypeError for a complex or integer one."""
    odd = next(((n, p.dtype) for n, p in model.named_parameters() if not p.is_floating_point()), 0)
    if odd:
        raise TypeError(f"zeropp.shard: parameter {odd[0]!r} is {odd[1]}; only floating-point "
                        "parameters can be sharded (the master shards are fp32)")
    if not _distributed():
        return
    sig = json.dumps(model_signature(model, unit_names)).encode()
    digests = all_gather_bytes(hashlib.sha256(sig).digest(), "check of the model's signature")
    if all(d == digests[0] for d in digests):
        return
    # Rare path: exchange the full signatures to name the first difference.
    sigs = [json.loads(s) for s in all_gather_bytes(sig, "exchange of the models' signatures")]
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    i, (a, b) = next(((k, ab) for k, ab in enumerate(zip_longest(sigs[0], sigs[differ[0]]))
                      if ab[0] != ab[1]), (0, (None, None)))
    raise ValueError(
        f"zeropp.shard: the model differs across ranks (ranks {differ} differ from rank 0); "
        f"first difference at entry {i}: rank 0 has {_describe(a)}, rank {differ[0]} has "
        f"{_describe(b)}. Every rank must build the same model before shard().")


# ---- an optimizer built before shard ---------------------------------------------
# Parameters that shard() removed, by id (a WeakSet would compare tensors with ==).
_replaced: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hook: Any = None


def forget_parameters(params: list[torch.nn.Parameter]) -> None:
    """Remember parameters that `shard` took out of a model; install the pre-step check once."""
    global _hook
    for p in params:
        _replaced[id(p)] = p
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_optimizer_step)


def _check_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]  # again after add_param_group
    stale = _checked.get(opt) != len(params) and sum(_replaced.get(id(p)) is p for p in params)
    if stale:
        raise RuntimeError(
            f"zeropp: this {type(opt).__name__} holds {stale} parameter(s) of the model as it "
            "was before zeropp.shard(); after sharding they get no gradients and the step "
            "would do nothing. Build the optimizer after shard(), from model.parameters() "
            "(the fp32 master shards).")
    _checked[opt] = len(params)


_ONE_LINE = "_zeropp_one_line"
_hook_installed = False


def one_line(error: BaseException) -> BaseException:
    """Mark `error` so that, if it ends the program uncaught, it prints as `Type: message` alone
    (exit status 1, as any uncaught exception). One excepthook, installed once, holds no
    exception; other exceptions, and hooks installed before it, are untouched. Returns `error`,
    to be raised."""
    global _hook_installed
    setattr(error, _ONE_LINE, True)
    if not _hook_installed:
        previous = sys.excepthook

        def hook(tp: Any, value: BaseException, tb: Any) -> None:
            if getattr(value, _ONE_LINE, False):
                print(f"{tp.__name__}: {value}", file=sys.stderr, flush=True)
            else:
                previous(tp, value, tb)
        sys.excepthook = hook
        _hook_installed = True
    return error
