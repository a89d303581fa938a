"""The built-in chat corpus (``data=demo_sft``) and its verifiable tasks, generated from seeds (no download).

Conversation ``i`` is drawn by a generator seeded by ``i`` from five task families, each with one
exact answer::

    add        "What is 7 + 12?"                      -> "19"
    next       "What number comes after 41?"          -> "42"
    reverse    "Reverse the letters of 'stone'."      -> "enots"
    upper      "Write 'river' in capital letters."    -> "RIVER"
    first      "What is the first letter of 'cloud'?" -> "c"

A quarter of the conversations open with a system message and a fifth have a second user/assistant
turn, so the assistant-only mask is exercised on multi-turn data. :func:`task` gives the prompt
messages and the exact answer of any family for RL (megak3/posttrain/rewards.py scores it).

The byte-level BPE tokenizer is trained on the corpus's rendered text (chat template included) and
the dataset is written by :func:`megak3.data.sft.write_sft_dataset`; built once per
(format, vocab size, conversation count) under the data cache, atomically like the text demo.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Tuple

import numpy as np

from megak3.data.demo_cache import PREFIX_NAME, cached_corpus

FORMAT_VERSION = 1
NUM_CONVERSATIONS = 6000
FAMILIES = ("add", "next", "reverse", "upper", "first")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "green", "house", "light", "music", "ocean", "plant",
         "queen", "sugar", "table", "water", "zebra", "bread", "chair", "dream", "earth", "flame", "grape",
         "horse", "juice", "knife", "lemon", "mouse", "night", "onion", "paper", "radio", "snake", "train",
         "uncle", "voice", "wheel", "youth", "cat", "dog", "sun", "moon", "star", "tree", "book", "fish",
         "bird", "rain", "snow", "wind", "fire")
SYSTEM = ("You are a helpful assistant.", "Answer briefly.", "Reply with the answer only.")


def task(family: str, rng: np.random.Generator) -> Tuple[str, str]:
    """(question, exact answer) of one task of ``family``."""
    if family == "add":
        a, b = int(rng.integers(0, 20)), int(rng.integers(0, 20))
        return f"What is {a} + {b}?", str(a + b)
    if family == "next":
        n = int(rng.integers(0, 99))
        return f"What number comes after {n}?", str(n + 1)
    w = WORDS[int(rng.integers(len(WORDS)))]
    if family == "reverse":
        return f"Reverse the letters of '{w}'.", w[::-1]
    if family == "upper":
        return f"Write '{w}' in capital letters.", w.upper()
    if family == "first":
        return f"What is the first letter of '{w}'?", w[0]
    raise ValueError(f"family={family!r} must be one of {', '.join(FAMILIES)}")


def conversation(i: int) -> List[dict]:
    """Conversation ``i`` of the corpus (a list of chat messages)."""
    rng = np.random.default_rng([28, i])
    msgs = []
    if rng.random() < 0.25:
        msgs.append({"role": "system", "content": SYSTEM[int(rng.integers(len(SYSTEM)))]})
    for _ in range(2 if rng.random() < 0.2 else 1):
        q, a = task(FAMILIES[int(rng.integers(len(FAMILIES)))], rng)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def rl_prompts(n: int, family: str = "add", seed: int = 0) -> List[Tuple[List[dict], str]]:
    """``n`` (prompt messages, exact answer) pairs of ``family``, drawn apart from the SFT corpus's seeds."""
    rng = np.random.default_rng([29, seed])
    return [([{"role": "user", "content": q}], a) for q, a in (task(family, rng) for _ in range(n))]


def build_demo_sft_dataset(cache_dir, vocab_size: int = 512, num_conversations: int = NUM_CONVERSATIONS,
                           progress: bool = True) -> Tuple[str, str]:
    """Build (once) and return ``(prefix, tokenizer_path)`` of the chat demo under ``cache_dir``."""
    from megak3.data.sft import write_sft_dataset
    from megak3.data.tokenizer import train_bpe_tokenizer

    def build(tmp: Path) -> dict:
        convs = [conversation(i) for i in range(num_conversations)]
        text = ("\n".join(f"{m['role']}\n{m['content']}" for m in c) for c in convs)
        tok = train_bpe_tokenizer(text, vocab_size, tmp / "tokenizer.json")
        stats = write_sft_dataset(convs, tmp / PREFIX_NAME, tok)
        stats.update(vocab_size=tok.vocab_size)
        return stats

    return cached_corpus(cache_dir, f"demo-sft-v{vocab_size}",
                         f"megak3-demo-sft v{FORMAT_VERSION} vocab={vocab_size} n={num_conversations}", build,
                         lambda stats: f"demo_sft corpus: {stats['conversations']} conversations, {stats['tokens']} "
                                       f"tokens ({stats['trained_tokens']} trained)", progress)


COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}


def write_colour_chats(out_dir, n: int = 150, seed: int = 0, side: int = 56) -> dict:
    """An image-chat SFT check: ``real.jsonl`` asks the colour of a solid ``side`` x ``side`` image
    (red / blue / green, drawn by ``seed``); ``blind.jsonl`` has the same conversations with one gray image
    for all, so only a model that sees the images can beat ln(3) nats on the colour. Writes the PNGs and a
    tokenizer.json trained on the text; returns the paths."""
    from PIL import Image

    from megak3.data.tokenizer import train_bpe_tokenizer

    out = Path(os.path.expanduser(str(out_dir)))
    out.mkdir(parents=True, exist_ok=True)
    for name, rgb in {**COLOURS, "gray": (128, 128, 128)}.items():
        Image.fromarray(np.full((side, side, 3), rgb, np.uint8)).save(out / f"{name}.png")
    rng = np.random.default_rng(seed)
    answers = [list(COLOURS)[int(k)] for k in rng.integers(0, len(COLOURS), n)]
    paths = {}
    for arm in ("real", "blind"):
        paths[arm] = out / f"{arm}.jsonl"
        paths[arm].write_text("".join(
            '{"messages": [{"role": "user", "content": "What colour is this?", "images": ["%s.png"]}, '
            '{"role": "assistant", "content": "%s"}]}\n' % ("gray" if arm == "blind" else c, c) for c in answers))
    train_bpe_tokenizer(["user\nWhat colour is this?\nassistant\n" + " ".join(COLOURS)] * 20, 300,
                        out / "tokenizer.json")
    return {**{k: str(v) for k, v in paths.items()}, "tokenizer": str(out / "tokenizer.json")}


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m megak3.data.demo_sft",
                                 description="write the colour-naming image-chat check (real and blind arms)")
    ap.add_argument("--colour-chats", required=True, metavar="DIR", help="output directory")
    ap.add_argument("-n", type=int, default=150, help="conversations")
    a = ap.parse_args()
    if a.n < 1:
        print(f"error: -n={a.n} must be >= 1", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(write_colour_chats(a.colour_chats, a.n)))
