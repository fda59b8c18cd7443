"""A checkpoint on disk: the manifest and verified reads of rank files, which need no process
group (`zeropp export` consolidates a checkpoint from them alone: cli/export.py).

A checkpoint is a directory:
  manifest.json           JSON: format, world and node size, config, step, each flat parameter's
                          layout (original names, shapes, offsets, shard size, storage), buffer
                          shapes, optimizer hyper-parameters, extras, each rank file's size/sha256
  rank00000.safetensors   one per rank: master shards (`model/<flat>`), optimizer-state shards
  ...                     (`optim/<flat>/<key>`), RNG states, per-rank extras; rank 0 also buffers

[Note: data, never code]
Tensors are read only as safetensors and all else is JSON: loading a checkpoint runs no code
from it. A file is hashed before it is parsed (a replaced, truncated or altered file is named);
file names come only from a fixed pattern (a manifest cannot point outside its directory).

[Note: resharding]
A flat parameter's shard r holds elements [r*S, (r+1)*S) of the flat buffer, and the manifest
records where each original parameter sits in it. So any element of any parameter can be read
from the saved files, whatever world size, block size or unit split wrote them: a new shard is
assembled parameter by parameter from byte ranges of the saved shards covering it (slices, not
whole files). Frozen weights stored as integers are dequantized (requantized if layouts differ).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch

from .quant import QTensor, dequantize

FORMAT, VERSION = "zeropp-checkpoint", 1
MANIFEST = "manifest.json"
_RANK_FILE = re.compile(r"rank\d{5}\.safetensors")
_KEYS = "__zeropp_dict_keys__"  # see jsonable


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, chunks: Iterable[Any]) -> str:
    """Write the bytes-like `chunks` to `path`, fsynced; returns their sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str]) -> tuple[str, int]:
    """Write `tensors` as a safetensors file, fsynced, streamed tensor by tensor from their own
    memory (safetensors' `save` builds the whole file in memory first: twice a rank's shards
    at the peak). Returns the file's sha256 and size."""
    header: dict[str, Any] = {"__metadata__": metadata}
    flat, offset = {}, 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"{name}: dtype {t.dtype} has no safetensors name")
        t = t.detach().cpu().contiguous().reshape(-1)
        flat[name] = t
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    views = (memoryview(t.view(torch.uint8).numpy()) for t in flat.values() if t.numel())
    sha = write_durably(path, itertools.chain((len(head).to_bytes(8, "little"), head), views))
    return sha, 8 + len(head) + offset


def jsonable(value: Any, what: str) -> Any:
    """`value` as JSON that `read_json` reads back exactly: tuples become lists, and a dict with
    keys other than strings (MultiStepLR's milestones) becomes {_KEYS: [[key, value], ...]}."""
    def carry(v: Any) -> Any:
        if isinstance(v, dict) and not all(isinstance(k, str) for k in v):
            json.dumps(dict.fromkeys(v))  # keys JSON cannot hold at all: TypeError
            return {_KEYS: [[k, carry(x)] for k, x in v.items()]}
        if isinstance(v, dict):
            return {k: carry(x) for k, x in v.items()}
        return [carry(x) for x in v] if isinstance(v, (list, tuple)) else v
    try:
        return json.loads(json.dumps(carry(value)))
    except (TypeError, ValueError):
        raise CheckpointError(f"{what}: a {type(value).__name__} cannot be saved as JSON; pass "
                              "numbers, strings, lists, dicts, tensors, torch.Generator, or an "
                              "object with state_dict()/load_state_dict()") from None


def read_json(text: Any) -> Any:
    """JSON as `jsonable` wrote it: a dict of other keys than strings gets them back."""
    return json.loads(text, object_hook=lambda d: dict(d[_KEYS]) if set(d) == {_KEYS} else d)


def resolve(path: os.PathLike) -> Path:
    """The checkpoint directory to read: `.NAME.old` if a save died between its two renames."""
    path = Path(path)
    old = path.parent / f".{path.name}.old"
    if not path.exists() and old.is_dir() and (old / MANIFEST).is_file():
        return old
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file; a zeropp checkpoint is a directory written by "
            "zeropp.save_checkpoint (safetensors + JSON; zeropp never unpickles)")
    return path


def replaceable(path: Path) -> None:
    """A save replaces only an empty directory or a checkpoint's files: never the user's own."""
    found = sorted(p.name for p in path.iterdir()) if path.exists() else []  # (a file: OSError)
    other = [n for n in found if n != MANIFEST and not _RANK_FILE.fullmatch(n)]
    if other or found and MANIFEST not in found:
        raise CheckpointError(f"the directory exists and is not a zeropp checkpoint (it holds "
                              f"{', '.join((other or found)[:5])}); refusing to replace it")


def read_manifest(path: Path) -> dict:
    f = path / MANIFEST
    if not f.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
        raise CheckpointError(f"{path}: no {MANIFEST} (found {found}); not a zeropp "
                              "checkpoint, and zeropp loads no pickled files")
    if f.stat().st_size > 256 << 20:
        raise CheckpointError(f"{f}: implausibly large for a manifest")
    try:
        man = read_json(f.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f} is not a JSON manifest ({e.__class__.__name__}); "
                              "refusing to read the checkpoint") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a zeropp checkpoint manifest (format "
                              f"{man.get('format') if isinstance(man, dict) else None!r})")
    if man.get("version", 0) > VERSION:
        raise CheckpointError(f"{f}: format version {man['version']} is newer than this "
                              f"zeropp reads ({VERSION}); upgrade zeropp")
    files = man.get("files", {})
    bad = [n for n in files if not _RANK_FILE.fullmatch(n)]
    if bad or len(files) != man.get("world_size"):
        raise CheckpointError(f"{f}: file list is inconsistent ({bad or len(files)} for "
                              f"world size {man.get('world_size')})")
    return man


def verify(file: Path, info: dict) -> None:
    """Size and sha256 against the manifest, before the file is parsed."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (the manifest lists it)")
    size = file.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(f"{file}: {size} bytes, the manifest says {info['bytes']} "
                              "(truncated or replaced)")
    h = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != info["sha256"]:
        raise CheckpointError(f"{file}: sha256 differs from the manifest (altered or "
                              "corrupted)")


_ST_TORCH = {name: dtype for dtype, name in _ST_DTYPES.items()}


class RankFile:
    """One verified safetensors file, read with plain reads straight into tensor memory
    (safetensors' `safe_open` maps the file, and every page it touches counts as resident while
    it is open: a rank's whole file during a load). Like safe_open's handle: keys, metadata,
    get_tensor, and read(key, start, count) for a slice of a flat tensor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(size - 8, 256 << 20):
                raise CheckpointError(f"{path}: not a valid safetensors file (header of {n} "
                                      f"bytes in a file of {size})")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
        self.base = 8 + n
        meta = header.pop("__metadata__", None) or {}
        self._meta = {str(k): str(v) for k, v in meta.items()}
        self._index: dict[str, tuple] = {}
        for name, e in header.items():
            dtype = _ST_TORCH.get(e.get("dtype")) if isinstance(e, dict) else None
            shape, offs = (e.get("shape"), e.get("data_offsets")) if dtype else (None, None)
            ok = (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(offs, list) and len(offs) == 2
                  and all(isinstance(o, int) for o in offs)
                  and 0 <= offs[0] <= offs[1] <= size - self.base)
            numel = math.prod(shape) if ok else 0
            if not ok or offs[1] - offs[0] != numel * dtype.itemsize:
                raise CheckpointError(f"{path}: not a valid safetensors file (entry {name!r})")
            self._index[name] = (dtype, tuple(shape), offs[0], numel)

    def keys(self) -> list[str]:
        return list(self._index)

    def metadata(self) -> dict[str, str]:
        return dict(self._meta)

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of tensor `name`, flat."""
        dtype, _, offset, numel = self._index[name]
        start, count = max(0, start), max(0, min(count, numel - max(0, start)))
        out = torch.empty(count, dtype=dtype)
        nbytes = count * dtype.itemsize
        if nbytes:
            with open(self.path, "rb") as f:
                f.seek(self.base + offset + start * dtype.itemsize)
                if f.readinto(memoryview(out.view(torch.uint8).numpy())) != nbytes:
                    raise CheckpointError(f"{self.path}: truncated inside {name!r}")
        return out

    def get_tensor(self, name: str) -> torch.Tensor:
        _, shape, _, numel = self._index[name]
        return self.read(name, 0, numel).reshape(shape)


class Reader:
    """Verified, lazy reads of one checkpoint's rank files."""

    def __init__(self, path: Path, man: dict) -> None:
        self.path, self.man = path, man
        self._files: dict[int, Any] = {}
        self._dequantized: dict[str, torch.Tensor] = {}

    def file(self, rank: int) -> Any:
        if rank not in self._files:
            name = rank_file(rank)
            verify(self.path / name, self.man["files"][name])
            self._files[rank] = RankFile(self.path / name)
        return self._files[rank]

    def get(self, rank: int, key: str, a: int = 0, b: Optional[int] = None) -> torch.Tensor:
        """Tensor `key` of rank `rank`'s file; with `b`, its flat elements [a, b)."""
        try:
            f = self.file(rank)
            return f.get_tensor(key) if b is None else f.read(key, a, b - a)
        except KeyError:
            raise CheckpointError(f"{self.path / rank_file(rank)}: no tensor {key!r}") from None

    def values(self, flat: dict, key: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of a saved flat buffer (`key`: "model/<flat>" or "optim/<flat>/<k>")."""
        if key.startswith("model/") and flat["storage"] != "float32":
            return self._dequantize(flat)[a:b]
        s = flat["shard_numel"]
        return torch.cat([self.get(r, key, max(a, r * s) - r * s, min(b, (r + 1) * s) - r * s)
                          for r in range(a // s, max(a, b - 1) // s + 1)])  # a == b: one empty read

    def _dequantize(self, flat: dict) -> torch.Tensor:
        """A flat stored as integer wire bytes (frozen weights, qwZ), in fp32."""
        name = flat["name"]
        if name not in self._dequantized:
            bits, s = int(flat["storage"][3:]), flat["shard_numel"]
            self._dequantized[name] = torch.cat([
                dequantize(QTensor.from_bytes(self.get(r, f"model/{name}"), (s,), torch.float32,
                                              bits, flat["block"]))
                for r in range(self.man["world_size"])])
        return self._dequantized[name]


def param_index(man: dict) -> dict[str, tuple[dict, dict]]:
    """Original parameter name (every tied name) -> (saved flat, its param entry)."""
    return {n: (f, p) for f in man["flats"] for p in f["params"] for n in p["names"]}
