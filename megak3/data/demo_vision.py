"""The built-in image–text demo corpus (``data=demo_vision``): rendered shapes with captions that describe them.

No download and no package data: every document is drawn by Pillow from a seeded generator, so
the corpus is the same on every machine. Document ``i`` is one image followed by its caption::

    <image>two red circles.

The image (56 or 84 pixels a side: 4, 6 or 9 vision tokens at patch 14 x merge 2) shows ``count``
(1-3) filled ``shape``s (circle, square, triangle) of one ``colour`` (7 colours) at jittered sizes
and positions on a light background. Count, colour and shape are drawn independently and appear
only in the image and its caption, so the caption's content words can be predicted from the
pixels and from nothing else: with the images replaced by noise the best a model can do is the
marginal distribution (tools/vision_ablation.py measures the gap).

The corpus is written as JSON lines + PNG files and run through the real image–text preprocessor
(:func:`megak3.data.vision_dataset.preprocess_image_text`), then the PNGs are deleted: the
dataset keeps only the indexed tokens and the image store. Built once per (format, vocab size,
document count) under the data cache, atomically like the text demo.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Tuple

import numpy as np

from megak3.data.demo_cache import PREFIX_NAME, cached_corpus

FORMAT_VERSION = 1
NUM_DOCS = 3000
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20),
           "purple": (140, 40, 170), "orange": (240, 130, 20), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("one", "two", "three")
SIZES = ((56, 56), (56, 84), (84, 56), (84, 84))  # (H, W)


def render(i: int) -> Tuple[np.ndarray, str]:
    """Document ``i``: (uint8 [H, W, 3] image, caption) from a generator seeded by ``i``."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([20, i])
    H, W = SIZES[rng.integers(len(SIZES))]
    count = int(rng.integers(1, 4))
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    shape = SHAPES[rng.integers(len(SHAPES))]
    bg = tuple(int(v) for v in rng.integers(225, 256, 3))
    im = Image.new("RGB", (W, H), bg)
    draw = ImageDraw.Draw(im)
    # one shape per cell of a 1 x count strip along the longer side, so shapes never overlap
    cells = [(k * W // count, 0, (k + 1) * W // count, H) if W >= H else (0, k * H // count, W, (k + 1) * H // count)
             for k in range(count)]
    for x0, y0, x1, y1 in cells:
        r = int(rng.integers(9, max(10, min(x1 - x0, y1 - y0) // 2 - 1)))
        cx = int(rng.integers(x0 + r, x1 - r + 1))
        cy = int(rng.integers(y0 + r, y1 - r + 1))
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif shape == "square":
            draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    caption = f"{COUNT_WORDS[count - 1]} {colour} {shape}{'s' if count > 1 else ''}."
    return np.asarray(im), caption


def build_demo_vision_dataset(cache_dir, vocab_size: int = 512, num_docs: int = NUM_DOCS,
                              progress: bool = True) -> Tuple[str, str]:
    """Build (once) and return ``(prefix, tokenizer_path)`` of the image–text demo under ``cache_dir``."""
    from PIL import Image

    from megak3.data.vision_dataset import format_image_stats, preprocess_image_text

    def build(tmp: Path) -> dict:
        src = tmp / "src"
        (src / "img").mkdir(parents=True)
        with open(src / "captions.jsonl", "w") as f:
            for i in range(num_docs):
                arr, caption = render(i)
                Image.fromarray(arr).save(src / "img" / f"{i:05d}.png")
                f.write(json.dumps({"text": "<image>" + caption, "images": [f"img/{i:05d}.png"]}) + "\n")
        stats = preprocess_image_text([src / "captions.jsonl"], tmp / PREFIX_NAME, train_tokenizer=True,
                                      vocab_size=vocab_size)
        shutil.rmtree(src)
        return stats

    return cached_corpus(cache_dir, f"demo-vision-v{vocab_size}",
                         f"megak3-demo-vision v{FORMAT_VERSION} vocab={vocab_size} docs={num_docs}", build,
                         lambda stats: "demo_vision corpus: " + format_image_stats(stats), progress)
