"""SFT: the chat template's assistant-only labels (hand-built), whole-conversation packing, the
demo_sft corpus through the production trainer (the loss falls), bad chat files."""
import json

import numpy as np
import pytest

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.data.config import DataConfig
from megak3.data.packing import IGNORE_INDEX, collate
from megak3.data.tokenizer import train_bpe_tokenizer
from megak3.metrics.config import LoggingConfig
from megak3.optim.config import OptimConfig
from megak3.data.chat import encode_chat, generation_prompt
from megak3.data.sft import SFTPackedDataset, main as sft_main, write_sft_dataset
from megak3.job.config import JobConfig, TrainConfig
from megak3.train.trainer import Trainer

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Reverse 'cat'."},
        {"role": "assistant", "content": "tac"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    text = ["system\nBe brief.", "user\nWhat is 2 + 3?", "assistant\n5", "Reverse 'cat'. tac"] * 20
    return train_bpe_tokenizer(text, 300, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_labels_are_exactly_the_assistant_tokens(tok):
    # hand-built: each message is <|bos|> role "\n" content <|eos|>; only assistant content + eos is trained
    B, E, enc = tok.bos_id, tok.eos_id, tok.encode
    pieces = [([B] + enc("system\n"), 0), (enc("Be brief.") + [E], 0),
              ([B] + enc("user\n"), 0), (enc("What is 2 + 3?") + [E], 0),
              ([B] + enc("assistant\n"), 0), (enc("5") + [E], 1),
              ([B] + enc("user\n"), 0), (enc("Reverse 'cat'.") + [E], 0),
              ([B] + enc("assistant\n"), 0), (enc("tac") + [E], 1)]
    want_ids = [i for p, _ in pieces for i in p]
    trained = [i for p, t in pieces if t for i in p]
    ids, mask = encode_chat(tok, CONV)
    assert ids == want_ids
    assert [i for i, m in zip(ids, mask) if m] == trained == enc("5") + [E] + enc("tac") + [E]
    assert generation_prompt(tok, CONV[:2]) == want_ids[:len(pieces[0][0]) + len(pieces[1][0]) + len(
        pieces[2][0]) + len(pieces[3][0])] + [B] + enc("assistant\n")

    # through the dataset, the packer and the collator: next-token labels of exactly those tokens
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "tac"}]
        write_sft_dataset([CONV, short, CONV], f"{d}/sft", tok)
        T = len(ids) + 12
        ds = SFTPackedDataset(f"{d}/sft", T, "train", valid_fraction=0.0, seed=3)
        rows = [ds.sample(i) for i in range(len(ds))]
        seen = 0
        for r in rows:
            bounds = list(r.doc_starts) + [T]
            for a, b in zip(bounds[:-1], bounds[1:]):
                seg_ids, seg_lab = r.input_ids[a:b].tolist(), r.labels[a:b].tolist()
                if seg_ids[0] == tok.pad_id:  # the padding segment
                    assert all(x == IGNORE_INDEX for x in seg_lab)
                    continue
                seen += 1
                conv = CONV if len(seg_ids) == len(ids) else short
                cids, cmask = encode_chat(tok, conv)
                assert seg_ids == cids  # whole conversations, never split across rows
                want = [cids[j + 1] if cmask[j + 1] else IGNORE_INDEX for j in range(len(cids) - 1)] + [IGNORE_INDEX]
                assert seg_lab == want
        assert seen == 3
        batch = collate(rows)
        assert batch["num_tokens"] == 2 * len(trained) + len(enc("tac")) + 1
        # a conversation longer than the row is cut to its first T tokens
        cut = SFTPackedDataset(f"{d}/sft", 8, "train", valid_fraction=0.0)
        assert cut.truncated == 3 and all(len(cut.sample(i).doc_starts) == 1 for i in range(len(cut)))


def test_sft_loss_falls_on_demo_sft(tmp_path):
    job = JobConfig(
        model=load_model_config("k3_tiny", **SMALL_MODEL),
        data=DataConfig(path="demo_sft", vocab_size=512, seq_len=128, valid_fraction=0.05,
                        cache_dir=str(tmp_path / "cache")),
        optim=OptimConfig(lr=1e-2, warmup_steps=2),
        train=TrainConfig(max_steps=12, global_batch_size=4, micro_batch_size=4, eval_interval=0, eval_batches=2,
                          save_interval=0, run_dir=str(tmp_path / "run"), seed=7),
        logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1),
    ).validate()
    tr = Trainer(job, tmp_path / "run")
    batch = tr.next_micro_batches()[0]
    lab, ids = batch["labels"], batch["input_ids"]
    # every labelled position predicts an assistant token or the eos that ends an answer
    assert 0 < batch["num_tokens"] < (ids != 0).sum() / 3
    out = tr.fit()
    assert out["final_val_loss"] < out["first_val_loss"] - 2.0, out


def test_bad_chat_file_is_one_line_exit_2(tmp_path, tok, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    tok_path = tmp_path / "t.json"
    tok.hf.save(str(tok_path))
    assert sft_main(["--input", str(bad), "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(tok_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "messages[0].role='robot'" in err and "bad.jsonl:1" in err
