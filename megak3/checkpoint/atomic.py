"""Atomic checkpoint directories: staging, fsync, rename, the ``latest`` pointer, retention, validation.

Layout under a checkpoint root::

    root/
      step_00000100/            one directory per checkpoint (files: :mod:`.writer` / :mod:`.legacy`)
        manifest.json           written last inside the directory: step, files + sizes [+ sha256], meta
      step_00000200/
      latest                    text file holding "step_00000200", replaced LAST

A save is crash-safe at every point: files are written into a staging directory ``root/.tmp-step_xxx*``,
fsynced, the directory is renamed into place (:func:`publish`), and only then is ``latest`` replaced. A
crash before the rename leaves a stale ``.tmp-*`` directory that readers ignore and the next save removes
(:func:`remove_stale`); a crash before the pointer update leaves ``latest`` naming the previous complete
checkpoint. Readers trust nothing: every file's size and sha256 are checked against the manifest
(:func:`validate_checkpoint`), and :func:`find_latest` falls back to the newest checkpoint that passes (one
warning per rejected one).

The manifest lists its files by name; ``format_version`` is bumped when the meaning of the files changes.
Version 1 is the older ``state.pt`` + per-rank ``rank_XXXXX.pt`` parts (:mod:`.legacy`); version 2 is the
per-shard format (:mod:`.writer`, ``"format": "megak3.shards.v1"`` in the manifest). Both pass
``validate_checkpoint`` / ``find_latest``. A manifest entry without a ``sha256`` (the per-shard ``.bin``
payload files, whose integrity is per-chunk crc32) is checked for its size only.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

FORMAT_VERSION = 1
"""format_version of the older per-rank part checkpoints (:mod:`.legacy`)"""
SHARDS_FORMAT_VERSION = 2
"""format_version written by :class:`megak3.checkpoint.writer.ShardedCheckpointer`"""
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


class CheckpointWarning(UserWarning):
    """An invalid checkpoint was skipped while searching for the latest complete one."""


def step_dirname(step: int) -> str:
    """Directory name of the checkpoint for ``step`` (zero-padded so names sort like steps)."""
    return f"step_{step:08d}"


def check_step(step) -> int:
    """``step`` if it is a non-negative int; ValueError naming it otherwise."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step={step!r} must be a non-negative int")
    return step


def check_keep_last(keep_last) -> None:
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"checkpoint keep_last={keep_last!r} must be an int >= 1 or None (keep all)")


# ----------------------------------------------------------------------------------------- writing

def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames/creations inside it survive a power loss."""
    _fsync_path(path)


def write_text_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_bytes(path: Path, data) -> dict:
    """Write ``data`` to ``path`` without fsync (the caller fsyncs it, e.g. with :func:`fsync_files`,
    before publishing); returns its manifest entry (bytes + sha256)."""
    with open(path, "wb") as f:
        f.write(data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_bytes_durably(path: Path, data) -> dict:
    """Write ``data`` to ``path``, fsync; returns its manifest entry (bytes + sha256)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths) -> None:
    """fsync the files at ``paths`` (written and closed), concurrently: a journaling file system
    commits concurrent fsyncs together (20 small files: 160 ms one after another, 60-75 ms at once
    on the test VM's disk). Returns once every one is durable; raises the first OSError."""
    paths = list(paths)
    if len(paths) <= 1:
        for p in paths:
            _fsync_path(p)
        return
    with ThreadPoolExecutor(min(16, len(paths)), thread_name_prefix="ckpt-fsync") as ex:
        for _ in ex.map(_fsync_path, paths):
            pass


def remove_stale(root: Path, keep: tuple = ()) -> None:
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
    write_text_durably(tmp, name + "\n")
    os.replace(tmp, root / LATEST_NAME)
    fsync_dir(root)


def publish(root: Path, tmp: Path, name: str, keep_last: Optional[int]) -> Path:
    """Rename the finished staging dir ``tmp`` (manifest written and fsynced) to ``root/name``,
    point ``latest`` at it, then prune to ``keep_last``. Returns the final path."""
    final = root / name
    if final.exists():
        # Directories cannot be replaced over a non-empty target, so move the old one aside
        # (a single atomic rename), move the new one in, then delete the old one.
        aside = root / f".old-{name}-{os.getpid()}"
        os.replace(final, aside)
        os.replace(tmp, final)
        fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_dir(root)

    _write_latest(root, name)  # the commit point: only now does a resume see this checkpoint
    if keep_last is not None:
        _prune(root, keep_last, protect=final)
    return final


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
