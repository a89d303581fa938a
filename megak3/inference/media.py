"""Images of generation requests (the CLI's ``--image``, the chat endpoint's ``image_url`` parts): bytes
from a data: URL or an allowed local file, decoded and fitted to the vision tower's grid exactly as
the training data path does (megak3/data/images.py: decode, fit to multiples of patch_size * merge
within ``max_pixels``, bicubic resize, [-1, 1] pixels), and the ``<|media|>`` slots they fill.

Untrusted requests never choose a host path: a ``file://`` URL is read only when the server's
operator named a directory (``--allowed-local-media-path``) and the URL's path, with every symlink
resolved, lies inside it; the final open refuses a symlink (O_NOFOLLOW). http(s) URLs are refused
(the server fetches nothing).
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from pathlib import Path
from typing import List, Optional, Sequence, Tuple
from urllib.parse import unquote, urlparse

from .types import InferenceError

MAX_IMAGE_BYTES = 32 << 20
IMAGE_MARKER = "<image>"
"""where a CLI prompt's images go (the image-text data format's marker, megak3/data/vision_dataset.py)"""
_DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,(.*)\Z", re.S)


def read_image_url(url: str, allowed_dir: Optional[str]) -> Tuple[bytes, str]:
    """(file bytes, a name for messages) of a data: URL or a file:// URL under ``allowed_dir``;
    InferenceError naming the fix otherwise."""
    if url.startswith("data:"):
        m = _DATA_URL.match(url)
        if not m:
            raise InferenceError("image_url: a data URL must be data:image/<type>;base64,<data>")
        try:
            raw = base64.b64decode(m.group(3), validate=True)
        except (binascii.Error, ValueError):
            raise InferenceError("image_url: the data URL's base64 payload is not valid base64") from None
        return raw, "data URL"
    if url.startswith("file:"):
        if not allowed_dir:
            raise InferenceError("image_url: local files are off on this server (the operator enables them with "
                                 "--allowed-local-media-path DIR); send a data:image/...;base64 URL")
        u = urlparse(url)
        if u.netloc not in ("", "localhost"):
            raise InferenceError("image_url: a file URL names no host (file:///path)")
        return read_local_image(unquote(u.path), allowed_dir), "file URL"
    raise InferenceError("image_url: only data:image/...;base64 URLs (and file:// under the server's "
                         "--allowed-local-media-path) are accepted; this server fetches nothing")


def read_local_image(path: str, allowed_dir: Optional[str] = None) -> bytes:
    """Bytes of the image file ``path``; with ``allowed_dir``, only a regular file inside it (symlinks
    resolved before the check, none followed at the open)."""
    p = Path(path)
    if allowed_dir is not None:
        root = Path(allowed_dir).resolve()
        real = Path(os.path.realpath(p))
        if not p.is_absolute() or not real.is_relative_to(root):
            raise InferenceError("image_url: the file is not under the server's --allowed-local-media-path")
        p = real
    try:
        fd = os.open(p, os.O_RDONLY | (getattr(os, "O_NOFOLLOW", 0) if allowed_dir is not None else 0))
    except OSError:
        raise InferenceError(f"image {'file' if allowed_dir else path}: no such readable file") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InferenceError("image: not a regular file")
        raw = f.read(MAX_IMAGE_BYTES + 1)
    if len(raw) > MAX_IMAGE_BYTES:
        raise InferenceError(f"image: larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return raw


def image_tensor(raw: bytes, model_config, name: str = "image"):
    """float32 [3, H, W] in [-1, 1] of one image file's bytes, fitted to the vision tower's grid;
    InferenceError when the model has no vision tower or the bytes are no usable image."""
    from megak3.data.images import DEFAULT_MAX_PIXELS, ImageSkip, decode_image, fit_to_grid, pixels_to_tensor, \
        resize_to

    v = model_config.vision
    if not v.enabled:
        raise InferenceError("this model has no vision tower (model.vision.enabled=false): send text only")
    try:
        arr, _ = decode_image(raw, name)
    except ImageSkip as e:
        raise InferenceError(f"{name}: not a usable image ({e.reason})") from None
    H, W = fit_to_grid(arr.shape[0], arr.shape[1], v.patch_size * v.merge, DEFAULT_MAX_PIXELS)
    return pixels_to_tensor(resize_to(arr, H, W))


def image_slots(image_CHW, model_config) -> int:
    """``<|media|>`` slots the vision tower fills for one fitted image."""
    from megak3.model.vision import num_image_tokens

    v = model_config.vision
    return int(num_image_tokens(image_CHW.shape[1], image_CHW.shape[2], v.patch_size, v.merge))


def prompt_with_images(tokenizer, text: str, slots: Sequence[int]) -> List[int]:
    """Ids of a plain-text prompt with images: each ``<image>`` marker becomes the next image's
    ``<|media|>`` slots (as the image-text data format); without markers the images come first.
    The number of markers must equal the number of images."""
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) == 1:
        pieces = ["", text] if slots else pieces
        if len(slots) > 1:
            pieces = [""] * len(slots) + [text]
    if len(pieces) - 1 != len(slots):
        raise InferenceError(f"the prompt has {len(pieces) - 1} {IMAGE_MARKER} markers for {len(slots)} images: "
                             f"give one marker per image, or none (images first)")
    ids: List[int] = []
    for k, piece in enumerate(pieces):
        if piece:
            ids += tokenizer.encode(piece)
        if k < len(slots):
            ids += [tokenizer.media_id] * slots[k]
    return ids
