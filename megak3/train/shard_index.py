"""The key index of a per-shard checkpoint, split into parts by key range (used by :mod:`.shard_store`).

Writing (rank 0, at commit): every key's entry (global shape, dtype, chunk list) goes to one *tensor
part* file ``index_NNNNN.json``; keys are sorted naturally (digit runs compare as numbers, so
``layers.2`` < ``layers.10`` and a pipeline stage's layers are one contiguous range) and cut into
parts by :func:`group_of` (one part per decoder layer, per top-level module otherwise). Object keys (the per-rank ``objects``
dicts) map to the files that hold them in *object parts* ``objects_NNNNN.json`` the same way. A part
also lists the data files its entries name with their sizes (and, for object files, sha256), so the
per-rank files appear in no file whose size grows with the world size.

The top-level ``index.json`` holds the sorted key lists front-coded (``[[shared_prefix_len, suffix],
...]``) and, per part, its group and sha256 (its size is in the manifest; part i of a kind is file
``KIND_0000i.json``). A reader reads it (verified by
the manifest's sha256), then a part only when a key in its range is first asked for, verified by the
sha256 in the top-level index: a hash tree rooted in the manifest.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Iterable

INDEX_VERSION = 2
_DIGITS = re.compile(r"(\d+)")


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
    sha256]]``, part i in file ``part_name(kind, i)``. ``files_of(value)`` names the data files an entry uses; each part lists those
    files' ``file_info`` entries."""
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
