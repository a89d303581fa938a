"""The engine's public sequence API (begin / step / pause / resume / release / abort), admission
after a prefix hit in a tight pool, and preemption by recompute when decoding overflows the pool."""
import pytest
import torch

from megak3.inference import Engine, InferenceError, SamplingParams
from test_inference_decode import small_model


@pytest.fixture(scope="module")
def model():
    return small_model("plain", seed=7)


def _ids(n, seed):
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_handles_step_pause_resume_release(model):
    eng = Engine(model, page_size=4, checkpoint_interval=8, prefill_chunk=8, num_pages=400)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    want = eng.generate([_ids(11, 1), _ids(6, 2)], sp)
    a, b = eng.begin(_ids(11, 1), sp), eng.begin(_ids(6, 2), sp)
    assert a.id != b.id and eng.live() == [a, b]
    got = {a.id: [], b.id: []}
    for h, tok, _ in eng.step():
        got[h.id].append(tok)
    eng.pause(b)
    with pytest.raises(InferenceError, match="paused"):
        eng.step([b])
    while not a.finished:                       # b is left out of step() while paused
        for h, tok, _ in eng.step():
            assert h is a
            got[a.id].append(tok)
    eng.resume(b)
    while not b.finished:
        for h, tok, _ in eng.step([b]):
            got[b.id].append(tok)
    assert got[a.id] == want[0].token_ids and got[b.id] == want[1].token_ids
    assert eng.completion(b).logprobs == pytest.approx(want[1].logprobs, abs=1e-6)
    assert eng.live() == [] and eng.cache.seqs == {}
    # abort frees an unfinished sequence; handles of another engine are refused
    c = eng.begin(_ids(9, 3), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step([c])
    assert c.admitted and c.id in eng.cache.seqs
    eng.abort(c)
    assert c.finish_reason == "abort" and c.id not in eng.cache.seqs and eng.live() == []
    d = eng.begin(_ids(9, 3), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step([d])
    eng.release(d)
    assert eng.live() == [] and eng.cache.seqs == {}
    with pytest.raises(InferenceError, match="released"):
        eng.step([d])
    other = Engine(model, page_size=4, checkpoint_interval=8, num_pages=100)
    with pytest.raises(InferenceError, match="this engine"):
        other.release(a)


def test_closing_a_stream_frees_its_sequence(model):
    eng = Engine(model, page_size=4, checkpoint_interval=8, prefill_chunk=8, num_pages=400)
    it = eng.stream(_ids(10, 4), SamplingParams(max_tokens=30, ignore_eos=True))
    next(it), next(it)
    it.close()                                  # a disconnected client
    assert eng.live() == [] and eng.cache.seqs == {} and eng.cache.reserved == 0


def test_tight_pool_after_a_prefix_hit_serves_what_a_cold_engine_serves(model):
    # issue 36: 40 pages of 16 tokens; a cached prefix with its KDA checkpoint (9 pages) would be
    # pinned by the hit; before, CacheManager.begin raised next to the running 420-token prompt
    opts = dict(page_size=16, checkpoint_interval=64, num_pages=40, prefill_chunk=64)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    long, short = _ids(420, 1), _ids(100, 2)
    eng = Engine(model, **opts)
    eng.generate([short[:90] + [5] * 10], sp)   # caches short's first 90 tokens (checkpoint at 64)
    got = eng.generate([long, short], sp)
    want = Engine(model, **opts).generate([long, short], sp)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert eng.cache.seqs == {} and eng.cache.reserved == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overflowing_the_pool_mid_decode_preempts_and_recomputes_exactly(model, temperature):
    # 4 sequences of 12-15 + 24 tokens need 9-10 pages of 4 tokens each at the end, > 24 pages
    # together: decoding runs out, the newest is preempted, recomputed, and continues
    opts = dict(page_size=4, checkpoint_interval=16, prefill_chunk=16)
    prompts = [_ids(12 + i, 10 + i) for i in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    eng = Engine(model, num_pages=24, **opts)
    got = eng.generate(prompts, params)
    assert eng.preemptions > 0
    for p, sp, g in zip(prompts, params, got):
        alone = Engine(model, num_pages=400, **opts).generate([p], sp)[0]
        assert g.token_ids == alone.token_ids and len(g.token_ids) == 24
        assert g.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert eng.cache.seqs == {} and eng.cache.reserved == 0


def test_generate_with_images_equals_the_training_forward_and_salts_the_cache():
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model
    from parallel.testing import PARITY_MODEL

    model = build_model(load_model_config("k3_tiny", **{**PARITY_MODEL, "vision.enabled": True}), seed=0).eval()
    imgs = [torch.randn(3, 56, 56, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    media = model.config.media_placeholder_token_id
    ids = [5, 6, 7] + [media] * model.vision.num_tokens(56, 56) + list(range(10, 30))
    eng = Engine(model, page_size=8, checkpoint_interval=8, prefill_chunk=16, num_pages=400)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for img in imgs:
        got = eng.generate([ids], sp, images=[[img]])[0]
        seq = list(ids)
        with torch.no_grad():
            for _ in range(4):   # full-recompute greedy loop over the training forward
                seq.append(int(model(torch.tensor([seq]), images=[img]).logits[0, -1].argmax()))
        assert got.token_ids == seq[len(ids):]
        assert eng.cache.stats["hits"] == 0   # the second image's prompt does not hit the first's blocks
    again = eng.generate([ids + [40]], sp, images=[[imgs[0]]])[0]
    assert eng.cache.stats["hits"] == 1 and len(again.token_ids) == 4
    with pytest.raises(InferenceError, match="images"):
        eng.generate([ids, ids], sp, images=[[imgs[0]]])


def test_bf16_page_pool_bound_and_exact_fp32_checkpoints(model):
    p = _ids(60, 3)
    with torch.no_grad():
        ref = model(torch.tensor([p])).logits[0, -1]
    opts = dict(page_size=8, checkpoint_interval=16, prefill_chunk=16, num_pages=400)
    f32, b16 = Engine(model, cache_dtype="float32", **opts), Engine(model, cache_dtype="bfloat16", **opts)
    assert b16.runner.pool.dtype == torch.bfloat16 and b16.runner.page_bytes * 2 == f32.runner.page_bytes
    a, b = f32.next_logits([p])[0], b16.next_logits([p])[0]
    gap = float((b - a).abs().max() / a.abs().max())
    print(f"bf16 vs fp32 page pool: next-token logits differ by {gap:.2e} of the largest logit")
    assert 0 < gap <= 1e-3 and float((a - ref).abs().max() / ref.abs().max()) <= 1e-5
    # KDA checkpoints are fp32 words stored bit for bit in the bf16 pool
    st = b16.runner.new_state()
    g = torch.Generator().manual_seed(0)
    for t in st.S + st.tails:
        t.copy_(torch.randn(t.shape, generator=g))
    pages = list(range(b16.runner.checkpoint_pages))
    b16.runner.save_state(st, pages)
    back = b16.runner.load_state(pages)
    assert all(torch.equal(x, y) for x, y in zip(st.S + st.tails, back.S + back.tails))
    # a bf16 model gets a bf16 pool by default
    assert Engine(small_model("plain", seed=7).to(torch.bfloat16), **opts).runner.pool.dtype == torch.bfloat16
    with pytest.raises(InferenceError, match="cache.dtype"):
        Engine(model, cache_dtype="int8", **opts)


def test_a_lone_sequence_completes_in_a_pool_that_fits_it_alone(model):
    # a checkpoint is 67 pages of 2 tokens here: neither its own checkpoints nor a restored one (pinned
    # by the hit) may keep a sequence of 21 pages from growing in an 80-page pool
    opts = dict(page_size=2, checkpoint_interval=8, prefill_chunk=8)
    p = _ids(12, 0)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    want = Engine(model, num_pages=400, **opts).generate([p], sp)[0]
    eng = Engine(model, num_pages=80, **opts)
    assert eng.runner.checkpoint_pages == 67
    assert eng.generate([p], sp)[0].token_ids == want.token_ids
    eng = Engine(model, num_pages=80, **opts)
    eng.generate([p], SamplingParams(max_tokens=1))                  # caches the checkpoint at 8
    assert eng.cache.stats["checkpoints"] == 1
    got = eng.generate([p], sp)[0]                                     # hits it, then outgrows it
    assert eng.cache.stats["hits"] == 1 and eng.cache.stats["evicted_checkpoints"] >= 1
    assert got.token_ids == want.token_ids


def _processed_logprobs(logits_V, temperature, top_k, top_p):
    """The distribution sampled, written out by hand: logits / T, the top_k kept, then the smallest set
    of most likely tokens reaching top_p kept, renormalised."""
    z = logits_V.double() / temperature
    z = torch.where(z >= z.topk(top_k).values[-1], z, torch.tensor(float("-inf"), dtype=z.dtype))
    p = torch.softmax(z, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        keep[i] = True
        mass += float(p[i])
        if mass >= top_p:
            break
    return torch.log_softmax(torch.where(keep, z, torch.tensor(float("-inf"), dtype=z.dtype)), -1)


def test_top_logprobs_come_from_the_sampled_distribution(model):
    """SamplingParams.top_logprobs: per token, the k most likely (id, logprob) of the distribution the
    token was drawn from, equal to the training forward's (greedy: its log_softmax, which is also
    what the server used to compute with one next_logits prefill per prefix)."""
    eng = Engine(model, page_size=4, checkpoint_interval=8, prefill_chunk=8, num_pages=400)
    prompt = _ids(9, 5)
    greedy = eng.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, top_logprobs=4))[0]
    assert len(greedy.top_logprobs) == 5
    old = eng.next_logits([prompt + greedy.token_ids[:i] for i in range(5)])   # the old O(len^2) way
    for row, got in zip(torch.log_softmax(old, -1), greedy.top_logprobs):
        v, i = row.topk(4)
        assert [t for t, _ in got] == i.tolist() and [x for _, x in got] == pytest.approx(v.tolist(), abs=1e-5)
    sp = dict(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=6, top_p=0.9, seed=3)
    plain = eng.generate([prompt], SamplingParams(**sp))[0]
    c = eng.generate([prompt], SamplingParams(**sp, top_logprobs=8))[0]
    assert plain.top_logprobs is None and c.token_ids == plain.token_ids   # asking changes no token
    with torch.no_grad():
        logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
    for k, (row, got) in enumerate(zip(logits, c.top_logprobs)):
        ref = _processed_logprobs(row, 0.8, 6, 0.9)
        kept = int(torch.isfinite(ref).sum())
        v, i = ref.topk(kept)
        assert len(got) == kept <= 6 and [t for t, _ in got] == i.tolist()   # truncated tokens not listed
        assert [x for _, x in got] == pytest.approx(v.tolist(), abs=1e-4)
        assert c.logprobs[k] == pytest.approx(float(ref[c.token_ids[k]]), abs=1e-4)
    with pytest.raises(InferenceError, match="top_logprobs"):
        eng.begin(prompt, SamplingParams(top_logprobs=-1))


@pytest.mark.parametrize("num_pages", [400, 40])
def test_twins_take_the_prefill_chunk_and_change_no_output(model, num_pages, monkeypatch):
    # three samples of a 3-chunk prompt (KDA checkpoints at 16 and 32), two of a 1-chunk one, and a
    # lone prompt; the reference computes every chunk itself (no twins). 40 pages of 4 tokens: the
    # pool overflows while decoding and twins are preempted and recomputed
    # (share_prompts=False: no prompt holds, tests/test_prompt_holds.py, so the samples prefill together)
    opts = dict(page_size=4, checkpoint_interval=16, prefill_chunk=16, num_pages=num_pages, share_prompts=False)
    prompts = [_ids(40, 1)] * 3 + [_ids(9, 2)] * 2 + [_ids(12, 3)]
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True, top_logprobs=2)
              for i in range(len(prompts))]

    def run(engine):
        hs = [engine.begin(p, sp) for p, sp in zip(prompts, params)]
        for _ in range(3):
            engine.step(hs)
        for h in hs:                        # paused and resumed with chunks still held (as partial rollouts do)
            engine.pause(h)
        for h in hs:
            engine.resume(h)
        while any(not h.finished for h in hs):
            engine.step(hs)
        return [engine.completion(h) for h in hs], engine.cache_stats()

    got, stats = run(Engine(model, **opts))
    monkeypatch.setattr(Engine, "_twins", lambda self, h, others: [])
    want, ref = run(Engine(model, **opts))
    for g, w in zip(got, want):
        assert (g.token_ids, g.logprobs, g.top_logprobs) == (w.token_ids, w.logprobs, w.top_logprobs)
    assert ref.pop("prefill_shared") == 0
    shared = stats.pop("prefill_shared")
    assert stats.pop("prefill_computed") + shared == ref.pop("prefill_computed")
    assert stats == ref
    if num_pages == 400:
        assert shared == 2 * 16 + 9 and stats["preemptions"] == 0   # the first chunk of the 40-token prompt
    else:
        assert shared > 0 and stats["preemptions"] > 0
