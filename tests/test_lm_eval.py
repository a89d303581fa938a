"""The lm-evaluation-harness adapter (megak3/inference/lm_eval_adapter.py) through the harness's own
``simple_evaluate`` on the local tasks in tests/lm_eval_task/ (a JSONL and three YAML tasks: multiple
choice -> loglikelihood, perplexity -> loglikelihood_rolling, greedy continuation -> generate_until),
each result checked against the training forward of megak3.model computed here."""
import os
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from megak3.inference.lm_eval_adapter import Megak3LM  # noqa: E402  (registers "megak3")
from test_generate_cli import MAX_SEQ, greedy_reference, make_tiny_run  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_task"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return make_tiny_run(tmp_path_factory.mktemp("run"))


def _ref_logprob(model, ctx, cont) -> tuple:
    """sum log p(cont | ctx) and whether cont is greedy, from the training forward."""
    ids = torch.tensor([(ctx + cont)[:-1]])   # the last token is predicted, never an input
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].double(), -1)
    pos = range(len(ctx) - 1, len(ctx) + len(cont) - 1)
    return (sum(float(lp[p, t]) for p, t in zip(pos, cont)),
            all(int(lp[p].argmax()) == t for p, t in zip(pos, cont)))


def _pair(tok, context, continuation):
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    return (ctx or [tok.eos_id]), whole[len(ctx):]


def test_simple_evaluate_on_the_local_tasks_matches_the_training_forward(run):
    path, model, tok = run
    tm = TaskManager(include_path=str(TASKS), include_defaults=False)
    res = lm_eval.simple_evaluate(model="megak3", model_args={"checkpoint": str(path)},
                                  tasks=["megak3_mc", "megak3_ppl", "megak3_gen"], log_samples=True,
                                  task_manager=tm, bootstrap_iters=0)
    for t in ("megak3_mc", "megak3_ppl", "megak3_gen"):
        assert len(res["samples"][t]) == 4, t
    # loglikelihood: every choice of every question equals the training forward's
    for s in res["samples"]["megak3_mc"]:
        got = [r[0] for r in s["resps"]]
        for (ctx_text, cont_text), (ll, greedy) in zip(s["arguments"], got):
            ref_ll, ref_greedy = _ref_logprob(model, *_pair(tok, ctx_text, cont_text))
            assert ll == pytest.approx(ref_ll, rel=1e-5, abs=1e-5) and greedy == ref_greedy
        refs = [_ref_logprob(model, *_pair(tok, *a))[0] for a in s["arguments"]]
        assert s["acc"] == float(max(range(len(refs)), key=refs.__getitem__) == s["target"])
    # loglikelihood_rolling: whole-text log likelihood, eos before the first token
    for s in res["samples"]["megak3_ppl"]:
        ids = tok.encode(s["doc"]["text"])
        assert len(ids) < MAX_SEQ
        ll, _ = _ref_logprob(model, [tok.eos_id], ids)
        assert s["resps"][0][0] == pytest.approx(ll, rel=1e-5)
    # generate_until: the greedy full-recompute continuation, cut at the first newline
    for s in res["samples"]["megak3_gen"]:
        ref = greedy_reference(model, tok.encode(s["doc"]["context"]), 8, eos=tok.eos_id)
        text = tok.decode(ref[:-1] if ref[-1] == tok.eos_id else ref).split("\n")[0]
        assert s["resps"][0][0] == text
    acc = res["results"]["megak3_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and res["results"]["megak3_ppl"]["word_perplexity,none"] > 1.0


def test_rolling_windows_beyond_the_context_and_truncated_contexts(run):
    path, model, tok = run
    lm = Megak3LM(checkpoint=str(path), batch_size=3)
    text = "the quick brown fox jumps over the lazy dog. def main(argv): return 1\n" * 12
    ids = tok.encode(text)
    assert len(ids) > 2 * MAX_SEQ
    ref = 0.0   # full-context windows (lm-eval's HF model: max_seq_len = the model's context)
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, tok.eos_id, MAX_SEQ, 1)):
        assert len(ctx + cont) - 1 <= MAX_SEQ
        ref += _ref_logprob(model, ctx, cont)[0]
    short = sum(_ref_logprob(model, c, x)[0] for c, x in map(make_disjoint_window, get_rolling_token_windows(
        ids, tok.eos_id, MAX_SEQ - 1, 1)))
    print(f"rolling windows of {MAX_SEQ} vs {MAX_SEQ - 1} tokens: {ref:.4f} vs {short:.4f} nats")

    class Req:
        def __init__(self, *args):
            self.args = args

    assert lm.loglikelihood_rolling([Req(text)])[0] == pytest.approx(ref, rel=1e-5)
    # a context longer than the model's keeps its last tokens
    ctx, cont = _pair(tok, text + "the quick brown fox jumps over the", " lazy dog")
    keep = (ctx + cont)[-(MAX_SEQ + 1):]   # a forward of MAX_SEQ positions scores MAX_SEQ + 1 tokens
    want = _ref_logprob(model, keep[:-len(cont)], cont)
    got = lm.loglikelihood([Req(text + "the quick brown fox jumps over the", " lazy dog")])[0]
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == want[1]
    # empty context: eos stands before the continuation
    want = _ref_logprob(model, [tok.eos_id], tok.encode("def main"))
    assert lm.loglikelihood([Req("", "def main")])[0][0] == pytest.approx(want[0], rel=1e-5)
    with pytest.raises(ValueError, match="checkpoint=PATH"):
        Megak3LM()



def test_chat_template_is_the_sft_template(run):
    """--apply_chat_template renders megak3's chat template (the one SFT trains on and the server
    uses) as text, and the adapter then encodes it to exactly the template's ids."""
    from megak3.data.chat import encode_chat, generation_prompt

    path, _, _ = run
    lm = Megak3LM(checkpoint=str(path))
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    text = lm.apply_chat_template(turns)
    assert text == "<|bos|>user\n2+2?<|eos|><|bos|>assistant\n4<|eos|><|bos|>assistant\n"
    assert lm.tok_encode(text) == generation_prompt(lm.tok, turns)
    open_turn = lm.apply_chat_template(turns, add_generation_prompt=False)
    assert lm.tok_encode(open_turn) == encode_chat(lm.tok, turns)[0][:-1]      # the last reply continued
    assert lm.tokenizer_name.startswith("megak3:")