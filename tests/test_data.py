"""Data pipeline: indexed dataset format, tokenizer, preprocessing, packing, batching, demo corpus.

Every packing check compares against a plain-Python reference built from the epoch's document
order (a list of tokens and the document each came from), or against hand-written expectations.
"""
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megak3.data import (IGNORE_INDEX, SPECIAL_TOKENS, Batcher, DataConfig, DataError, IndexedDataset,
                         IndexedDatasetBuilder, PackedDataset, best_dtype, demo_files, load_tokenizer,
                         preprocess, resolve_dataset, split_documents, train_bpe_tokenizer)
from megak3.data import demo as demo_mod

WORDS = ("def return class import self lambda yield tensor expert router token gate"
         " kimi delta attention latent shard rank epoch über naïve 数据 ✓").split()


def make_text(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if rng.random() < 0.15:
            lines.append("    " * rng.randrange(3) + " ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)]) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small directory tree: .txt/.py/.md files, a nested dir, a .jsonl, a binary and a hidden file."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    for i in range(12):
        ext = (".txt", ".py", ".md")[i % 3]
        where = root if i < 5 else root / "sub" if i < 9 else root / "sub" / "deeper"
        (where / f"f{i:02d}{ext}").write_text(make_text(rng, rng.randrange(50, 400)), encoding="utf-8")
    with open(root / "sub" / "docs.jsonl", "w", encoding="utf-8") as f:
        for i in range(6):
            f.write(json.dumps({"id": i, "text": make_text(rng, 60)}) + "\n")
        f.write(json.dumps({"id": 6, "text": ""}) + "\n\n")  # empty doc and a blank line: both skipped
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)  # NUL bytes -> binary, skipped
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # hidden -> skipped
    return root


@pytest.fixture(scope="module")
def tokenizer_path(corpus, tmp_path_factory):
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.rglob("f*.*"))]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(texts, 400, path)
    return path


def write_dataset(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_document(np.asarray(d))
    return IndexedDataset(prefix)


# ---------------------------------------------------------------- indexed dataset
def test_builder_reader_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 8192, size=n) for n in (5, 0, 17, 1, 300)]
    ds = write_dataset(tmp_path / "d", docs)
    assert len(ds) == 5 and ds.num_tokens == 323 and ds.dtype == np.uint16
    assert ds.doc_lengths.tolist() == [5, 0, 17, 1, 300]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.doc(i), d)
    assert np.shares_memory(ds.doc(4), ds._tokens) and not ds.doc(4).flags.writeable  # zero-copy view
    assert os.path.getsize(tmp_path / "d.bin") == 2 * 323
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temporaries left behind


def test_large_vocab_dtype_and_range_check(tmp_path):
    assert best_dtype(8192) == np.uint16 and best_dtype(65536) == np.uint16 and best_dtype(65537) == np.int32
    docs = [np.array([0, 65535, 70000, 163839]), np.array([1, 2])]
    ds = write_dataset(tmp_path / "big", docs, dtype=best_dtype(163840))
    assert ds.dtype == np.int32 and ds.doc(0).tolist() == [0, 65535, 70000, 163839]
    with pytest.raises(ValueError, match="do not fit"):
        IndexedDatasetBuilder(tmp_path / "small", np.uint16).add_document(np.array([70000]))


def test_merge_shards(tmp_path):
    a = write_dataset(tmp_path / "a", [[1, 2, 3], [4]])
    b = write_dataset(tmp_path / "b", [[5, 6], [], [7, 8, 9]])
    with IndexedDatasetBuilder(tmp_path / "m") as m:
        m.add_document([0])
        m.merge(a.prefix)
        m.merge(b.prefix)
    merged = IndexedDataset(tmp_path / "m")
    assert [merged.doc(i).tolist() for i in range(len(merged))] == [[0], [1, 2, 3], [4], [5, 6], [], [7, 8, 9]]
    with IndexedDatasetBuilder(tmp_path / "x", np.int32) as x, pytest.raises(ValueError, match="cannot merge"):
        x.merge(a.prefix)


def test_crash_leaves_no_dataset(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "c") as b:
            b.add_document([1, 2, 3])
            raise RuntimeError("worker died")
    assert os.listdir(tmp_path) == []


def test_corrupt_and_missing_files_are_reported(tmp_path):
    with pytest.raises(DataError, match=r"missing .*nope\.bin.*nope\.idx.*preprocess_data\.py"):
        IndexedDataset(tmp_path / "nope")
    write_dataset(tmp_path / "d", [[1, 2, 3, 4], [5, 6]])
    raw_bin, raw_idx = (tmp_path / "d.bin").read_bytes(), (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.bin").write_bytes(raw_bin[:-2])  # truncated .bin
    with pytest.raises(DataError, match="truncated or mismatched"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.bin").write_bytes(raw_bin)
    (tmp_path / "d.idx").write_bytes(raw_idx[:-8])  # truncated .idx
    with pytest.raises(DataError, match="truncated or corrupt"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"MMIDIDX\x00\x00" + raw_idx[9:])  # someone else's format
    with pytest.raises(DataError, match="bad magic"):
        IndexedDataset(tmp_path / "d")


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_special_ids_roundtrip_and_determinism(corpus, tokenizer_path, tmp_path):
    tok = load_tokenizer(tokenizer_path)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.media_id) == (0, 1, 2, 3)
    assert [tok.hf.id_to_token(i) for i in range(4)] == list(SPECIAL_TOKENS)
    assert 260 < tok.vocab_size <= 400
    text = "def f(x):\n    return 'über ✓ 数据'\t\n\n  <|eos|> <|media|>\x00"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert 2 not in ids and 3 not in ids  # special strings inside text stay text
    assert tok.encode_batch([text, "a"]) == [ids, tok.encode("a")]
    # same corpus, same order -> byte-identical tokenizer.json
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.rglob("f*.*"))]
    train_bpe_tokenizer(texts, 400, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == Path(tokenizer_path).read_bytes()
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")


# ---------------------------------------------------------------- preprocessing
def test_preprocess_workers_agree_and_documents_are_right(corpus, tokenizer_path, tmp_path):
    s1 = preprocess([corpus], tmp_path / "w1", tokenizer_path=tokenizer_path, workers=1, progress=False)
    s2 = preprocess([corpus], tmp_path / "w2", tokenizer_path=tokenizer_path, workers=2, progress=False)
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()
    assert (tmp_path / "w1.idx").read_bytes() == (tmp_path / "w2.idx").read_bytes()
    # 12 text files + 6 jsonl lines; blob.bin skipped as binary, .git skipped as hidden, one empty line
    assert (s1["files"], s1["skipped_files"], s1["docs"], s1["empty_docs"]) == (14, 1, 18, 1)
    assert s1["tokens"] == s2["tokens"] == IndexedDataset(tmp_path / "w1").num_tokens
    tok, ds = load_tokenizer(tokenizer_path), IndexedDataset(tmp_path / "w1")
    # sorted relative-path order: f00..f04 at the top level come first, then sub/deeper/, sub/docs.jsonl
    assert tok.decode(ds.doc(0)) == (corpus / "f00.txt").read_text(encoding="utf-8") + "<|eos|>"
    jsonl = [json.loads(line)["text"] for line in (corpus / "sub" / "docs.jsonl").read_text().splitlines() if line]
    assert tok.decode(ds.doc(8)[:-1]) == jsonl[0]
    assert all(ds.doc(i)[-1] == tok.eos_id for i in range(len(ds)))


def test_preprocess_trains_tokenizer_and_reports_bad_json(corpus, tmp_path):
    stats = preprocess([corpus / "sub"], tmp_path / "out" / "ds", train_tokenizer=True, vocab_size=300,
                       append_eos=False, progress=False)
    assert stats["tokenizer"] == str(tmp_path / "out" / "tokenizer.json") and stats["vocab_size"] <= 300
    assert 2 not in IndexedDataset(tmp_path / "out" / "ds").doc(0)  # append_eos=False
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: no string field 'text'.*--json-key"):
        preprocess([tmp_path / "bad.jsonl"], tmp_path / "b", tokenizer_path=stats["tokenizer"], progress=False)
    with pytest.raises(DataError, match="exactly one of"):
        preprocess([corpus], tmp_path / "c", progress=False)


def test_cli_summary_line(corpus, tokenizer_path, tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import preprocess_data

    rc = preprocess_data.main(["--input", str(corpus / "f00.txt"), str(corpus / "f01.py"), "--output-prefix",
                               str(tmp_path / "cli"), "--tokenizer", str(tokenizer_path), "--no-progress"])
    assert rc == 0 and "2 docs" in capsys.readouterr().out
    assert preprocess_data.main(["--input", str(tmp_path / "none"), "--output-prefix", str(tmp_path / "x"),
                                 "--tokenizer", str(tokenizer_path)]) == 2


# ---------------------------------------------------------------- packing
def reference_samples(packed, epoch):
    """Plain-Python packing of one epoch: (inputs, labels, doc_starts) per sample."""
    toks, pos_doc = [], []  # pos_doc: the document's *position* in the order (robust to equal values)
    for k, d in enumerate(packed.epoch_order(epoch)):
        t = packed.dataset.doc(int(d)).tolist()
        toks += t
        pos_doc += [k] * len(t)
    T, out = packed.seq_len, []
    for s in range(0, len(toks), T):
        idx = list(range(s, min(s + T, len(toks))))
        inp = [toks[i] for i in idx] + [0] * (T - len(idx))
        lab = [toks[i + 1] if i + 1 < len(toks) and pos_doc[i + 1] == pos_doc[i] else IGNORE_INDEX for i in idx]
        lab += [IGNORE_INDEX] * (T - len(idx))
        starts = [0] + [i - s for i in idx[1:] if pos_doc[i] != pos_doc[i - 1]] + ([len(idx)] if len(idx) < T else [])
        out.append((inp, lab, starts))
    return out


def test_packing_hand_made_example(tmp_path):
    ds = write_dataset(tmp_path / "h", [[10, 11, 12], [20, 21, 22, 23, 24]])
    p = PackedDataset(ds, seq_len=4, valid_fraction=0.0, seed=0)
    assert len(p) == 2
    A = [10, 11, 12, 20, 21, 22, 23, 24] if p.epoch_order(0).tolist() == [0, 1] else [20, 21, 22, 23, 24, 10, 11, 12]
    got = [(p[k].input_ids.tolist(), p[k].labels.tolist(), p[k].doc_starts.tolist()) for k in range(2)]
    if A[0] == 10:   # stream 10 11 12 | 20 21 22 23 24
        want = [([10, 11, 12, 20], [11, 12, -100, 21], [0, 3]), ([21, 22, 23, 24], [22, 23, 24, -100], [0])]
    else:            # stream 20 21 22 23 24 | 10 11 12
        want = [([20, 21, 22, 23], [21, 22, 23, 24], [0]), ([24, 10, 11, 12], [-100, 11, 12, -100], [0, 1])]
    assert got == want
    batch = next(iter(Batcher(p, micro_batch_size=2)))
    want_cu = [0, 3, 4, 8] if A[0] == 10 else [0, 4, 5, 8]
    assert batch["cu_seqlens"].tolist() == want_cu and batch["cu_seqlens"].dtype == torch.int32
    assert batch["num_tokens"] == 6


def test_packing_matches_reference_and_covers_every_token_once(tmp_path):
    rng = np.random.default_rng(1)
    # distinct token values so "each token exactly once" is checkable by value
    lengths = rng.integers(1, 40, size=60)
    values = rng.permutation(int(lengths.sum())) + 4
    docs = np.split(values, np.cumsum(lengths)[:-1])
    ds = write_dataset(tmp_path / "r", docs, np.int32)
    p = PackedDataset(ds, seq_len=16, split="train", valid_fraction=0.1, seed=7)
    train_tokens = np.concatenate([docs[d] for d in p.docs])
    for epoch in (0, 1):
        ref = reference_samples(p, epoch)
        assert len(ref) == len(p)
        for k, (inp, lab, starts) in enumerate(ref):
            s = p.sample(k, epoch)
            assert (s.input_ids.tolist(), s.labels.tolist(), s.doc_starts.tolist()) == (inp, lab, starts)
        seen = np.concatenate([p.sample(k, epoch).input_ids for k in range(len(p))])
        seen = seen[: p.num_tokens]  # the tail of the last sample is padding
        assert sorted(seen.tolist()) == sorted(train_tokens.tolist())
    assert p.epoch_order(0).tolist() != p.epoch_order(1).tolist()  # new permutation per epoch
    other = PackedDataset(ds, seq_len=16, valid_fraction=0.1, seed=8)
    assert other.epoch_order(0).tolist() != p.epoch_order(0).tolist()
    again = PackedDataset(ds, seq_len=16, valid_fraction=0.1, seed=7)
    assert again.epoch_order(1).tolist() == p.epoch_order(1).tolist()


def test_split_is_disjoint_and_seed_independent(tmp_path):
    tr, va = split_documents(1000, "train", 0.02), split_documents(1000, "valid", 0.02)
    assert len(va) == 20 and len(tr) == 980 and not set(tr) & set(va)
    assert sorted(np.concatenate([tr, va]).tolist()) == list(range(1000))
    assert np.diff(va).min() >= 49  # spread over the corpus, not one block
    ds = write_dataset(tmp_path / "s", [[i + 4] * 3 for i in range(50)])
    a, b = PackedDataset(ds, 8, "valid", 0.1, seed=1), PackedDataset(ds, 8, "valid", 0.1, seed=2)
    assert a.docs.tolist() == b.docs.tolist() == [9, 19, 29, 39, 49]
    with pytest.raises(DataError, match="raise data.valid_fraction"):
        PackedDataset(ds, 8, "valid", valid_fraction=0.01)


# ---------------------------------------------------------------- batching
@pytest.fixture
def packed(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(4, 500, size=n) for n in rng.integers(1, 30, size=40)]
    return PackedDataset(write_dataset(tmp_path / "b", docs), seq_len=8, valid_fraction=0.05, seed=3)


def test_batches_and_cu_seqlens(packed):
    n = len(packed)
    batches = [b for _, b in zip(range(3), Batcher(packed, micro_batch_size=4))]
    for step, b in enumerate(batches):
        assert b["input_ids"].shape == b["labels"].shape == (4, 8) and b["input_ids"].dtype == torch.long
        rows = [packed.sample(i % n, i // n) for i in range(4 * step, 4 * step + 4)]
        want = [int(s) + 8 * r for r, row in enumerate(rows) for s in row.doc_starts] + [32]
        assert b["cu_seqlens"].tolist() == want
        assert torch.equal(b["labels"], torch.tensor(np.stack([r.labels for r in rows])))
        assert b["num_tokens"] == int((b["labels"] != IGNORE_INDEX).sum())
        # labels are the inputs shifted by one wherever they are not ignored
        x, y = b["input_ids"], b["labels"]
        keep = y[:, :-1] != IGNORE_INDEX
        assert torch.equal(y[:, :-1][keep], x[:, 1:][keep])


def test_resume_gives_identical_batches_across_epochs(packed):
    steps = 2 * len(packed) // 3 + 3  # B=3: runs past the end of epoch 0
    full = [b for _, b in zip(range(steps), Batcher(packed, 3))]
    first = Batcher(packed, 3)
    head = [next(first) for _ in range(5)]
    state = first.state_dict()
    resumed = Batcher(PackedDataset(packed.dataset, 8, valid_fraction=0.05, seed=3), 3)
    resumed.load_state_dict(state)
    tail = [next(resumed) for _ in range(steps - 5)]
    for a, b in zip(full, head + tail):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["cu_seqlens"], b["cu_seqlens"])
    assert resumed.epoch >= 1
    other = Batcher(PackedDataset(packed.dataset, 8, valid_fraction=0.05, seed=4), 3)
    assert not torch.equal(next(other)["input_ids"], full[0]["input_ids"])
    with pytest.raises(DataError, match="seq_len"):
        Batcher(PackedDataset(packed.dataset, 16, valid_fraction=0.05, seed=3), 3).load_state_dict(state)


def test_data_parallel_ranks_split_the_global_batch_and_one_pass_stops(packed):
    single = Batcher(packed, 4)
    r0, r1 = Batcher(packed, 2, dp_rank=0, dp_size=2), Batcher(packed, 2, dp_rank=1, dp_size=2)
    for _ in range(3):
        whole, a, b = next(single), next(r0), next(r1)
        assert torch.equal(whole["input_ids"], torch.cat([a["input_ids"], b["input_ids"]]))
    one_pass = list(Batcher(packed, 4, loop=False))
    assert sum(len(b["input_ids"]) for b in one_pass) == len(packed)


# ---------------------------------------------------------------- demo corpus and config
def test_demo_files_sorted_and_filtered():
    files = demo_files()
    root = demo_mod.demo_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(rel) > 300 and rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert "json/__init__.py" in rel and "os.py" in rel
    bad = {"site-packages", "test", "tests", "idle_test"}
    assert not any(bad & set(r.split("/")[:-1]) for r in rel)


def test_build_demo_dataset_on_a_small_file_list(corpus, tmp_path, monkeypatch):
    small = sorted(corpus.glob("f0*.py")) + sorted(corpus.glob("f0*.txt"))
    monkeypatch.setattr(demo_mod, "demo_files", lambda: small)
    t0 = time.perf_counter()
    prefix, tok_path = demo_mod.build_demo_dataset(tmp_path / "cache", vocab_size=300, workers=2, progress=False)
    build_s = time.perf_counter() - t0
    ds, tok = IndexedDataset(prefix), load_tokenizer(tok_path)
    assert len(ds) == len(small) and tok.vocab_size <= 300
    assert tok.decode(ds.doc(0)) == small[0].read_text(encoding="utf-8") + "<|eos|>"
    mtime = os.path.getmtime(prefix + ".bin")
    import megak3.data.preprocessing as preprocessing

    builds = []
    real = preprocessing.preprocess
    monkeypatch.setattr(preprocessing, "preprocess", lambda *a, **k: builds.append(a) or real(*a, **k))
    again = demo_mod.build_demo_dataset(tmp_path / "cache", vocab_size=300, workers=2, progress=False)
    # reused: nothing preprocessed (a counter, not a clock) and the file untouched
    assert again == (prefix, tok_path) and builds == [] and os.path.getmtime(prefix + ".bin") == mtime
    assert demo_mod.build_demo_dataset(tmp_path / "cache", vocab_size=280, progress=False)[0] != prefix
    assert len(builds) == 1  # another vocabulary is another build: the counter sees builds
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []  # no temp dirs
    # resolve_dataset builds/reuses the demo through DataConfig
    cfg = DataConfig(path="demo", cache_dir=str(tmp_path / "cache"), vocab_size=300)
    assert resolve_dataset(cfg) == (prefix, tok_path), build_s


def test_resolve_dataset_errors_name_the_field(tmp_path, tokenizer_path):
    with pytest.raises(DataError, match=r"data.path=.*nope.*preprocess_data\.py"):
        resolve_dataset(DataConfig(path=str(tmp_path / "nope")))
    write_dataset(tmp_path / "d", [[5, 6, 7]])
    with pytest.raises(DataError, match=r"without '\.bin'"):
        resolve_dataset(DataConfig(path=str(tmp_path / "d.bin")))
    with pytest.raises(DataError, match="data.tokenizer"):
        resolve_dataset(DataConfig(path=str(tmp_path / "d")))
    assert resolve_dataset(DataConfig(path=str(tmp_path / "d"), tokenizer=str(tokenizer_path))) == \
        (str(tmp_path / "d"), str(tokenizer_path))
    with pytest.raises(DataError, match="data.seq_len"):
        DataConfig(seq_len=0).validate()
    with pytest.raises(DataError, match="data.tokenizer"):
        resolve_dataset(DataConfig(path="demo", tokenizer="x.json"))


def test_cache_dir_default_follows_env(monkeypatch):
    monkeypatch.setenv("MEGAK3_CACHE", "/tmp/somewhere")
    assert DataConfig().cache_dir == "/tmp/somewhere"
    monkeypatch.delenv("MEGAK3_CACHE")
    assert DataConfig().cache_dir == "~/.cache/megak3"
