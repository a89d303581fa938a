"""lm-evaluation-harness model ``megak3``: evaluate a megak3 checkpoint with the harness's own tasks.

    python -m megak3.inference.lm_eval_adapter --model megak3 --model_args checkpoint=runs/X --tasks lambada_openai
    megak3-lm-eval --model megak3 --model_args checkpoint=runs/X,dtype=float32 --tasks my_task --include_path tasks/

    import lm_eval, megak3.inference.lm_eval_adapter        # the import registers "megak3"
    lm_eval.simple_evaluate(model="megak3", model_args={"checkpoint": "runs/X"}, tasks=[...])

lm-eval (0.4.x) finds models in its own registry only, so the model is registered by importing
this module: ``python -m megak3.inference.lm_eval_adapter`` (console script ``megak3-lm-eval``)
imports it and then runs the harness's command line with the same arguments as ``lm_eval``.

``model_args``: ``checkpoint`` (anything ``Engine.from_pretrained`` loads), ``device`` (default
cpu; a CUDA device on a machine without one, the harness command line's default, falls back to cpu
with a notice), ``dtype`` (default float32), ``batch_size`` (sequences per ``Engine.score`` /
``Engine.generate`` call, default 16), ``threads`` (torch CPU threads; default: leave torch's setting).

Requests go through the engine: ``loglikelihood`` and ``loglikelihood_rolling`` through
``Engine.score`` (log p of each token given the ones before it), ``generate_until`` through
``Engine.generate`` (greedy unless the task sets ``do_sample`` / ``temperature``; ``until`` are stop
strings; ``max_gen_toks`` default 256). Tokenisation follows the harness's Hugging Face model: a
(context, continuation) pair is encoded as ``encode(context + continuation)`` split at
``len(encode(context))`` (so a merge across the boundary is scored as the model would see the
text), an empty context becomes the single token eos (megak3's document separator, the training
data has no bos), and a (context + continuation) longer than the model's context keeps its last
``max_context + 1`` tokens (a forward over ``max_context`` positions scores them, as the harness's
HF model does). ``--apply_chat_template`` renders the few-shot turns with megak3's chat template
(``<|bos|>role\ncontent<|eos|>`` per turn, then the open ``<|bos|>assistant\n`` header: the template
SFT trains on and the HTTP server uses, megak3/data/chat.py) as text, and the adapter encodes that
text so the reserved token strings become their ids. ``loglikelihood_rolling`` scores the whole text
in disjoint windows of ``max_context`` predicted tokens (full-context windows, like the harness's HF
model), eos as the first window's prefix, cut by the harness's own rolling-window helpers.
"""
from __future__ import annotations

if __name__ == "__main__":  # python -m: run the importable module's main, so the model registers once
    import sys

    from megak3.inference.lm_eval_adapter import main

    sys.exit(main())

import sys
from typing import List, Optional, Tuple

import torch

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


def _truncate_left(ids: List[int], n: int) -> List[int]:
    return ids[-n:] if len(ids) > n else ids


@register_model("megak3")
class Megak3LM(LM):
    """The harness's LM interface over :class:`megak3.inference.Engine` (module docstring)."""

    def __init__(self, checkpoint: Optional[str] = None, device: Optional[str] = None, dtype: str = "float32",
                 batch_size=16, max_batch_size: Optional[int] = None, engine=None, threads: Optional[int] = None,
                 **unused):
        super().__init__()
        self._chat = False
        """set by apply_chat_template: strings are then encoded with the chat template's reserved ids"""
        if threads is not None:
            torch.set_num_threads(max(1, int(threads)))
        if engine is None:
            if not checkpoint:
                raise ValueError("lm-eval model megak3: give --model_args checkpoint=PATH (a megak3 run dir, "
                                 "checkpoint dir or Hugging Face export dir)")
            from megak3.inference.options import check_checkpoint_path
            from megak3.inference import Engine

            check_checkpoint_path(str(checkpoint))
            device = str(device or "cpu")
            if device.startswith("cuda") and not torch.cuda.is_available():  # the harness CLI's default
                print(f"megak3 lm-eval model: device={device} but this machine has no CUDA device; using cpu "
                      "(pass --device cpu to silence this)", file=sys.stderr)
                device = "cpu"
            engine = Engine.from_pretrained(str(checkpoint), device=device, dtype=dtype)
        self.engine = engine
        self._device = getattr(engine.runner, "device", "cpu") if hasattr(engine, "runner") else "cpu"
        self.tok = engine.tokenizer
        self.max_length = engine.max_context
        try:
            self.batch_size = max(1, int(batch_size))
        except (TypeError, ValueError):  # "auto": the engine batches internally
            self.batch_size = 16

    # ---- tokenisation -------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, text: str) -> List[int]:
        if self._chat:  # after apply_chat_template: reserved strings are ids
            from megak3.data.chat import encode_chat_text

            return encode_chat_text(self.tok, text)
        return self.tok.encode(text)

    def tok_decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        n_space = len(context) - len(context.rstrip())  # the harness's rule: trailing space goes with the continuation
        if n_space:
            continuation = context[-n_space:] + continuation
            context = context[:-n_space]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return (ctx if ctx else [self.eot_token_id]), whole[len(ctx):]

    # ---- chat (--apply_chat_template): megak3's chat template (megak3/data/chat.py), as text -------
    @property
    def tokenizer_name(self) -> str:
        return f"megak3:{getattr(self.tok, 'path', 'tokenizer')}"

    def chat_template(self, chat_template=False) -> str:
        return "megak3: <|bos|>{role}\n{content}<|eos|> ... <|bos|>assistant\n"

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """The conversation as text with the reserved token strings; from here on the adapter encodes
        strings with :func:`encode_chat_text`, so they become the ids SFT trained on."""
        from megak3.data.chat import render_chat_text

        self._chat = True
        return render_chat_text(self.tok, chat_history, add_generation_prompt)

    # ---- scoring ------------------------------------------------------------------------------------
    def _score_pairs(self, pairs: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy one) per (context, continuation)."""
        seqs, spans = [], []
        for ctx, cont in pairs:
            if not cont:
                seqs.append(None)
                spans.append(0)
                continue
            seq = _truncate_left(ctx + cont, self.max_length + 1)   # a forward of max_length positions
            if len(seq) == len(cont):  # no context left: the continuation's first token cannot be scored
                seq = [self.eot_token_id] + seq[-self.max_length:]
                cont = seq[1:]
            seqs.append(seq)
            spans.append(len(cont))
        live = [i for i, s in enumerate(seqs) if s is not None]
        scored = {}
        for b in range(0, len(live), self.batch_size):
            idx = live[b:b + self.batch_size]
            for i, sc in zip(idx, self.engine.score([seqs[i] for i in idx])):
                scored[i] = sc
        out = []
        for i, n in enumerate(spans):
            if n == 0:
                out.append((0.0, True))
                continue
            sc = scored[i]
            out.append((float(sum(sc.logprobs[-n:])), bool(all(sc.greedy[-n:]))))
        return out

    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        return self._score_pairs([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests) -> List[float]:
        out = []
        for r in requests:
            (text,) = r.args[:1]
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.eot_token_id, max_seq_len=self.max_length,
                context_len=1)]
            out.append(sum(ll for ll, _ in self._score_pairs(windows)))
        return out

    # ---- generation ---------------------------------------------------------------------------------
    def generate_until(self, requests) -> List[str]:
        from megak3.inference import SamplingParams

        prompts, params = [], []
        for r in requests:
            context, gen_kwargs = r.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_gen = int(kw.pop("max_gen_toks", kw.pop("max_tokens", 256)))
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 1.0 if do_sample else 0.0))
            if not do_sample:
                temperature = 0.0
            sp = SamplingParams(max_tokens=max_gen, temperature=temperature, top_p=float(kw.pop("top_p", 1.0)),
                                top_k=int(kw.pop("top_k", 0) or 0), seed=kw.pop("seed", None),
                                stop=tuple(s for s in until if s))
            sp.validate()
            ids = self.tok_encode(context) or [self.eot_token_id]
            room = max(1, self.max_length - max_gen)
            prompts.append(_truncate_left(ids, min(room, self.max_length - 1)))
            params.append(sp)
        out = []
        for b in range(0, len(prompts), self.batch_size):
            out.extend(c.text for c in self.engine.generate(prompts[b:b + self.batch_size],
                                                             params[b:b + self.batch_size]))
        return out


def main(argv: Optional[List[str]] = None) -> int:
    """The harness's command line with the ``megak3`` model registered (same arguments as ``lm_eval``)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    cli_evaluate()
    return 0

