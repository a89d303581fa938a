"""``python -m megak3.generate`` (megak3/inference/cli.py): greedy output equals a full-recompute loop
over the training forward, per-prompt JSONL overrides and seeds, and every bad input is one line on
stderr with exit status 2 and no traceback. ``tiny_run`` (a random-init k3_tiny-structure checkpoint
with its tokenizer, in the trainer's layout) is shared with tests/test_server.py and tests/test_lm_eval.py."""
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.data.tokenizer import train_bpe_tokenizer
from megak3.inference.cli import main
from megak3.model.k3 import build_model
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("def main(argv):\n    return sum(x * x for x in argv) + len(argv)\n"
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "the quick brown fox jumps over the lazy dog. ") * 20
MAX_SEQ = 96


def make_tiny_run(root: Path, seed: int = 0, max_seq_len: int = MAX_SEQ, **overrides):
    """A run directory: tokenizer.json + checkpoints/step_00000005 of a random-init small K3 model
    whose vocabulary is the tokenizer's (``overrides``: more model.* values, e.g. ``{"vision.enabled":
    True}`` as keyword ``**{...}``). Returns (run dir, model, tokenizer)."""
    root = Path(root)
    tok = train_bpe_tokenizer([TEXT], 300, root / "tokenizer.json")
    cfg = load_model_config("k3_tiny", **{**SMALL_MODEL, "vocab_size": tok.vocab_size, "max_seq_len": max_seq_len,
                                          **overrides})
    model = build_model(cfg, seed=seed).eval()
    ent = {f"model/{k}": ShardEntry(v.detach(), tuple(v.shape), (0,) * v.dim()) for k, v in model.state_dict().items()}
    ShardedCheckpointer(root / "checkpoints", 0, 1).save(
        5, ent, common={"step": 5}, meta={"config": {"model": asdict(cfg), "quant": {"qat": "none"}}})
    return root, model, tok


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("run"))


def greedy_reference(model, ids, n, eos=None):
    """Full recompute: the training forward over the whole sequence for every new token."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t == eos:
                break
    return out


def test_greedy_cli_output_is_the_full_recompute_loop(tiny_run, tmp_path, capsys):
    run, model, tok = tiny_run
    prompts = ["def main(", "class Point:\n    def", "the quick brown"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(p) for p in prompts[:2]) + "\n"
                   + json.dumps({"prompt": prompts[2], "max_tokens": 5}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--checkpoint", str(run), "--input", str(inp), "--output", str(out), "--max-tokens", "12",
                 "--ignore-eos"]) == 0
    assert "wrote 3 completion(s)" in capsys.readouterr().out
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == prompts
    for r, n in zip(recs, (12, 12, 5)):
        ids = tok.encode(r["prompt"])
        assert r["prompt_tokens"] == len(ids)
        assert r["token_ids"] == greedy_reference(model, ids, n)
        assert r["finish_reason"] == "length" and r["text"] == tok.decode(r["token_ids"])
        with torch.no_grad():  # logprobs: the training forward's log-softmax at each generated position
            full = torch.tensor([ids + r["token_ids"]])
            lp = torch.log_softmax(model(full).logits[0].double(), -1)
        want = [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(r["token_ids"])]
        assert r["logprobs"] == pytest.approx(want, abs=1e-4)
    # plain --prompt prints prompt + completion
    assert main(["--checkpoint", str(run), "--prompt", "def main(", "--max-tokens", "4", "--ignore-eos"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("### 0 [length, 4 tokens]\ndef main(" + recs[0]["text"][:1])


def test_sampling_seeds_and_stop_strings(tiny_run, tmp_path, capsys):
    run, model, tok = tiny_run

    def gen(*extra):
        out = tmp_path / "o.jsonl"
        assert main(["--checkpoint", str(run), "--prompt", "def", "--prompt", "def", "--output", str(out),
                     "--max-tokens", "10", "--temperature", "1.5", "--ignore-eos", *extra]) == 0
        return [json.loads(x) for x in out.read_text().splitlines()]

    a, b = gen("--seed", "7"), gen("--seed", "7")
    assert a == b                                          # same seed: same samples
    assert a[0]["token_ids"] != a[1]["token_ids"]          # prompt i uses seed + i
    # a stop string taken from a greedy completion cuts the text before it
    greedy = tmp_path / "g.jsonl"
    assert main(["--checkpoint", str(run), "--prompt", "def", "--max-tokens", "12", "--ignore-eos",
                 "--output", str(greedy)]) == 0
    full = json.loads(greedy.read_text())["text"]
    stop = full[3:5]
    assert stop and main(["--checkpoint", str(run), "--prompt", "def", "--max-tokens", "12", "--ignore-eos",
                          "--stop", stop, "--output", str(greedy)]) == 0
    r = json.loads(greedy.read_text())
    assert r["finish_reason"] == "stop" and r["text"] == full[:full.find(stop)]
    capsys.readouterr()


def test_bad_input_is_one_line_and_exit_2(tiny_run, tmp_path, capsys):
    run, _, tok = tiny_run
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('"ok"\n{"prompt": \n')
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"prompt": "a", "temp": 1}\n')
    long_prompt = "the quick brown fox " * 60
    assert len(tok.encode(long_prompt)) >= MAX_SEQ
    cases = [
        (["--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x"], "no such file or directory"),
        (["--checkpoint", str(tmp_path), "--prompt", "x"], "no complete megak3 checkpoint"),
        (["--checkpoint", str(run), "--prompt", long_prompt], "context"),
        (["--checkpoint", str(run), "--prompt", "x", "--temperature", "-1"], "sampling.temperature"),
        (["--checkpoint", str(run), "--prompt", "x", "--top-p", "0"], "sampling.top_p"),
        (["--checkpoint", str(run), "--prompt", "x", "--max-tokens", "0"], "sampling.max_tokens"),
        (["--checkpoint", str(run), "--prompt", "x", "--top-k", "-2"], "sampling.top_k"),
        (["--checkpoint", str(run), "--input", str(tmp_path / "none.jsonl")], "no such file"),
        (["--checkpoint", str(run), "--input", str(bad_json)], "bad.jsonl:2: not JSON"),
        (["--checkpoint", str(run), "--input", str(unknown)], "unknown field 'temp'"),
        (["--checkpoint", str(run)], "one of the arguments --prompt --input is required"),
        (["--checkpoint", str(run), "--prompt", "x", "--top-k", "many"], "invalid int value"),
        (["--checkpoint", str(run), "--prompt", "x", "--device", "tpu9"], "--device"),
        (["--checkpoint", str(run), "--prompt", "x", "--output", str(tmp_path / "no" / "o.jsonl")], "does not exist"),
        (["--checkpoint", str(run), "--prompt", "x", "--dtype", "int3"], "dtype"),
    ]
    for argv, needle in cases:
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, (argv, err)


def test_module_entry_point_fails_cleanly(tiny_run, tmp_path):
    """A real process: exit 2, one line, no traceback (tests/test_server.py runs the entry point's happy path)."""
    run, _, _ = tiny_run
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    bad = subprocess.run([sys.executable, "-m", "megak3.generate", "--checkpoint", str(run), "--prompt", "x",
                          "--top-p", "1.5"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "sampling.top_p" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_generates_the_same_from_a_hugging_face_export(tiny_run, tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    run, model, tok = tiny_run
    lines = []
    convert_hf.export(run / "checkpoints", tmp_path / "hf", experts="bf16", dtype="fp32", log=lines.append)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert not any("no tokenizer.json" in ln for ln in lines)
    outs = []
    for src in (run, tmp_path / "hf"):
        out = tmp_path / f"{src.name}.jsonl"
        assert main(["--checkpoint", str(src), "--prompt", "class Point:", "--max-tokens", "8", "--ignore-eos",
                     "--output", str(out)]) == 0
        outs.append(json.loads(out.read_text())["token_ids"])
    assert outs[0] == outs[1] == greedy_reference(model, tok.encode("class Point:"), 8)


def test_images_through_the_cli(tmp_path, capsys):
    """--image and JSONL "images": the media slots at the <image> marker (or first), and the greedy tokens
    equal the training forward's argmax loop over the same ids and pixels; bad images exit 2."""
    import numpy as np
    from PIL import Image

    from megak3.inference.media import image_slots, image_tensor

    run, model, tok = make_tiny_run(tmp_path / "run", max_seq_len=160, **{"vision.enabled": True})
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(tmp_path / name)

    def reference(before, name, after, n):
        im = image_tensor((tmp_path / name).read_bytes(), model.config)
        ids = (tok.encode(before) if before else []) + [tok.media_id] * image_slots(im, model.config) + \
            tok.encode(after)
        out = []
        with torch.no_grad():
            for _ in range(n):
                out.append(int(model(torch.tensor([ids + out]), images=[im]).logits[0, -1].argmax()))
        return ids, out

    out = tmp_path / "o.jsonl"
    assert main(["--checkpoint", str(run), "--prompt", "look <image> here", "--image", str(tmp_path / "a.png"),
                 "--max-tokens", "5", "--ignore-eos", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    ids, ref = reference("look ", "a.png", " here", 5)
    assert r["prompt_tokens"] == len(ids) and r["token_ids"] == ref
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "look <image> here", "images": ["a.png"]}) + "\n"
                   + json.dumps({"prompt": "what is it", "images": ["b.png"]}) + "\n" + json.dumps("plain") + "\n")
    assert main(["--checkpoint", str(run), "--input", str(inp), "--max-tokens", "5", "--ignore-eos",
                 "--output", str(out)]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs[0]["token_ids"] == ref                          # the same request batched with others
    assert recs[1]["token_ids"] == reference("", "b.png", "what is it", 5)[1]   # no marker: image first
    assert recs[2]["token_ids"] == greedy_reference(model, tok.encode("plain"), 5)
    capsys.readouterr()
    (tmp_path / "bad.png").write_bytes(b"not an image")
    text_run, _, _ = make_tiny_run(tmp_path / "text_run")
    for argv, needle in (
            (["--checkpoint", str(run), "--prompt", "a <image> b <image>", "--image", str(tmp_path / "a.png")],
             "markers"),
            (["--checkpoint", str(run), "--prompt", "x", "--image", str(tmp_path / "none.png")], "no such"),
            (["--checkpoint", str(run), "--prompt", "x", "--image", str(tmp_path / "bad.png")], "not a usable"),
            (["--checkpoint", str(run), "--prompt", "x", "--prompt", "y", "--image", str(tmp_path / "a.png")],
             "exactly one --prompt"),
            (["--checkpoint", str(text_run), "--prompt", "x", "--image", str(tmp_path / "a.png")], "vision")):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, (argv, err)
