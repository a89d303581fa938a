"""The key index of a per-shard checkpoint, split into parts by key range (used by :mod:`.shard_store`).

Writing (rank 0, at commit): every key's entry (global shape, dtype, chunk list) goes to one *tensor
part* file ``index_NNNNN.json``; keys are sorted naturally (digit runs compare as numbers, so
``layers.2`` < ``layers.10`` and a pipeline stage's layers are one contiguous range) and cut into
parts of about ``part_bytes`` of JSON each, a key never split. Object keys (the per-rank ``objects``
dicts) map to the files that hold them in *object parts* ``objects_NNNNN.json`` the same way. A part
also lists the data files its entries name with their sizes (and, for object files, sha256), so the
per-rank files appear in no file whose size grows with the world size.

The top-level ``index.json`` holds the sorted key lists front-coded (``[[shared_prefix_len, suffix],
...]``) and, per part, its file, first key, bytes and sha256. A reader reads it (verified by
the manifest's sha256), then a part only when a key in its range is first asked for, verified by the
sha256 in the top-level index: a hash tree rooted in the manifest.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import re
from typing import Iterable

INDEX_VERSION = 2
PART_BYTES = 64 << 10  # default JSON bytes per part
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


def split_parts(entries: dict, part_bytes: int) -> list:
    """Cut ``entries`` (key -> JSON-able value) into lists of keys in natural order, each list's entries
    about ``part_bytes`` of JSON (at least one key per part)."""
    parts, cur, size = [], [], 0
    for k in natural_sorted(entries):
        n = len(k) + len(json.dumps(entries[k], sort_keys=True)) + 6
        if cur and size + n > part_bytes:
            parts.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    if cur:
        parts.append(cur)
    return parts


def build(kind: str, entries: dict, file_info: dict, files_of, part_bytes: int) -> tuple:
    """Part files of one kind (``"index"`` or ``"objects"``): returns ``(blobs, refs)`` where ``blobs``
    maps file name -> bytes and ``refs`` is the top-level list ``[{"file", "first", "bytes", "sha256"}]``
    (``first``: the part's first key; a part ends where the next begins). ``files_of(value)`` names the data files an entry uses; each part lists those
    files' ``file_info`` entries."""
    blobs, refs = {}, []
    for i, keys in enumerate(split_parts(entries, part_bytes)):
        used = sorted({f for k in keys for f in files_of(entries[k])})
        body = {"format": INDEX_VERSION, "entries": {k: entries[k] for k in keys},
                "files": {f: file_info[f] for f in used}}
        data = json.dumps(body, sort_keys=True).encode()
        name = f"{kind}_{i:05d}.json"
        blobs[name] = data
        refs.append({"file": name, "first": keys[0], "bytes": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()})
    return blobs, refs


class PartLookup:
    """Which part of a top-level ``refs`` list holds a key (bisect on the parts' first keys)."""

    def __init__(self, refs: list):
        self.refs = refs
        self._firsts = [natural_key(r["first"]) for r in refs]

    def part_of(self, key: str) -> int:
        """Index of the only part whose key range can hold ``key`` (the caller checks the key exists)."""
        return max(bisect.bisect_right(self._firsts, natural_key(key)) - 1, 0)
