"""Scheduling and sampling: continuous batching gives each request the tokens it gets alone (greedy
and seeded sampling), top-k / top-p semantics, logprobs of the distribution sampled, stop tokens,
stop strings, max tokens, and one-line errors for bad sampling values and prompts."""
import pytest
import torch

from megak3.inference import Engine, InferenceError, SamplingParams
from megak3.inference.sampling import filtered_logprobs, filtered_probs
from test_inference_decode import small_model


@pytest.fixture(scope="module")
def model():
    return small_model("plain", seed=11)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 19, 8, 30, 12)]


def _eng(model, **kw):
    return Engine(model, page_size=8, checkpoint_interval=16, prefill_chunk=16, **kw)


def test_batch_mates_do_not_change_a_request(model):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=6 + i, temperature=0.0 if i % 2 else 0.9, top_p=0.9, top_k=40, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    batched = _eng(model, max_batch=2).generate(prompts, params)   # requests join as others finish
    for p, sp, b in zip(prompts, params, batched):
        alone = _eng(model).generate([p], sp)[0]
        assert b.token_ids == alone.token_ids and len(b.token_ids) == sp.max_tokens
        assert max(abs(x - y) for x, y in zip(b.logprobs, alone.logprobs)) <= 1e-5
        # logprobs are those of the distribution sampled (greedy: the model's own), from the training forward
        seq = p + b.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0]
        rows = [logits[len(p) - 1 + i] for i in range(len(b.token_ids))]
        lp = [torch.log_softmax(r, -1) if sp.temperature == 0 else torch.log(filtered_probs(r, sp)) for r in rows]
        want = [float(l[t]) for l, t in zip(lp, b.token_ids)]
        assert max(abs(x - y) for x, y in zip(b.logprobs, want)) <= 1e-5
    again = _eng(model).generate(prompts[:1], params[0])[0]
    assert again.token_ids == batched[0].token_ids          # same seed, same tokens


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    p = _prompts()[1]
    greedy = _eng(model).generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    for sp in (SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
               SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True)):
        assert _eng(model).generate([p], sp)[0].token_ids == greedy


def test_filtered_probs_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))   # smallest set reaching 0.8
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    p = filtered_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)
    lp = filtered_logprobs(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9))   # keeps 0.25, 0.09
    assert torch.allclose(lp[:2], torch.log(torch.tensor([0.25, 0.09]) / 0.34)) and torch.isinf(lp[2:]).all()


def test_stop_tokens_strings_and_length(model, tmp_path):
    from megak3.data.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["def f(x):\n    return x + 1\n" * 20, "hello world " * 30], 300,
                              tmp_path / "tokenizer.json")
    eng = Engine(model, tok, page_size=8, checkpoint_interval=16)
    p = _prompts()[3]
    free = eng.generate([p], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    assert free.text == tok.decode(free.token_ids)
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = eng.generate([p], SamplingParams(max_tokens=12, stop_token_ids=(stop_id,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    assert out.text == tok.decode(free.token_ids[:first])
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    out = eng.generate([p], SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]
    assert stop not in out.text and len(out.token_ids) <= 12
    streamed = list(eng.stream(p, SamplingParams(max_tokens=5, ignore_eos=True)))
    assert [t for t, _ in streamed] == free.token_ids[:5]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_k", -2), ("seed", -1), ("stop", "x")])
def test_bad_sampling_values_one_line(model, field, value):
    with pytest.raises(InferenceError) as e:
        _eng(model).generate([[5, 6]], SamplingParams(**{field: value}))
    msg = str(e.value)
    assert msg.startswith(f"sampling.{field}=") and "\n" not in msg


def test_bad_prompts_one_line(model):
    eng = _eng(model)
    for prompts, needle in (([[]], "non-empty"), ([[5, 100000]], "vocabulary"),
                            ([[5] * model.config.max_seq_len], "exceed the context")):
        with pytest.raises(InferenceError, match=needle):
            eng.generate(prompts, SamplingParams())
