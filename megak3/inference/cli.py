"""``python -m megak3.generate``: generate from a megak3 checkpoint, or serve it over HTTP.

    python -m megak3.generate --checkpoint runs/X --prompt "def main(" --max-tokens 32
    python -m megak3.generate --checkpoint runs/X --input prompts.jsonl --output out.jsonl --temperature 0.8 --seed 1
    python -m megak3.generate --checkpoint runs/X --prompt "<image> A photo of" --image cat.png
    python -m megak3.generate serve --checkpoint runs/X --port 8000      # OpenAI-style HTTP (server.py)

``--checkpoint`` is anything :meth:`megak3.inference.Engine.from_pretrained` loads: a run directory,
a checkpoint root or ``step_XXXXXXXX`` directory of any training layout, or a Hugging Face export.
``--input`` is a JSONL file, one prompt per line: a JSON string, or an object with ``"prompt"`` and
optionally its own ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (they
replace the command line's values for that prompt) and ``images`` (image files, relative paths
from the JSONL file's directory). Images (``--image FILE``, repeatable, with one ``--prompt``) go
where the prompt has ``<image>`` markers, one per image, or before the text when it has none; each
becomes the vision tower's ``<|media|>`` slots (megak3/inference/media.py). All prompts go to one ``Engine.generate`` call
(continuously batched); results come back in input order. With ``--seed S`` prompt ``i`` samples
with seed ``S + i`` (a line's own ``seed`` wins). Prompts are encoded as they are (no bos: the
training data has none; documents end with eos); an empty prompt is the single token eos.

Output: without ``--output`` each prompt's generated text is printed, one block per prompt; with
``--output FILE`` one JSON object per prompt is written (``index, prompt, text, finish_reason,
prompt_tokens, token_ids, logprobs``) and a one-line summary is printed.

Bad input (a missing checkpoint, an unreadable or malformed --input, a missing or undecodable image,
images for a model without a vision tower, a prompt that leaves no room in the model's context, a
bad sampling value) is one line on stderr and exit status 2, checked before
the model is loaded wherever it can be (the context length needs the loaded model).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

from megak3.cli import Parser, error_exit
from megak3.inference.options import add_model_args, load_engine

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
"""per-prompt fields a JSONL line may set"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m megak3.generate", description=__doc__.split("\n\n")[0],
               epilog="serve: python -m megak3.generate serve --checkpoint PATH --port N (see --help there)",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for several)")
    src.add_argument("--input", metavar="JSONL", help="prompts, one JSON string or {\"prompt\": ...} per line")
    p.add_argument("--output", metavar="JSONL", help="write one JSON result per prompt here")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="prompt i samples with seed SEED + i")
    p.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at eos")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the (single) --prompt, at its next <image> marker (repeatable)")
    return p


def read_jsonl_prompts(path: str) -> List[dict]:
    """[{"prompt": str, <sampling overrides>}] of a JSONL file; ValueError (one line) naming the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--input {path}: no such file")
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"--input {path}:{n}: not JSON ({e})") from None
        if isinstance(rec, str):
            rec = {"prompt": rec}
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ValueError(f"--input {path}:{n}: expected a JSON string or an object with a string \"prompt\"")
        unknown = sorted(set(rec) - {"prompt", "images", *SAMPLING_KEYS})
        if unknown:
            raise ValueError(f"--input {path}:{n}: unknown field {unknown[0]!r}; allowed: prompt, images, "
                             f"{', '.join(SAMPLING_KEYS)}")
        imgs = rec.get("images", [])
        if not isinstance(imgs, list) or not all(isinstance(x, str) and x for x in imgs):
            raise ValueError(f"--input {path}:{n}: \"images\" must be a list of image file paths")
        rec["images"] = [str(p.parent / x) for x in imgs]
        if isinstance(rec.get("stop"), str):
            rec["stop"] = [rec["stop"]]
        out.append(rec)
    if not out:
        raise ValueError(f"--input {path}: no prompts in the file")
    return out


def request_params(base, recs: List[dict]) -> list:
    """One validated SamplingParams per record: ``base`` with the record's overrides; with a base seed
    S and no seed of its own, record ``i`` gets S + i. Raises InferenceError naming the prompt."""
    from megak3.inference import InferenceError

    out = []
    for i, rec in enumerate(recs):
        kw = {k: rec[k] for k in SAMPLING_KEYS if k in rec}
        if "stop" in kw:
            kw["stop"] = tuple(kw["stop"]) if isinstance(kw["stop"], list) else kw["stop"]
        if "seed" not in kw and base.seed is not None:
            kw["seed"] = base.seed + i
        sp = replace(base, **kw)
        try:
            sp.validate()
        except ValueError as e:
            raise InferenceError(f"prompt {i}: {e}" if len(recs) > 1 else str(e)) from None
        out.append(sp)
    return out


def read_images(recs: List[dict]) -> List[List[bytes]]:
    """The bytes of every record's image files (checked before the model loads)."""
    from megak3.inference.media import read_local_image

    return [[read_local_image(f) for f in rec.get("images", ())] for rec in recs]


def encode_prompts(engine, texts: List[str], images: Optional[List[list]] = None) -> List[List[int]]:
    """Token ids of each prompt (an empty prompt is [eos]; ``images[i]``: prompt i's image tensors,
    whose ``<|media|>`` slots go at its ``<image>`` markers); InferenceError when one leaves no room to
    generate in the model's context."""
    from megak3.inference import InferenceError
    from megak3.inference.media import image_slots, prompt_with_images

    tok = engine.tokenizer
    out = []
    for i, t in enumerate(texts):
        ims = images[i] if images else None
        if ims:
            ids = prompt_with_images(tok, t, [image_slots(im, engine.model.config) for im in ims])
        else:
            ids = tok.encode(t) or [tok.eos_id]
        if len(ids) >= engine.max_context:
            raise InferenceError(f"prompt {i} has {len(ids)} tokens; the model's context is {engine.max_context} "
                                 "tokens (max_context): shorten the prompt")
        out.append(ids)
    return out


def generate_main(argv: Optional[List[str]] = None) -> int:
    from megak3.inference import SamplingParams

    p = build_parser()
    a = p.parse_args(argv)
    try:
        if a.image and (a.input or len(a.prompt) != 1):
            raise ValueError("--image goes with exactly one --prompt; give each --input line its own \"images\"")
        recs = read_jsonl_prompts(a.input) if a.input else [{"prompt": t, "images": a.image} for t in a.prompt]
        raw_images = read_images(recs)
        base = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                              seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos)
        params = request_params(base, recs)
        if a.output and Path(a.output).is_dir():
            raise ValueError(f"--output {a.output} is a directory; give a file name")
        if a.output and not Path(a.output).resolve().parent.is_dir():
            raise ValueError(f"--output {a.output}: directory {Path(a.output).resolve().parent} does not exist")
        engine = load_engine(a)
        images = None
        if any(raw_images):
            from megak3.inference.media import image_tensor

            dev = next(engine.model.parameters()).device
            images = [[image_tensor(raw, engine.model.config, f).to(dev) for raw, f in zip(raws, rec["images"])]
                      or None for raws, rec in zip(raw_images, recs)]
        ids = encode_prompts(engine, [r["prompt"] for r in recs], images)
        t0 = time.perf_counter()
        results = engine.generate(ids, params, images)
        seconds = time.perf_counter() - t0
    except ValueError as e:  # InferenceError included: a user error, one line
        return error_exit(p.prog, e)
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            for i, (rec, c) in enumerate(zip(recs, results)):
                f.write(json.dumps({"index": i, "prompt": rec["prompt"], "text": c.text,
                                    "finish_reason": c.finish_reason, "prompt_tokens": len(c.prompt_ids),
                                    "token_ids": c.token_ids, "logprobs": c.logprobs}) + "\n")
        n = sum(len(c.token_ids) for c in results)
        print(f"wrote {len(results)} completion(s), {n} generated tokens in {seconds:.2f} s "
              f"({n / max(seconds, 1e-9):.1f} tokens/s) to {a.output}")
    else:
        for i, (rec, c) in enumerate(zip(recs, results)):
            print(f"### {i} [{c.finish_reason}, {len(c.token_ids)} tokens]")
            print(rec["prompt"] + c.text)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from megak3.inference.server import serve_main

        return serve_main(argv[1:])
    return generate_main(argv)
