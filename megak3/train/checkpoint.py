"""Atomic, self-validating checkpoints with a ``latest`` pointer.

Layout under a checkpoint root::

    root/
      step_00000100/            one directory per checkpoint
        state.pt                torch.save of the state dict (later: one file per rank/shard)
        manifest.json           written last inside the directory: step, files + sizes + sha256, meta
      step_00000200/
      latest                    text file holding "step_00000200", replaced LAST

A save is crash-safe at every point: files are written into ``root/.tmp-step_xxx-<pid>/``, fsynced,
the directory is renamed into place, and only then is ``latest`` replaced. A crash before the rename
leaves a stale ``.tmp-*`` directory that readers ignore and the next save removes; a crash before the
pointer update leaves ``latest`` naming the previous complete checkpoint. Readers trust nothing: every
file's size and sha256 are checked against the manifest, and ``find_latest`` falls back to the newest
checkpoint that passes (one warning per rejected one).

The manifest lists its files by name so that sharded multi-rank checkpoints can add files
(``rank_00003.pt``, ...) without changing the layout; ``format_version`` is bumped when the meaning
of the files changes. Version 1 is this module's ``state.pt`` + per-rank ``rank_XXXXX.pt`` parts;
version 2 is the per-shard format of :mod:`megak3.train.shard_store` (``"format": "megak3.shards.v1"``
in the manifest). Both pass ``validate_checkpoint`` / ``find_latest``. A manifest entry without a
``sha256`` (the per-shard ``.bin`` payload files, whose integrity is per-chunk crc32) is checked for
its size only.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
import torch

FORMAT_VERSION = 1
"""format_version written by :func:`save_checkpoint` / :func:`commit_checkpoint`"""
SHARDS_FORMAT_VERSION = 2
"""format_version written by :class:`megak3.train.shard_store.ShardedCheckpointer`"""
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, SHARDS_FORMAT_VERSION)
MANIFEST_NAME = "manifest.json"
STATE_FILE = "state.pt"
LATEST_NAME = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Leftovers of interrupted saves: staging dirs, replaced-aside dirs, pointer temp files.
_STALE_PREFIXES = (".tmp-", ".old-", ".latest.tmp-")
_HASH_CHUNK = 1 << 22  # 4 MiB reads when verifying checksums


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file needs the full unpickler (planted code): refused, never skipped over."""


class CheckpointWarning(UserWarning):
    """An invalid checkpoint was skipped while searching for the latest complete one."""


def step_dirname(step: int) -> str:
    """Directory name of the checkpoint for ``step`` (zero-padded so names sort like steps)."""
    return f"step_{step:08d}"


# ----------------------------------------------------------------------------------------- writing

class _HashingWriter:
    """Write-only file wrapper that counts bytes and computes sha256 as torch.save streams out,
    so a save never has to read its own (possibly huge) files back."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, b) -> int:
        self.sha256.update(b)
        self.nbytes += len(b)
        return self._f.write(b)

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(path: Path) -> None:
    """fsync a directory so that renames/creations inside it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_torch_file(path: Path, obj: Any) -> dict:
    """torch.save ``obj`` to ``path`` durably; returns its manifest entry."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": w.nbytes, "sha256": w.sha256.hexdigest()}


def _write_text_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove_stale(root: Path, keep: tuple = ()) -> None:
    """Clean up after crashed saves (one writer per root is assumed), except the names in ``keep``.

    A ``.old-step_x-*`` directory whose ``step_x`` is gone is a complete checkpoint caught between
    the two renames of a same-step overwrite: it is moved back instead of deleted.
    """
    for p in root.iterdir():
        if not p.name.startswith(_STALE_PREFIXES) or p.name in keep:
            continue
        if p.name.startswith(".old-"):
            original = root / p.name[len(".old-"):].rsplit("-", 1)[0]
            if not original.exists() and validate_checkpoint(p, verify_checksums=False)[0]:
                os.replace(p, original)
                continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name`` atomically (temp file + fsync + replace + dir fsync)."""
    tmp = root / f".latest.tmp-{os.getpid()}"
    _write_text_durably(tmp, name + "\n")
    os.replace(tmp, root / LATEST_NAME)
    _fsync_dir(root)


def save_checkpoint(root, step: int, state: dict[str, Any], meta: Optional[dict] = None,
                    keep_last: Optional[int] = None) -> Path:
    """Save ``state`` as checkpoint ``root/step_<step>/`` atomically and point ``latest`` at it.

    ``state`` is anything ``torch.save`` accepts (tensors, nested dicts/lists, numbers, strings;
    keep it to those so it loads with ``weights_only=True``). ``meta`` is a JSON-serialisable dict
    stored verbatim in the manifest (config, data position, ...). Saving a step that already
    exists replaces it. ``keep_last=N`` then deletes older complete checkpoints so that the N with
    the highest steps remain; the checkpoint just written is never deleted. Returns its path.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step={step!r} must be a non-negative int")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"checkpoint keep_last={keep_last!r} must be an int >= 1 or None (keep all)")
    meta = dict(meta or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta must be JSON-serialisable ({e}); put tensors in `state` "
                         f"and convert config objects with dataclasses.asdict") from e

    staging = prepare_staging(root, step)
    return commit_checkpoint(root, step, staging, state, meta=meta, keep_last=keep_last)


def prepare_staging(root, step: int) -> Path:
    """Create the (empty) staging directory of checkpoint ``step`` and return it.

    Multi-rank saves: one rank calls this, every rank writes its part with :func:`write_part`
    into it, and the same rank then calls :func:`commit_checkpoint` with the parts' entries.
    Stale staging directories of crashed saves are removed first.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root)
    tmp = root / f".tmp-{step_dirname(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_part(staging, filename: str, obj: Any) -> dict:
    """torch.save one part (e.g. a rank's shard) into a staging directory; returns its manifest entry."""
    if "/" in filename or filename in (STATE_FILE, MANIFEST_NAME):
        raise ValueError(f"checkpoint part name {filename!r} must be a plain file name other than "
                         f"{STATE_FILE} and {MANIFEST_NAME}")
    return _write_torch_file(Path(staging) / filename, obj)


def commit_checkpoint(root, step: int, staging, state: dict[str, Any], parts: Optional[dict] = None,
                      meta: Optional[dict] = None, keep_last: Optional[int] = None) -> Path:
    """Write ``state`` and the manifest (listing ``parts``: name -> entry from write_part) into
    ``staging``, rename it to ``root/step_<step>/`` and point ``latest`` at it. Returns the path."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step={step!r} must be a non-negative int")
    root, tmp = Path(root), Path(staging)
    meta = dict(meta or {})
    name = step_dirname(step)
    files = dict(parts or {})
    files[STATE_FILE] = _write_torch_file(tmp / STATE_FILE, state)
    manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files,
                "meta": meta, "created_unix": time.time()}
    # The manifest goes last: a directory whose manifest parses had all its files written first.
    _write_text_durably(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_dir(tmp)
    return _publish(root, tmp, name, keep_last)


def _publish(root: Path, tmp: Path, name: str, keep_last: Optional[int]) -> Path:
    """Rename the finished staging dir ``tmp`` (manifest written and fsynced) to ``root/name``,
    point ``latest`` at it, then prune to ``keep_last``. Returns the final path."""
    final = root / name
    if final.exists():
        # Directories cannot be replaced over a non-empty target, so move the old one aside
        # (a single atomic rename), move the new one in, then delete the old one.
        aside = root / f".old-{name}-{os.getpid()}"
        os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
        _fsync_dir(root)

    _write_latest(root, name)  # the commit point: only now does a resume see this checkpoint
    if keep_last is not None:
        _prune(root, keep_last, protect=final)
    return final


def load_part(path, filename: str, map_location="cpu"):
    """Load one part of a checkpoint that :func:`load_checkpoint` has validated (safe loader)."""
    return safe_load((Path(path) / filename).read_bytes(), Path(path) / filename, map_location)


def safe_load(data: bytes, name, map_location="cpu"):
    """Unpickle checkpoint bytes with torch's safe loader (``weights_only=True``: tensors, plain
    containers, primitives). A file that needs the full unpickler is refused with one line naming
    it: checkpoints travel between people and clusters and a manifest's hashes are not signatures,
    so a replaced pickle must never run."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UnsafeCheckpointError(f"checkpoint file {name} holds objects that only a full unpickler could load "
                              f"(refused; nothing in it was run): {first[:160]}") from None


def safe_dumps(obj, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, checked to load with :func:`safe_load`: a value that would
    need the full unpickler is refused before anything is written, naming it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"checkpoint {what} must hold only tensors, plain containers and primitives "
                         f"(weights_only-loadable): {first[:160]}") from None
    return data


def _prune(root: Path, keep_last: int, protect: Path) -> None:
    """Delete complete checkpoints beyond the ``keep_last`` highest steps, never ``protect``.

    Incomplete directories are left alone: they are skipped by readers anyway and may be wanted
    for a post-mortem. Only sizes are checked here (checksums would re-read every checkpoint).
    """
    complete = [p for p in list_checkpoints(root) if validate_checkpoint(p, verify_checksums=False)[0]]
    for p in complete[:-keep_last]:
        if p != protect:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------------------- reading

def _step_of(path: Path) -> Optional[int]:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(root) -> list[Path]:
    """All ``step_*`` directories under ``root`` (valid or not), sorted by step ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(dirs, key=_step_of)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path) -> dict:
    """Parse ``path/manifest.json``; raises ``CheckpointError`` when missing or malformed."""
    mpath = Path(path) / MANIFEST_NAME
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{mpath} is missing (save interrupted?)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath} is unreadable or not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) \
            or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"{mpath} lacks the 'step' / 'files' entries")
    version = manifest.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(f"{mpath} has format_version={version!r}; this code reads "
                              f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}")
    return manifest


def validate_checkpoint(path, verify_checksums: bool = True) -> tuple[bool, str]:
    """Check a checkpoint directory against its manifest.

    Returns ``(True, "ok")`` or ``(False, reason)``. Checks: manifest present and parseable, step
    matching the directory name, every listed file present with the recorded byte size and (when
    ``verify_checksums``) the recorded sha256; files whose entry has no sha256 are checked for size only.
    """
    path = Path(path)
    if not path.is_dir():
        return False, f"{path} is not a directory"
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return False, str(e)
    if _step_of(path) is not None and _step_of(path) != manifest["step"]:
        return False, f"{path.name} holds manifest step {manifest['step']}"
    for fname, entry in manifest["files"].items():
        fpath = path / fname
        if not fpath.is_file():
            return False, f"{fpath} is missing"
        size = fpath.stat().st_size
        if size != entry.get("bytes"):
            return False, f"{fpath} has {size} bytes, manifest says {entry.get('bytes')} (truncated?)"
        if verify_checksums and "sha256" in entry and _sha256_file(fpath) != entry["sha256"]:
            return False, f"{fpath} fails its sha256 check (corrupt)"
    return True, "ok"


def find_latest(root, verify_checksums: bool = True, exclude=()) -> Optional[Path]:
    """The checkpoint to resume from, or None when ``root`` holds no valid checkpoint.

    Prefers the one named by ``root/latest`` (the last committed save) when it validates; otherwise
    the valid ``step_*`` directory with the highest step. Each invalid checkpoint met on the way is
    reported with one ``CheckpointWarning`` and skipped; those in ``exclude`` (paths a reader already
    failed on) are skipped silently.
    """
    root = Path(root)
    rejected: set[Path] = {Path(p) for p in exclude}
    pointer = root / LATEST_NAME
    if pointer.is_file():
        name = pointer.read_text().strip()
        cand = root / name
        if _STEP_RE.match(name) is None:
            warnings.warn(f"checkpoint pointer {pointer} holds {name!r}, not a step directory; "
                          f"scanning {root}", CheckpointWarning, stacklevel=2)
        elif cand not in rejected:
            ok, reason = validate_checkpoint(cand, verify_checksums)
            if ok:
                return cand
            rejected.add(cand)
            warnings.warn(f"skipping checkpoint {cand} named by {pointer}: {reason}",
                          CheckpointWarning, stacklevel=2)
    for cand in reversed(list_checkpoints(root)):
        if cand in rejected:
            continue
        ok, reason = validate_checkpoint(cand, verify_checksums)
        if ok:
            return cand
        warnings.warn(f"skipping invalid checkpoint {cand}: {reason}", CheckpointWarning, stacklevel=2)
    return None


def load_checkpoint(path, map_location="cpu") -> tuple[dict, dict]:
    """Validate and load a checkpoint directory; returns ``(state, manifest)``.

    Raises ``CheckpointError`` naming the problem when the checkpoint is incomplete or corrupt.
    ``state.pt`` is read with :func:`safe_load` (tensors, containers and primitives: all that
    ``save_checkpoint`` callers store).
    """
    path = Path(path)
    ok, reason = validate_checkpoint(path)
    if not ok:
        raise CheckpointError(f"cannot load checkpoint {path}: {reason}")
    manifest = read_manifest(path)
    state = safe_load((path / STATE_FILE).read_bytes(), path / STATE_FILE, map_location)
    return state, manifest


# --------------------------------------------------------------------------------------------- RNG

def capture_rng_state() -> dict:
    """Snapshot of Python ``random``, NumPy's global RNG, torch CPU and (if available) all CUDA RNGs.

    Stored as tensors / plain containers only, so it round-trips through ``weights_only`` loading.
    """
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore a ``capture_rng_state`` snapshot (CUDA states only for the devices present)."""
    random.setstate(_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
                         "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device=i)


def _to_tuples(x):
    """``random.setstate`` needs tuples; a JSON or other round trip may have turned them into lists."""
    return tuple(_to_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
