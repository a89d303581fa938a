"""Images of the image–text data path: decode (Pillow), fit to the patch grid, store once, memory-map.

Decoding (:func:`load_image`) turns one file into ``uint8 [H, W, 3]`` RGB or raises
:class:`ImageSkip` with a one-word reason that the preprocessor counts:

``missing``      the path does not exist (or is not a file)
``empty``        zero bytes
``corrupt``      Pillow cannot identify or decode it (garbage, truncated file, bad header)
``too_large``    width x height above ``max_input_pixels`` (checked on the header, before decoding,
                 so a decompression bomb never allocates its pixels)
``bad_mode``     a mode with no defined RGB meaning here (float "F", 32-bit "I" beyond 16 bits, ...),
                 or any convertible mode when ``odd_modes="skip"``

Convertible modes are converted exactly instead of being thrown away (``odd_modes="convert"``,
the default): palette ("P", "PA") and grey ("L", "LA", "1") through Pillow; CMYK through Pillow's
CMYK->RGB; 16-bit grey ("I;16*", and "I" holding values < 65536) by ``v >> 8`` (Pillow's own
``convert("RGB")`` clips 16-bit values at 255, which would turn most of the image white); alpha
is composited over white. Each conversion is counted by mode.

Fitting (:func:`fit_to_grid`): native resolution, changed only (a) to a multiple of ``side`` =
patch_size * merge in each dimension (rounded to the nearest multiple, at least one), and (b)
downscaled, aspect kept, so that H * W <= ``max_pixels``. The number of LM tokens of an image is
then exactly :func:`megak3.model.vision.num_image_tokens` of its stored size.

Storage (:class:`ImageStoreBuilder` / :class:`ImageStore`) beside an indexed dataset ``prefix``:

``prefix.img.bin``  every distinct image's pixels, ``uint8`` H x W x 3 row-major, back to back
``prefix.img.idx``  ``MAGIC`` | version u64 | side u64 | images M u64 | documents N u64 | refs R u64 |
                    images ``int64[M, 3]`` (byte offset, H, W) | document ref offsets ``int64[N + 1]`` |
                    refs ``int64[R, 2]`` (image id, token offset of its first slot in the document)

An image used by several documents (same file bytes, same fit) is stored once and referenced
several times. Both files are memory-mapped: opening costs O(1) memory whatever the corpus size.
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import warnings
from pathlib import Path
from typing import Counter, Dict, Optional, Tuple, Union

import numpy as np

from megak3.data.errors import DataError

MAGIC = b"MK3IMG\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sQQQQQ")  # magic, version, side, images, docs, refs -> 48 bytes
IMAGE_SUFFIXES = (".img.bin", ".img.idx")
DEFAULT_MAX_PIXELS = 1024 * 28 * 28
"""stored pixels per image: 1024 LM tokens at patch 14 x merge 2"""
DEFAULT_MAX_INPUT_PIXELS = 8192 * 8192
"""decoded pixels per input file; larger files are skipped as ``too_large`` before decoding"""
SKIP_REASONS = ("missing", "empty", "corrupt", "too_large", "bad_mode")

PathLike = Union[str, os.PathLike]


class ImageSkip(Exception):
    """This image cannot be used; ``reason`` is one of :data:`SKIP_REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def fit_to_grid(H: int, W: int, side: int, max_pixels: int) -> Tuple[int, int]:
    """Size an H x W image is stored at: multiples of ``side``, at most ``max_pixels`` pixels.

    >>> fit_to_grid(100, 60, 28, 10**6)       # only snapped to the grid
    (112, 56)
    >>> fit_to_grid(2000, 1000, 28, 28 * 28 * 100)   # downscaled to <= 100 tokens, aspect ~2:1
    (392, 196)
    """
    if max_pixels < side * side:
        raise DataError(f"--max-pixels={max_pixels} is below one merged patch ({side}x{side}={side * side})")
    scale = min(1.0, (max_pixels / float(H * W)) ** 0.5)
    h = max(1, round(H * scale / side))
    w = max(1, round(W * scale / side))
    while h * w * side * side > max_pixels:  # rounding up may overshoot by one row/column
        if h >= w and h > 1:
            h -= 1
        elif w > 1:
            w -= 1
        else:
            break
    return h * side, w * side


def _to_rgb(im, odd_modes: str) -> Tuple[np.ndarray, Optional[str]]:
    """Pillow image -> (uint8 [H, W, 3], the mode converted from or None)."""
    from PIL import Image

    mode = im.mode
    if mode == "RGB":
        return np.asarray(im, dtype=np.uint8), None
    convertible = mode in ("P", "PA", "L", "LA", "1", "RGBA", "RGBa", "CMYK", "YCbCr") or mode.startswith("I")
    if not convertible or odd_modes == "skip":
        raise ImageSkip("bad_mode", f"mode {mode}")
    if mode.startswith("I"):  # 16-bit grey (I;16, I;16B, I;16L) or 32-bit "I" holding 16-bit data
        a = np.asarray(im)
        if a.ndim != 2 or a.size == 0 or int(a.min()) < 0 or int(a.max()) > 65535:
            raise ImageSkip("bad_mode", f"mode {mode} with values outside 0..65535")
        g = (a.astype(np.uint32) >> 8).astype(np.uint8)
        return np.repeat(g[:, :, None], 3, axis=2), mode
    if mode in ("P", "PA"):
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "RGBa", "LA"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, rgba)
    return np.asarray(im.convert("RGB"), dtype=np.uint8), mode


def load_image(path: PathLike, max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
               odd_modes: str = "convert") -> Tuple[np.ndarray, bytes, Optional[str]]:
    """Decode ``path`` -> (uint8 [H, W, 3] RGB, the file's bytes, converted-from mode or None).

    Raises :class:`ImageSkip` (see the module docstring); never any other exception for bad data.
    """
    p = Path(path)
    if not p.is_file():
        raise ImageSkip("missing", str(p))
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ImageSkip("missing", f"{p}: {e.strerror}") from None
    arr, conv = decode_image(raw, str(p), max_input_pixels, odd_modes)
    return arr, raw, conv


def decode_image(raw: bytes, p: str = "<bytes>", max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
                 odd_modes: str = "convert") -> Tuple[np.ndarray, Optional[str]]:
    """Decode an image file's bytes -> (uint8 [H, W, 3] RGB, converted-from mode or None); ``p``
    names it in messages. Raises :class:`ImageSkip` like :func:`load_image`."""
    from PIL import Image, UnidentifiedImageError

    if not raw:
        raise ImageSkip("empty", p)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(raw))
            W, H = im.size
            if W * H > max_input_pixels:  # header only: nothing decoded yet
                raise ImageSkip("too_large", f"{p}: {W}x{H} > {max_input_pixels} pixels")
            if W < 1 or H < 1:
                raise ImageSkip("corrupt", f"{p}: {W}x{H}")
            im.load()  # a truncated file fails here ("image file is truncated")
            arr, conv = _to_rgb(im, odd_modes)
    except ImageSkip:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageSkip("too_large", f"{p}: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, MemoryError,
            struct.error, IndexError, TypeError) as e:
        raise ImageSkip("corrupt", f"{p}: {type(e).__name__}: {e}") from None
    return arr, conv


def resize_to(arr_HW3: np.ndarray, H: int, W: int) -> np.ndarray:
    """Bicubic resize (Pillow, antialiased when shrinking) of uint8 [h, w, 3] to [H, W, 3]."""
    if arr_HW3.shape[:2] == (H, W):
        return np.ascontiguousarray(arr_HW3)
    from PIL import Image

    return np.asarray(Image.fromarray(arr_HW3).resize((W, H), Image.BICUBIC), dtype=np.uint8)


def pixels_to_tensor(arr_HW3: np.ndarray):
    """uint8 [H, W, 3] -> float32 tensor [3, H, W] in [-1, 1] (what the vision tower is fed)."""
    import torch

    x = torch.from_numpy(np.array(arr_HW3, dtype=np.uint8)).permute(2, 0, 1).float()  # a copy: the store is read-only
    return x.div_(127.5).sub_(1.0)


class ImageStoreBuilder:
    """Writes ``prefix.img.bin`` / ``prefix.img.idx``; documents are added in the token dataset's order.

    Like :class:`megak3.data.indexed.IndexedDatasetBuilder`: temporaries renamed into place on
    :meth:`finalize`, index last; :meth:`abort` removes them.
    """

    def __init__(self, prefix: PathLike, side: int):
        self.prefix, self.side = str(prefix), int(side)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._tmp_bin, self._tmp_idx = self.prefix + ".img.bin" + tag, self.prefix + ".img.idx" + tag
        self._bin = open(self._tmp_bin, "wb")
        self._images: list = []  # (offset, H, W)
        self._by_key: Dict[bytes, int] = {}
        self._doc_refs: list = [0]
        self._refs: list = []  # (image id, token offset)
        self._offset = 0

    def add_image(self, arr_HW3: np.ndarray, key: Optional[bytes] = None) -> int:
        """Store one fitted image (uint8 [H, W, 3], H and W multiples of side) unless ``key`` was seen; -> id."""
        if key is not None and key in self._by_key:
            return self._by_key[key]
        H, W, C = arr_HW3.shape
        assert C == 3 and H % self.side == 0 and W % self.side == 0, (arr_HW3.shape, self.side)
        data = np.ascontiguousarray(arr_HW3, dtype=np.uint8).tobytes()
        self._bin.write(data)
        self._images.append((self._offset, H, W))
        self._offset += len(data)
        i = len(self._images) - 1
        if key is not None:
            self._by_key[key] = i
        return i

    def add_document(self, refs) -> None:
        """The images of the next document, in text order: [(image id, token offset of its first slot)]."""
        self._refs.extend((int(i), int(o)) for i, o in refs)
        self._doc_refs.append(len(self._refs))

    @property
    def num_images(self) -> int:
        return len(self._images)

    def finalize(self) -> None:
        self._bin.close()
        images = np.asarray(self._images, dtype="<i8").reshape(-1, 3)
        doc_refs = np.asarray(self._doc_refs, dtype="<i8")
        refs = np.asarray(self._refs, dtype="<i8").reshape(-1, 2)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self.side, len(images), len(doc_refs) - 1, len(refs)))
            for a in (images, doc_refs, refs):
                f.write(a.tobytes())
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(self.prefix + ".img.idx"):
            os.remove(self.prefix + ".img.idx")
        os.replace(self._tmp_bin, self.prefix + ".img.bin")
        os.replace(self._tmp_idx, self.prefix + ".img.idx")

    def abort(self) -> None:
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(p):
                os.remove(p)


def has_images(prefix: PathLike) -> bool:
    """Whether ``prefix`` has an image side store (``prefix.img.idx``)."""
    return os.path.isfile(str(prefix) + ".img.idx")


class ImageStore:
    """Read-only, memory-mapped view of ``prefix.img.bin`` + ``prefix.img.idx``, validated on open."""

    def __init__(self, prefix: PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = self.prefix + ".img.bin", self.prefix + ".img.idx"
        missing = [p for p in (self.bin_path, self.idx_path) if not os.path.isfile(p)]
        if missing:
            raise DataError(f"no image store at prefix {self.prefix} (missing {', '.join(missing)}); rebuild it "
                            "with tools/preprocess_data.py --images")
        size = os.path.getsize(self.idx_path)
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != MAGIC:
            raise DataError(f"{self.idx_path} is not a megak3 image index (bad magic); rebuild it")
        _, version, side, M, N, R = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{self.idx_path}: unsupported version {version}; rebuild it")
        want = _HEADER.size + 8 * (3 * M + N + 1 + 2 * R)
        if size != want:
            raise DataError(f"{self.idx_path} is truncated or corrupt: {size} bytes, expected {want}; rebuild it")
        self.side = int(side)
        off = _HEADER.size
        mm = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=off, shape=(3 * M + N + 1 + 2 * R,))
        self.images = mm[:3 * M].reshape(M, 3)
        self.doc_refs = mm[3 * M:3 * M + N + 1]
        self.refs = mm[3 * M + N + 1:].reshape(R, 2)
        nbytes = int((self.images[:, 1] * self.images[:, 2]).sum()) * 3 if M else 0
        if os.path.getsize(self.bin_path) != nbytes or (M and int(self.images[-1, 0]) + 3 * int(
                self.images[-1, 1] * self.images[-1, 2]) != nbytes):
            raise DataError(f"{self.bin_path} has {os.path.getsize(self.bin_path)} bytes but {self.idx_path} "
                            f"describes {nbytes}: the pair is truncated or mismatched; rebuild it")
        if R and (int(self.refs[:, 0].min()) < 0 or int(self.refs[:, 0].max()) >= M):
            raise DataError(f"{self.idx_path}: an image reference is out of range (corrupt index); rebuild it")
        self._pixels = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if nbytes else np.zeros(0, np.uint8)

    @property
    def num_docs(self) -> int:
        return len(self.doc_refs) - 1

    def __len__(self) -> int:
        return len(self.images)

    def tokens_of(self, image_ids) -> np.ndarray:
        """LM tokens of each image: (H/side) * (W/side), the vision tower's arithmetic."""
        from megak3.model.vision import num_image_tokens

        hw = self.images[np.asarray(image_ids, dtype=np.int64)]
        return num_image_tokens(hw[:, 1], hw[:, 2], self.side, 1)

    def image(self, i: int) -> np.ndarray:
        """Pixels of image ``i``: read-only uint8 [H, W, 3] view into the memory map."""
        off, H, W = (int(v) for v in self.images[i])
        return self._pixels[off:off + H * W * 3].reshape(H, W, 3)

    def doc_images(self, d: int) -> np.ndarray:
        """int64 [k, 2] (image id, token offset) of document ``d``'s images, in text order."""
        return np.asarray(self.refs[self.doc_refs[d]:self.doc_refs[d + 1]])

    def __repr__(self) -> str:
        return f"ImageStore({self.prefix!r}, images={len(self)}, docs={self.num_docs}, side={self.side})"


def content_key(raw: bytes, H: int, W: int) -> bytes:
    """Deduplication key: the same file bytes fitted to the same size are one stored image."""
    return hashlib.sha1(raw).digest() + struct.pack("<QQ", H, W)


def fit_image(path: PathLike, side: int, max_pixels: int = DEFAULT_MAX_PIXELS,
              max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS, odd_modes: str = "convert",
              counts: Optional[Counter] = None) -> Tuple[np.ndarray, bytes]:
    """Load ``path`` and fit it to the grid (:func:`fit_to_grid`): (uint8 [H, W, 3], :func:`content_key`).

    Raises :class:`ImageSkip` like :func:`load_image`; a converted mode is counted in ``counts`` as
    ``converted_<mode>``."""
    arr, raw, conv = load_image(path, max_input_pixels, odd_modes)
    H, W = fit_to_grid(arr.shape[0], arr.shape[1], side, max_pixels)
    if conv and counts is not None:
        counts[f"converted_{conv}"] += 1
    return resize_to(arr, H, W), content_key(raw, H, W)
