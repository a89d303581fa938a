"""Prompt holds (megak3/inference/prompt_holds.py): the later samples of a long prompt wait for the first to
fill the prefix cache, then restore it; every output equals the engine's without holds (share_prompts=False):
the same tokens and top-k ids, logprobs to 1e-5 (a ragged decode step's rounding depends on which sequences
share it, as after a preemption: tests/test_inference_engine_api.py), and a leader that is aborted, paused
or preempted never leaves its held samples waiting for ever."""
import pytest
import torch

from megak3.inference import Engine, SamplingParams
from test_inference_decode import small_model

# 4-token pages, KDA checkpoints every 16 tokens, 16-token prefill chunks: a 50-token prompt is 4 chunks
OPTS = dict(page_size=4, checkpoint_interval=16, prefill_chunk=16)
K, N = 4, 50


@pytest.fixture(scope="module")
def model():
    return small_model("plain", seed=7)


def _ids(n, seed):
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _params(i):
    if i == 0:   # one greedy sample, the others seeded
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=2)
    return SamplingParams(max_tokens=6, temperature=0.9, seed=i, ignore_eos=True, top_logprobs=2)


def _out(c):
    return c.token_ids, [[t for t, _ in top] for top in c.top_logprobs], \
        c.logprobs + [lp for top in c.top_logprobs for _, lp in top]


def _same(got, want):
    """The same tokens and top-k ids; logprobs (of the tokens and of the top-k) to 1e-5."""
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        assert g[2] == pytest.approx(w[2], abs=1e-5)
    return True


@pytest.fixture(scope="module")
def reference(model):
    """Each sample's completion on the engine without holds."""
    eng = Engine(model, **OPTS, num_pages=400, share_prompts=False)
    return [_out(c) for c in eng.generate([_ids(N, 1)] * K, [_params(i) for i in range(K)])]


def _finish(eng, hs):
    while any(not h.finished for h in hs):
        eng.step([h for h in hs if not h.finished and not h.paused])
    return [_out(eng.completion(h)) for h in hs]


def _assert_clean(eng):
    assert eng.live() == [] and eng.cache.seqs == {} and eng.cache.reserved == 0


@pytest.mark.parametrize("num_pages", [400, 48])
def test_k_samples_begun_together_prefill_the_prompt_once(model, reference, num_pages):
    # as PartialRollouts does: K begins, then step(handles) until all finish. 48 pages of 4 tokens: the
    # pool cannot hold the K samples' prompts at once (outputs still equal; sequences preempted)
    def run(share):
        eng = Engine(model, **OPTS, num_pages=num_pages, share_prompts=share)
        hs = [eng.begin(_ids(N, 1), _params(i)) for i in range(K)]
        assert [h.held for h in hs] == [False] + [share] * (K - 1)
        out = _finish(eng, hs)
        _assert_clean(eng)
        return out, eng.cache_stats()

    got, stats = run(True)
    off, ref = run(False)
    assert _same(got, off) and _same(off, reference)
    if num_pages == 400:   # one prompt + the copies' tail after the last checkpoint (48), computed once
        assert stats["prefill_computed"] == N + (N - 48) and stats["prefill_shared"] == (K - 2) * (N - 48)
        assert ref["prefill_computed"] + ref["prefill_shared"] == K * N   # without: the first chunk shared
        assert ref["prefill_computed"] == N + (K - 1) * (N - 16)
    else:
        assert stats["prefill_computed"] < ref["prefill_computed"]
    # Engine.generate with n samples of one prompt holds the same way
    eng = Engine(model, **OPTS, num_pages=num_pages)
    assert _same([_out(c) for c in eng.generate([_ids(N, 1)] * K, [_params(i) for i in range(K)])], reference)
    _assert_clean(eng)


def test_short_prompts_and_other_prompts_are_not_held(model):
    eng = Engine(model, **OPTS, num_pages=400)
    a, b = eng.begin(_ids(16, 2), _params(1)), eng.begin(_ids(16, 2), _params(2))   # <= one checkpoint interval
    c, d = eng.begin(_ids(N, 3), _params(1)), eng.begin(_ids(N, 4), _params(2))     # different prompts
    assert not any(h.held for h in (a, b, c, d))
    e = eng.begin(_ids(N, 3), _params(3))
    assert e.held and e.lead is c
    _finish(eng, [a, b, c, d, e])
    _assert_clean(eng)
    f = eng.begin(_ids(N, 3), _params(3))   # its first sample has finished: a plain prefix hit, no hold
    assert not f.held
    eng.abort(f)


def test_leader_aborted_the_copies_proceed(model, reference):
    eng = Engine(model, **OPTS, num_pages=400)
    hs = [eng.begin(_ids(N, 1), _params(i)) for i in range(K)]
    eng.step(hs)   # the leader prefills its first chunk
    eng.abort(hs[0])
    eng.step(hs[1:])   # the first copy leads the rest in its place
    assert hs[1].admitted and not hs[1].held and all(h.held and h.lead is hs[1] for h in hs[2:])
    assert _same(_finish(eng, hs[1:]), reference[1:])
    assert hs[0].finish_reason == "abort"
    _assert_clean(eng)


def test_copies_aborted_while_held(model, reference):
    eng = Engine(model, **OPTS, num_pages=400)
    hs = [eng.begin(_ids(N, 1), _params(i)) for i in range(K)]
    eng.step(hs)
    for h in hs[1:]:
        assert h.held
        eng.abort(h)
    assert _same(_finish(eng, hs[:1]), reference[:1])
    _assert_clean(eng)


def test_leader_paused_by_the_caller_hands_the_lead_on(model, reference):
    # decided: a held sample waits only for a leader that the same step() runs; a leader that is paused
    # (or not stepped) hands the lead to the first held sample, which prefills in its place
    eng = Engine(model, **OPTS, num_pages=400)
    hs = [eng.begin(_ids(N, 1), _params(i)) for i in range(K)]
    eng.step(hs)
    eng.pause(hs[0])
    eng.step()   # default set: the paused leader is left out
    assert hs[1].admitted and all(h.lead is hs[1] for h in hs[2:])
    assert _same(_finish(eng, hs[1:]), reference[1:])
    eng.resume(hs[0])
    assert _same(_finish(eng, hs[:1]), reference[:1])
    _assert_clean(eng)
    # stepping a copy alone (e.g. Engine.stream of it) does not wait for a leader it never steps
    eng = Engine(model, **OPTS, num_pages=400)
    hs = [eng.begin(_ids(N, 1), _params(i)) for i in range(2)]
    assert hs[1].held and _same(_finish(eng, hs[1:]), reference[1:2])
    assert _same(_finish(eng, hs[:1]), reference[:1])
    _assert_clean(eng)


def test_leader_preempted_while_copies_are_held(model, reference):
    eng = Engine(model, **OPTS, num_pages=400)
    hs = [eng.begin(_ids(N, 1), _params(i)) for i in range(K)]
    eng.step(hs)
    eng.step(hs)
    eng._preempt(hs[0])   # what page pressure does: its pages freed, its computed blocks stay cached
    eng.step(hs)
    assert hs[0].admitted and hs[0].hit_tokens == 0 and all(h.held for h in hs[1:])
    assert _same(_finish(eng, hs), reference)
    assert eng.cache_stats()["prefill_computed"] < 2 * N   # the leader restored its own blocks
    _assert_clean(eng)


def test_partial_rollouts_of_a_group_prefill_its_prompt_once(model):
    # a GRPO group on PartialRollouts (posttrain/rollout.py): stopped after 2 iterations with the copies held
    # (every unfinished sample is paused), then run to the end; the same tokens as without holds
    from megak3.posttrain.buffer import Rollout
    from megak3.posttrain.rollout import PartialRollouts

    def run(share):
        eng = Engine(model, **OPTS, num_pages=400, share_prompts=share)
        group = [Rollout(uid=i, group=0, prompt_ids=_ids(N, 1), budget=6) for i in range(K)]
        sampler = PartialRollouts(eng, SamplingParams(max_tokens=6, temperature=0.9, ignore_eos=True), seed=3)
        sampler.run(group, version=0, max_steps=2)
        assert all(h.held == share for h, _ in list(sampler.live.values())[1:])
        sampler.run(group, version=0)
        _assert_clean(eng)
        return [(r.token_ids, r.logprobs) for r in group], eng.cache_stats()["prefill_computed"]

    (got, computed), (want, computed_off) = run(True), run(False)
    assert [g[0] for g in got] == [w[0] for w in want] and all(len(g[0]) == 6 for g in got)
    for g, w in zip(got, want):
        assert g[1] == pytest.approx(w[1], abs=1e-5)
    assert computed == N + (N - 48) and computed_off == N + (K - 1) * (N - 16)
