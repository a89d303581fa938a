"""Images in SFT chat data: the template's <|media|> slots for a hand-built conversation with one image, the
packed row carrying its pixels with labels on assistant tokens only, and an SFT step through RankStep's
image-text path (loss finite, the vision tower gets gradients)."""
import json

import numpy as np
import pytest
import torch

from megak3.data.packing import IGNORE_INDEX


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megak3.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(["user assistant what colour is it? red blue\n" * 30], 300, path)
    return load_tokenizer(str(path))


CONV = [{"role": "user", "content": "what colour is it?", "images": ["red.png"]},
        {"role": "assistant", "content": "red"}]


def test_template_puts_the_towers_slot_count_after_the_header(tok):
    from megak3.model.vision import num_image_tokens
    from megak3.data.chat import ChatFormatError, encode_chat, labels_from_mask

    n = num_image_tokens(56, 84, 14, 2)
    assert n == 6
    ids, mask = encode_chat(tok, CONV, [n])
    user = [tok.bos_id] + tok.encode("user\n") + [tok.media_id] * 6 + tok.encode("what colour is it?") + [tok.eos_id]
    asst_head = [tok.bos_id] + tok.encode("assistant\n")
    answer = tok.encode("red") + [tok.eos_id]
    assert ids == user + asst_head + answer
    assert mask == [0] * (len(user) + len(asst_head)) + [1] * len(answer)
    labels = labels_from_mask(ids, mask)
    assert [l for l in labels if l != IGNORE_INDEX] == answer  # never a media token
    with pytest.raises(ChatFormatError, match="1 images but 0"):
        encode_chat(tok, CONV)
    # an image in an assistant message is context too: its slots are never trained on
    ids2, mask2 = encode_chat(tok, [{"role": "assistant", "content": "red", "images": ["x.png"]}], [2])
    assert [m for i, m in zip(ids2, mask2) if i == tok.media_id] == [0, 0]


def _write(tmp_path, tok, convs):
    from PIL import Image

    from megak3.data.sft import read_conversations, write_sft_dataset

    Image.fromarray(np.full((56, 84, 3), (200, 10, 10), np.uint8)).save(tmp_path / "red.png")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    prefix = tmp_path / "ds" / "chat"
    stats = write_sft_dataset(read_conversations([tmp_path / "chat.jsonl"]), prefix, tok)
    return prefix, stats


def test_packed_row_carries_the_image_and_assistant_labels(tmp_path, tok):
    from megak3.data.chat import encode_chat
    from megak3.data.sft import SFTPackedDataset

    text_only = [{"role": "user", "content": "blue?"}, {"role": "assistant", "content": "blue"}]
    prefix, stats = _write(tmp_path, tok, [text_only, CONV])
    assert stats["images"] == 1 and stats["vision_tokens"] == 6
    ds = SFTPackedDataset(prefix, 64, valid_fraction=0.0, media_id=tok.media_id)
    row = ds.sample(0)
    assert len(row.images) == 1 and row.images[0].shape == (56, 84, 3) and row.vision_tokens == 6
    assert tuple(row.images[0][0, 0]) == (200, 10, 10)
    want = [t for c in (text_only, CONV) for t in encode_chat(tok, c, [6] if c is CONV else [])[0][1:]]
    got = [int(l) for l in row.labels if l != IGNORE_INDEX]
    answers = [t for c in (text_only, CONV) for t in tok.encode(c[1]["content"]) + [tok.eos_id]]
    assert sorted(got) == sorted(answers) and set(got) <= set(want)
    assert not (row.labels == tok.media_id).any()
    with pytest.raises(Exception, match="data.seq_len"):
        SFTPackedDataset(prefix, 8, valid_fraction=0.0, media_id=tok.media_id)


def test_sft_step_with_an_image_trains_the_tower(tmp_path, tok):
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.data.packing import collate
    from megak3.optim.config import OptimConfig
    from megak3.data.sft import SFTPackedDataset
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.train.step import RankStep
    from parallel.state import ParallelState

    prefix, _ = _write(tmp_path, tok, [CONV])
    ds = SFTPackedDataset(prefix, 32, valid_fraction=0.0, media_id=tok.media_id)
    batch = collate([ds.sample(0)])
    assert batch["num_images"] == 1
    model = load_model_config("k3_tiny", **{**SMALL_MODEL, "vision.enabled": True, "media_placeholder_token_id": 3})
    job = JobConfig(model=model, data=DataConfig(vocab_size=512, seq_len=32),
                    optim=OptimConfig(lr=1e-3, warmup_steps=0),
                    train=TrainConfig(max_steps=1, global_batch_size=1, micro_batch_size=1, seed=1)).validate(1)
    rs = RankStep(job, ParallelState.single(), "cpu", grad_accum=1)
    rec = rs.accumulate([batch])
    assert torch.isfinite(rec["loss_sum"]) and float(rec["loss_sum"]) > 0 and float(rec["images"]) == 1
    assert rs.model.vision.patch_embed.weight.grad.abs().sum() > 0


def test_open_sft_split_checks_the_vision_tower(tmp_path, tok):
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.errors import DataError
    from megak3.data.sft import open_sft_split

    prefix, _ = _write(tmp_path, tok, [CONV])
    on = load_model_config("k3_tiny", **{**SMALL_MODEL, "vision.enabled": True, "media_placeholder_token_id": 3})
    assert len(open_sft_split(prefix, 32, "train", 0.0, 1, tok, on).sample(0).images) == 1
    with pytest.raises(DataError, match="model.vision.enabled=false"):
        open_sft_split(prefix, 32, "train", 0.0, 1, tok, load_model_config("k3_tiny", **SMALL_MODEL))
    with pytest.raises(DataError, match="--patch-size"):
        open_sft_split(prefix, 32, "train", 0.0, 1, tok, load_model_config(
            "k3_tiny", **{**SMALL_MODEL, "vision.enabled": True, "vision.merge": 1}))


def test_colour_chats_arms_differ_only_in_the_images(tmp_path):
    from megak3.data.demo_sft import write_colour_chats
    from megak3.data.sft import read_conversations

    paths = write_colour_chats(tmp_path, n=12)
    real, blind = (list(read_conversations([paths[a]])) for a in ("real", "blind"))
    assert [c[1]["content"] for c in real] == [c[1]["content"] for c in blind]
    assert all(c[0]["images"][0].endswith(c[1]["content"] + ".png") for c in real)
    assert all(c[0]["images"][0].endswith("gray.png") for c in blind)
