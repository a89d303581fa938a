"""Image-text data path: format, malformed inputs, packing invariants, determinism/resume, demo, trainer.

Packing checks compare every row against a plain-Python reference built from the epoch's document
order (the token stream and where each image's slots lie in it), independent of the packer's code.
"""
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megak3.data import DataError, load_tokenizer
from megak3.data.demo_vision import COLOURS, build_demo_vision_dataset, render
from megak3.data.images import ImageStore, fit_to_grid, load_image, ImageSkip
from megak3.data.indexed import IndexedDataset
from megak3.data.packing import IGNORE_INDEX, Batcher
from megak3.data.vision_dataset import VisionPackedDataset, open_split, preprocess_image_text

ROOT = Path(__file__).resolve().parents[1]
SIDE = 28
MEDIA = 3


def _png(path, arr):
    Image.fromarray(arr).save(path)
    return path.name


def _huge_png_header(path, W=100_000, H=100_000):
    """A PNG whose header claims W x H pixels (a decompression bomb's header; no real pixel data)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path.name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 good records (1-3 images each, sizes off the grid, one image shared by 3 records) + bad ones."""
    root = tmp_path_factory.mktemp("vision_corpus")
    img = root / "img"
    img.mkdir()
    rng = np.random.default_rng(0)
    good = []
    shared = _png(img / "shared.png", rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    for i in range(40):
        k = int(rng.integers(1, 4))
        names = []
        for j in range(k):
            H, W = (int(v) for v in rng.integers(20, 130, 2))
            names.append("img/" + _png(img / f"g{i}_{j}.png", rng.integers(0, 256, (H, W, 3), dtype=np.uint8)))
        if i % 13 == 0:
            names[0] = "img/" + shared
        text = " ".join(f"<image> words {i} {j}" for j in range(k)) + " the end."
        good.append({"text": text, "images": names})
    # malformed inputs, each a record of its own
    (img / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png at all" * 3)
    (img / "zero.png").write_bytes(b"")
    full = (img / "g0_0.png").read_bytes()
    (img / "truncated.png").write_bytes(full[: len(full) // 2])
    _huge_png_header(img / "huge.png")
    (img / "text.png").write_text("hello, I am text in a .png")
    Image.fromarray(rng.integers(0, 2, (40, 40), dtype=np.uint8).astype(np.float32)).save(img / "float.tif")
    bad = [
        {"text": "<image> corrupt", "images": ["img/corrupt.png"]},
        {"text": "<image> zero bytes", "images": ["img/zero.png"]},
        {"text": "<image> truncated", "images": ["img/truncated.png"]},
        {"text": "<image> huge", "images": ["img/huge.png"]},
        {"text": "<image> not an image", "images": ["img/text.png"]},
        {"text": "<image> float mode", "images": ["img/float.tif"]},
        {"text": "<image> missing", "images": ["img/nope.png"]},
        {"text": "<image> <image> two markers, one image", "images": ["img/g0_0.png"]},
        {"text": "no marker, one image", "images": ["img/g0_0.png"]},
        {"text": "<image> ok image, then a bad one <image>", "images": ["img/g0_0.png", "img/zero.png"]},
        {"images": ["img/g0_0.png"]},  # no text
        {"text": "<image> images not a list", "images": "img/g0_0.png"},
    ]
    lines = [json.dumps(r) for r in good[:20]] + [json.dumps(r) for r in bad] + ["{not json"] \
        + [json.dumps(r) for r in good[20:]]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    # odd but valid modes: converted exactly (their own file, checked pixel by pixel)
    grey16 = (np.arange(40 * 56, dtype=np.uint32).reshape(40, 56) * 29 % 65536).astype(np.uint16)
    Image.fromarray(grey16).save(img / "grey16.png")
    cmyk = Image.new("CMYK", (56, 28), (0, 255, 255, 0))  # pure red in CMYK
    cmyk.save(img / "cmyk.jpg", quality=100)
    pal = Image.new("P", (28, 56))
    pal.putpalette([0, 0, 255, 0, 255, 0] + [0] * 762)
    pal.putpixel((0, 0), 1)
    pal.save(img / "palette.png")
    odd = [{"text": f"<image> {m}", "images": [f"img/{f}"]}
           for m, f in (("grey16", "grey16.png"), ("cmyk", "cmyk.jpg"), ("palette", "palette.png"))]
    (root / "odd.jsonl").write_text("\n".join(json.dumps(r) for r in odd) + "\n")
    out = tmp_path_factory.mktemp("vision_ds") / "ds"
    stats = preprocess_image_text([root / "data.jsonl"], out, train_tokenizer=True, vocab_size=300,
                                  max_pixels=4 * SIDE * SIDE * 4, max_input_pixels=4096 * 4096)
    return root, str(out), stats, good


def test_format_tokens_and_store(corpus):
    root, prefix, stats, good = corpus
    ds, store, tok = IndexedDataset(prefix), ImageStore(prefix), load_tokenizer(Path(prefix).parent / "tokenizer.json")
    assert len(ds) == store.num_docs == stats["docs"] == len(good)
    assert stats["image_refs"] == sum(len(r["images"]) for r in good)
    assert stats["images"] == len(store) == stats["image_refs"] - 4 + 1  # shared.png in 4 records: stored once
    for d, rec in enumerate(good):
        toks, refs = ds.doc(d), store.doc_images(d)
        assert len(refs) == len(rec["images"])
        for (image_id, off), name in zip(refs, rec["images"]):
            H, W = store.images[image_id, 1:]
            assert H % SIDE == 0 and W % SIDE == 0 and H * W <= 16 * SIDE * SIDE
            src = np.asarray(Image.open(root / name).convert("RGB"))
            assert (H, W) == fit_to_grid(*src.shape[:2], SIDE, 16 * SIDE * SIDE)
            n = (H // SIDE) * (W // SIDE)
            assert (toks[off:off + n] == MEDIA).all() and (off + n == len(toks) or toks[off + n] != MEDIA)
        assert int((toks == MEDIA).sum()) == sum(int(store.tokens_of([i])[0]) for i, _ in refs)
        # the text between the slots is the record's text without the markers
        text = tok.decode([t for t in toks.tolist() if t != MEDIA], skip_special_tokens=True)
        assert text == rec["text"].replace("<image>", "")
    assert stats["vision_tokens"] == int(sum((ds.doc(d) == MEDIA).sum() for d in range(len(ds))))
    # an image already on the grid is stored with its exact pixels
    arr = np.random.default_rng(1).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    Image.fromarray(arr).save(root / "exact.png")
    got, _, _ = load_image(root / "exact.png")
    assert np.array_equal(got, arr)


def test_malformed_inputs_are_skipped_and_counted(corpus):
    _, _, stats, _ = corpus
    assert stats["records"] == 40 + 12 - 2  # bad JSON and non-list images are not records
    assert stats["bad_json"] == 1 and stats["bad_record"] == 2
    assert stats["corrupt"] == 3  # garbage bytes, truncated file, text named .png
    assert stats["empty"] == 2  # zero-byte file (alone and after a good image)
    assert stats["too_large"] == 1 and stats["bad_mode"] == 1 and stats["missing"] == 1
    assert stats["marker_mismatch"] == 2
    assert stats["skipped_records"] == 13


def test_odd_modes_converted_exactly_or_skipped(corpus, tmp_path):
    root = corpus[0]
    g, _, conv = load_image(root / "img" / "grey16.png")
    want = ((np.arange(40 * 56, dtype=np.uint32).reshape(40, 56) * 29 % 65536) >> 8).astype(np.uint8)
    assert conv.startswith("I") and np.array_equal(g[..., 0], want) and np.array_equal(g[..., 2], want)
    c, _, conv = load_image(root / "img" / "cmyk.jpg")
    assert conv == "CMYK" and c.shape == (28, 56, 3) and (np.abs(c.astype(int) - [255, 0, 0]) <= 3).all()
    p, _, conv = load_image(root / "img" / "palette.png")
    assert conv == "P" and tuple(p[0, 0]) == (0, 255, 0) and tuple(p[5, 5]) == (0, 0, 255)
    with pytest.raises(ImageSkip) as e:
        load_image(root / "img" / "cmyk.jpg", odd_modes="skip")
    assert e.value.reason == "bad_mode"
    stats = preprocess_image_text([root / "odd.jsonl"], tmp_path / "odd", tokenizer_path=Path(corpus[1]).parent
                                  / "tokenizer.json")
    assert stats["docs"] == 3 and stats["converted_CMYK"] == 1 and stats["converted_P"] == 1
    stats = preprocess_image_text([root / "odd.jsonl", root / "data.jsonl"], tmp_path / "skip",
                                  tokenizer_path=Path(corpus[1]).parent / "tokenizer.json", odd_modes="skip")
    assert stats["docs"] == 40 and stats["bad_mode"] == 4


def test_unusable_input_is_one_line_error(corpus, tmp_path):
    root = corpus[0]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "<image>", "images": ["nope.png"]}) + "\n")
    tok = str(Path(corpus[1]).parent / "tokenizer.json")
    with pytest.raises(DataError, match="no usable image-text record .*missing 1"):
        preprocess_image_text([tmp_path / "bad.jsonl"], tmp_path / "out", tokenizer_path=tok)
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.img.idx").exists()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--images", "--input",
                        str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "out"), "--tokenizer", tok],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--images", "--input",
                        str(root / "data.jsonl"), "--output-prefix", str(tmp_path / "cli"), "--tokenizer", tok],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "40 docs" in r.stdout and "missing 1" in r.stdout, r.stdout + r.stderr


def _reference_epoch(packed: VisionPackedDataset, epoch: int):
    """(token stream, per-token: is it the first slot of image k (else -1)) of ``epoch``, in plain Python."""
    stream, img_at, ids = [], [], []
    for d in packed.epoch_order(epoch):
        toks = packed.dataset.doc(int(d)).tolist()
        starts = {int(o): int(i) for i, o in packed.store.doc_images(int(d))}
        for j, t in enumerate(toks):
            stream.append(t)
            img_at.append(starts.get(j, -1))
    return stream, img_at


@pytest.mark.parametrize("seq_len", [28, 64])
def test_packing_invariants(corpus, seq_len):
    _, prefix, _, _ = corpus
    tok = load_tokenizer(Path(prefix).parent / "tokenizer.json")
    packed = open_split(prefix, seq_len, "train", 0.1, 3, tok)
    assert isinstance(packed, VisionPackedDataset)
    for epoch in (0, 1):
        stream, img_at = _reference_epoch(packed, epoch)
        pos, seen = 0, []
        for k in range(packed.samples_in_epoch(epoch)):
            row = packed.sample(k, epoch)
            n = int((row.input_ids != tok.pad_id).sum()) if k < packed.samples_in_epoch(epoch) else 0
            n = len(stream) - pos if len(stream) - pos < seq_len and k == packed.samples_in_epoch(epoch) - 1 else n
            body = row.input_ids[:n].tolist()
            assert body == stream[pos:pos + n]  # the row is the next stretch of the epoch's stream
            assert (row.input_ids[n:] == tok.pad_id).all() and (row.labels[n:] == IGNORE_INDEX).all()
            # images: whole, in order, each exactly its slot count; the row ended early only for one
            row_imgs = [(j, img_at[pos + j]) for j in range(n) if img_at[pos + j] >= 0]
            for (j, i), pix in zip(row_imgs, row.images):
                m = int(packed.store.tokens_of([i])[0])
                assert j + m <= n and (row.input_ids[j:j + m] == MEDIA).all()
                assert np.array_equal(pix, packed.store.image(i))
            assert len(row_imgs) == len(row.images) and row.vision_tokens == int((row.input_ids == MEDIA).sum())
            seen += [i for _, i in row_imgs]
            if n < seq_len and pos + n < len(stream):  # a short row: the next image did not fit
                i = img_at[pos + n]
                assert i >= 0 and n + int(packed.store.tokens_of([i])[0]) > seq_len
            # labels: next token of the same document, never a vision slot
            assert not np.isin(row.labels, [MEDIA]).any()
            for j in range(n):
                lab = int(row.labels[j])
                if lab != IGNORE_INDEX:
                    assert lab == stream[pos + j + 1]
            assert row.doc_starts[0] == 0 and (np.diff(row.doc_starts) > 0).all()
            pos += n
        assert pos == len(stream)
        assert seen == [i for i in img_at if i >= 0]  # every image of the epoch once, in order


def test_image_larger_than_row_is_refused(corpus):
    _, prefix, _, _ = corpus
    tok = load_tokenizer(Path(prefix).parent / "tokenizer.json")
    with pytest.raises(DataError, match="data.seq_len=8.*--max-pixels"):
        open_split(prefix, 8, "train", 0.1, 3, tok)


def test_batches_deterministic_resumable_and_dp_split(corpus):
    _, prefix, _, _ = corpus
    tok = load_tokenizer(Path(prefix).parent / "tokenizer.json")
    packed = lambda: open_split(prefix, 32, "train", 0.1, 3, tok)  # noqa: E731
    n0 = packed().samples_in_epoch(0)
    steps = 2 * n0 // 4 + 3  # crosses at least one epoch boundary (epochs differ in length)
    a = Batcher(packed(), 2, 0, 2)
    ref = [next(a) for _ in range(steps)]
    b = Batcher(packed(), 2, 0, 2)
    for _ in range(steps // 2):
        next(b)
    state = b.state_dict()
    c = Batcher(packed(), 2, 0, 2)
    c.load_state_dict(state)
    for want in ref[steps // 2:]:
        got = next(c)
        for key in ("input_ids", "labels", "cu_seqlens"):
            assert torch.equal(got[key], want[key])
        assert len(got["images"]) == len(want["images"]) and all(torch.equal(x, y) for x, y in
                                                                 zip(got["images"], want["images"]))
    # dp: rank 0 and rank 1 rows together are the dp=1 batch rows
    one = Batcher(packed(), 4)
    r0, r1 = Batcher(packed(), 2, 0, 2), Batcher(packed(), 2, 1, 2)
    for _ in range(3):
        full, x, y = next(one), next(r0), next(r1)
        assert torch.equal(full["input_ids"], torch.cat([x["input_ids"], y["input_ids"]]))
        assert [t.shape for t in full["images"]] == [t.shape for t in x["images"] + y["images"]]
        assert full["vision_tokens"] == x["vision_tokens"] + y["vision_tokens"]
        assert full["vision_tokens"] == int((full["input_ids"] == MEDIA).sum())
        assert all(-1 <= float(t.min()) and float(t.max()) <= 1 for t in full["images"])


def test_controls_keep_slots_change_pixels(corpus):
    _, prefix, _, _ = corpus
    tok = load_tokenizer(Path(prefix).parent / "tokenizer.json")
    rows = {c: open_split(prefix, 64, "train", 0.1, 3, tok, image_control=c).sample(1) for c in
            ("real", "noise", "shuffle")}
    for c in ("noise", "shuffle"):
        assert np.array_equal(rows[c].input_ids, rows["real"].input_ids)
        assert [p.shape for p in rows[c].images] == [p.shape for p in rows["real"].images]
        assert not all(np.array_equal(p, q) for p, q in zip(rows[c].images, rows["real"].images))


def test_demo_vision_captions_describe_images(tmp_path):
    for i in range(12):
        arr, caption = render(i)
        assert np.array_equal(arr, render(i)[0])  # deterministic
        count, colour, _ = caption.rstrip(".").split()
        # the caption's colour is the colour of the image's non-background pixels
        px = arr.reshape(-1, 3).astype(int)
        fg = px[px.min(1) < 200]  # the background is light (every channel >= 225)
        assert len(fg) and (np.abs(fg - COLOURS[colour]).max(1) <= 2).mean() > 0.8, (i, caption)
    prefix, tok = build_demo_vision_dataset(tmp_path, vocab_size=300, num_docs=40, progress=False)
    assert build_demo_vision_dataset(tmp_path, vocab_size=300, num_docs=40, progress=False) == (prefix, tok)
    ds, store = IndexedDataset(prefix), ImageStore(prefix)
    assert len(ds) == 40 and len(store) == 40
    assert np.array_equal(store.image(int(store.doc_images(5)[0, 0])), render(5)[0])
    text = load_tokenizer(tok).decode([t for t in ds.doc(5).tolist() if t != MEDIA], skip_special_tokens=True)
    assert text == render(5)[1]


def test_trainer_with_images_logs_and_resumes_bit_identically(corpus, tmp_path):
    from conftest import SMALL_MODEL

    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.metrics.config import LoggingConfig
    from megak3.optim.config import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.train.trainer import Trainer

    _, prefix, _, _ = corpus

    def job(run, steps, resume="none"):
        return JobConfig(model=load_model_config("k3_tiny", **{**SMALL_MODEL, "vision.enabled": True}),
                         data=DataConfig(path=prefix, seq_len=64, valid_fraction=0.1),
                         optim=OptimConfig(lr=3e-3, warmup_steps=1),
                         train=TrainConfig(max_steps=steps, global_batch_size=2, micro_batch_size=1, eval_interval=0,
                                           eval_batches=1, save_interval=0, run_dir=str(run), seed=7, resume=resume,
                                           device="cpu"),
                         logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1)).validate()
    full = Trainer(job(tmp_path / "full", 4), tmp_path / "full")
    full.fit()
    assert full.last_metrics["images"] > 0 and full.last_metrics["vision_tokens"] > 0
    assert full.last_metrics["images_per_s"] > 0
    first = Trainer(job(tmp_path / "split", 2), tmp_path / "split")
    first.fit()
    second = Trainer(job(tmp_path / "split", 4, "auto"), tmp_path / "split")
    second.fit()
    assert [h["loss"] for h in full.history] == [h["loss"] for h in first.history + second.history]
    log = (tmp_path / "full" / "train.log").read_text() if (tmp_path / "full" / "train.log").exists() else ""
    assert not log or "img/s" in log
    with pytest.raises(DataError, match="model.vision.enabled=false"):
        bad = job(tmp_path / "x", 2)
        bad.model.vision.enabled = False
        Trainer(bad, tmp_path / "x")
