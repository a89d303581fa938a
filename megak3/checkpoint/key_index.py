"""The key index of a per-shard checkpoint, split into parts by key group (used by :mod:`.writer` and :mod:`.reader`).

Writing (rank 0, at commit): every key's entry (global shape, dtype, chunk list) goes to one *tensor
part* file ``index_NNNNN.json``; keys are sorted naturally (digit runs compare as numbers, so
``layers.2`` < ``layers.10`` and a pipeline stage's layers are one contiguous range) and grouped into
parts by :func:`group_of` (one part per decoder layer, per top-level module otherwise). Object keys
(the per-rank ``objects`` dicts) map to the lowest rank's file holding each in *object parts*
``objects_NNNNN.json`` the same way. A part also lists the data files its entries name with their
sizes (and, for object files, sha256), so the per-rank files appear in no file whose size grows with
the world size.

The top-level ``index.json`` holds the sorted key lists front-coded (``[[shared_prefix_len, suffix],
...]``) and, per part, its group and sha256 (its size is in the manifest; part i of a kind is file
``KIND_0000i.json``). A reader reads it (verified by the manifest's sha256), then a part only when a
key of its group is first asked for, verified by the sha256 in the top-level index: a hash tree
rooted in the manifest.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Iterable

INDEX_VERSION = 2
_DIGITS = re.compile(r"(\d+)")
_DTYPE_OF_SIZE = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "float64"}  # for size estimates


def natural_key(key: str) -> tuple:
    """Sort key of ``key`` with its digit runs compared as numbers (text at even, ints at odd slots)."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(key)))


def natural_sorted(keys: Iterable[str]) -> list:
    return sorted(keys, key=natural_key)


def front_code(keys: list) -> list:
    """``[[n, suffix], ...]``: each key as the length of the prefix it shares with the previous one and
    the rest."""
    out, prev = [], ""
    for k in keys:
        n = 0
        m = min(len(k), len(prev))
        while n < m and k[n] == prev[n]:
            n += 1
        out.append([n, k[n:]])
        prev = k
    return out


def front_decode(coded: list) -> list:
    out, prev = [], ""
    for n, suffix in coded:
        prev = prev[:n] + suffix
        out.append(prev)
    return out


def group_of(key: str) -> str:
    """The part a key belongs to: the key up to the end of its first digit run (``model/layers.12``,
    ``optim/layers.12``, ``optim_meta/layers.12``), else up to its first ``.`` (``model/embed``)."""
    m = _DIGITS.search(key)
    return key[:m.end()] if m else key.split(".", 1)[0]


def split_parts(keys: Iterable[str]) -> list:
    """Group ``keys`` (natural order) by :func:`group_of`: one list of keys per part. A part's content
    depends only on its own keys, so a reader (and the planner) can tell which parts a set of keys
    touches and their sizes without knowing the rest of the checkpoint."""
    parts: dict = {}
    for k in natural_sorted(keys):
        parts.setdefault(group_of(k), []).append(k)
    return sorted(parts.values(), key=lambda ks: natural_key(ks[0]))


def build(kind: str, entries: dict, file_info: dict, files_of) -> tuple:
    """Part files of one kind (``"index"`` or ``"objects"``): returns ``(blobs, refs)`` where ``blobs``
    maps file name (:func:`part_name`) -> bytes and ``refs`` is the top-level list ``[[group,
    sha256]]``, part i in file ``part_name(kind, i)``. ``files_of(value)`` names the data files an entry
    uses; each part lists those files' ``file_info`` entries."""
    blobs, refs = {}, []
    for i, keys in enumerate(split_parts(entries)):
        used = sorted({f for k in keys for f in files_of(entries[k])})
        body = {"format": INDEX_VERSION, "entries": {k: entries[k] for k in keys},
                "files": {f: file_info[f] for f in used}}
        data = json.dumps(body, sort_keys=True).encode()
        name = part_name(kind, i)
        blobs[name] = data
        refs.append([group_of(keys[0]), hashlib.sha256(data).hexdigest()])
    return blobs, refs


def part_name(kind: str, i: int) -> str:
    return f"{kind}_{i:05d}.json"


class PartLookup:
    """The part holding a key, from a top-level ``refs`` list (by the key's :func:`group_of`)."""

    def __init__(self, kind: str, refs: list):
        self._by_group = {g: (part_name(kind, i), {"sha256": h}) for i, (g, h) in enumerate(refs)}

    def part_of(self, key: str):
        """``(file, {"sha256"})`` of the part of ``key``; None when no part has its group."""
        return self._by_group.get(group_of(key))

    def all(self) -> list:
        return list(self._by_group.values())


def optimizer_state_names(optimizer: str) -> tuple:
    """The tensor state a param's optimizer saves (``optim/NAME/STATE`` keys): Muon's momentum, AdamW's
    two moments (AdamW's 0-dim ``step`` travels as an object)."""
    return ("momentum_buffer",) if optimizer == "muon" else ("exp_avg", "exp_avg_sq")


def read_bytes(all_keys: Iterable[str], read: dict, world_size: int, object_keys: Iterable[str] = ()) -> dict:
    """The metadata bytes a reader of the keys in ``read`` reads: the manifest (without the run's
    ``meta``), the top-level ``index.json`` and the tensor parts of their groups, laid out as
    :func:`build` writes them. ``all_keys``: every tensor key of the checkpoint; ``read``: key ->
    ``(global_shape, itemsize, n_chunks)`` for every key of each group read (``n_chunks`` pieces of the
    global tensor, split along dim 0); ``object_keys``: every object key (listed in ``index.json``).
    Chunk fields whose values the layout does not fix count at their widest: byte offsets, crc32s and
    file sizes as 10 digits. The distinct files a part names: the most chunks of one key for ``model/``
    parts (the savers of a layer's shards), the sum of its keys' chunks (at most ``world_size``) for
    optimizer parts (ZeRO-1 owners). Object parts and pickled files are not counted. Returns
    ``{"manifest", "index", "parts", "n_parts", "total"}``."""
    all_keys = natural_sorted(set(all_keys))
    groups = split_parts(all_keys)
    wide = 10 ** 9
    parts_bytes, sizes = 0, []
    by_group = {group_of(ks[0]): ks for ks in groups}
    for g in sorted({group_of(k) for k in read}, key=natural_key):
        entries, n_files = {}, 0
        for k in by_group[g]:
            gshape, itemsize, n = read[k]
            gshape = [int(s) for s in gshape]
            d0 = gshape[0] // n if gshape else 0
            nbytes = math.prod(gshape) * itemsize // max(n, 1)
            chunks = [{"byte_offset": wide, "crc32": wide, "file": "shard_00000.bin", "nbytes": nbytes,
                       "offsets": [i * d0] + [0] * (len(gshape) - 1), "shape": [d0] + gshape[1:]}
                      for i in range(n)] if gshape else \
                [{"byte_offset": wide, "crc32": wide, "file": "shard_00000.bin", "nbytes": itemsize,
                  "offsets": [], "shape": []}]
            entries[k] = {"chunks": chunks, "dtype": _DTYPE_OF_SIZE.get(itemsize, "float32"), "global_shape": gshape}
            n_files = max(n_files, n) if k.startswith("model/") else n_files + n
        n_files = max(1, min(n_files, world_size))
        files = {f"shard_{i:05d}.bin": {"bytes": wide} for i in range(n_files)}
        body = {"format": INDEX_VERSION, "entries": entries, "files": files}
        size = len(json.dumps(body, sort_keys=True).encode())
        parts_bytes += size
        sizes.append(size)
    sha = "0" * 64
    okeys = natural_sorted(set(object_keys))
    ogroups = split_parts(okeys)
    index = {"format": "megak3.shards.v1", "index_version": INDEX_VERSION, "step": wide, "world_size": world_size,
             "keys": front_code(all_keys), "parts": [[group_of(ks[0]), sha] for ks in groups],
             "object_keys": front_code(okeys), "object_parts": [[group_of(ks[0]), sha] for ks in ogroups]}
    index_bytes = len(json.dumps(index, sort_keys=True).encode())
    files = {part_name("index", i): {"bytes": wide} for i in range(len(groups))}
    files.update({part_name("objects", i): {"bytes": wide} for i in range(len(ogroups))})
    files["index.json"] = files["state.pt"] = {"bytes": wide, "sha256": sha}
    manifest = {"format_version": 2, "format": "megak3.shards.v1", "step": wide, "files": files, "meta": {},
                "created_unix": 1.7e9 + 0.123456}
    manifest_bytes = len(json.dumps(manifest, indent=1, sort_keys=True))
    return {"manifest": manifest_bytes, "index": index_bytes, "parts": parts_bytes, "n_parts": len(sizes),
            "total": manifest_bytes + index_bytes + parts_bytes}

