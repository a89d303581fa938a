"""The KDA-aware prefix cache: hits at every boundary are exact, host tier round trips, and the
manager's bookkeeping (pinning, leaf-first LRU, checkpoints that live and die with their block,
deepest-checkpoint lookup, the 'last' policy)."""
import pytest
import torch

from megak3.inference import Engine, InferenceError, SamplingParams
from megak3.inference.cache import CacheConfig, CacheManager, chain_hashes
from test_inference_decode import REL, rel_err, small_model


@pytest.fixture(scope="module")
def model():
    return small_model("plain", seed=7)


def _ids(n, seed):
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_hit_at_every_boundary_equals_cold_prefill(model):
    eng = Engine(model, page_size=4, checkpoint_interval=4, prefill_chunk=8, num_pages=2000)
    cold = Engine(model, page_size=4, checkpoint_mode="none", prefill_chunk=64, num_pages=400)
    base = _ids(41, 1)
    eng.generate([base], SamplingParams(max_tokens=1))          # checkpoints at 4, 8, ..., 40
    for b in range(4, 41, 4):
        suffix = _ids(3 + b % 5, 100 + b)
        suffix[0] = (base[b] + 1) % 512 if b < len(base) else suffix[0]
        before = eng.cache.stats["hit_tokens"]
        got = eng.next_logits([base[:b] + suffix])[0]
        assert eng.cache.stats["hit_tokens"] - before == b     # restored exactly up to b
        want = cold.next_logits([base[:b] + suffix])[0]
        with torch.no_grad():
            ref = model(torch.tensor([base[:b] + suffix])).logits[0, -1]
        assert rel_err(got, want) <= REL and rel_err(got, ref) <= REL, b
    # a decode continuing after a hit also matches the training forward
    p = base[:20] + [9, 9, 9]
    out = eng.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    seq = p + out.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
    want = [float(lp[len(p) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(out.logprobs, want)) <= 1e-5
    assert all(t == int(lp[len(p) - 1 + i].argmax()) for i, t in enumerate(out.token_ids))


def test_host_tier_write_back_and_prefetch(model):
    # a checkpoint is 34 pages here: later prompts push the first one's entries to the host
    eng = Engine(model, page_size=4, checkpoint_interval=8, prefill_chunk=8, num_pages=120, host_pages=1000)
    a = _ids(30, 2)
    eng.generate([a], SamplingParams(max_tokens=1))
    for s in range(3, 6):
        eng.generate([_ids(30, s)], SamplingParams(max_tokens=1))
    st = eng.cache.stats
    assert st["written_back"] > 0
    hits, pre = st["hit_tokens"], st["prefetched"]
    got = eng.next_logits([a + [7, 7]])[0]
    assert eng.cache.stats["prefetched"] > pre and eng.cache.stats["hit_tokens"] - hits == 24
    with torch.no_grad():
        ref = model(torch.tensor([a + [7, 7]])).logits[0, -1]
    assert rel_err(got, ref) <= REL
    # without a host tier the evicted prefix is simply recomputed, still exact
    eng2 = Engine(model, page_size=4, checkpoint_interval=8, prefill_chunk=8, num_pages=120)
    eng2.generate([a], SamplingParams(max_tokens=1))
    for s in range(3, 6):
        eng2.generate([_ids(30, s)], SamplingParams(max_tokens=1))
    assert rel_err(eng2.next_logits([a + [7, 7]])[0], ref) <= REL


# ------------------------------------------------------------------------- manager bookkeeping
def _mgr(num_pages=32, ckpt_pages=2, **kw):
    return CacheManager(CacheConfig(page_size=4, num_pages=num_pages, checkpoint_interval=8, **kw), ckpt_pages)


def _run(m, sid, ids, max_new=0):
    """Pretend to prefill ``ids``: pages, block registration, checkpoints at every boundary."""
    hit = m.begin(sid, ids, max_new)
    m.grow(sid, len(ids))
    for n in range(hit.tokens + 1, len(ids) + 1):
        m.commit(sid, ids, n)
        if m.wants_checkpoint(sid, n):
            m.checkpoint_pages(sid, n)
    return hit


def test_lookup_restores_deepest_checkpoint_below_match():
    m = _mgr()
    ids = list(range(100, 130))            # 30 tokens: blocks 0..6, checkpoints at 8, 16, 24
    _run(m, 1, ids)
    m.finish(1)
    assert _run(m, 2, ids[:23] + [1, 2]).tokens == 16   # match 5 blocks (20 tokens): deepest ckpt 16
    m.finish(2)
    assert _run(m, 3, ids[:25]).tokens == 24             # the last token is always computed
    m.finish(3)
    assert _run(m, 4, ids[:24]).tokens == 16
    m.finish(4)
    assert _run(m, 5, [1] + ids[1:]).tokens == 0         # chained hashes: a changed first token misses


def test_pinned_blocks_survive_and_lru_evicts_leaves_first():
    m = _mgr(num_pages=14)
    a = list(range(100, 117))              # 4 full blocks + 1 token, checkpoints at 8 and 16
    _run(m, 1, a)                          # running: 5 pages + 2 checkpoints (4 pages) pinned
    # 5 free + the superseded checkpoint at 8 (2 pages; its block stays) can be promised, no more:
    assert m.begin(2, list(range(300, 332)), 0) is None   # 8 pages: the pinned blocks are not evictable
    assert 2 not in m.seqs and m.reserved == 0           # nothing held: the caller waits or preempts
    m.finish(1)
    hashes = chain_hashes(a, 4)
    assert all(h in m.entries for h in hashes)
    _run(m, 3, list(range(300, 320)))      # 5 pages + 2 checkpoints: the interior checkpoint goes
    m.finish(3)                            # first, then entries from the leaf end
    kept = [h in m.entries for h in hashes]
    assert kept == sorted(kept, reverse=True) and kept[0] and not kept[-1], kept
    assert m.entries[hashes[1]].ckpt is None and m.stats["evicted_checkpoints"] == 1


def test_restored_checkpoint_is_a_branch_point_and_stays():
    m = _mgr(num_pages=20)
    a = list(range(100, 125))              # checkpoints at 8, 16, 24; 8 and 16 superseded
    _run(m, 1, a)
    m.finish(1)
    h = chain_hashes(a, 4)
    assert list(m.interior) == [h[1], h[3]]
    assert _run(m, 2, a[:16] + [1, 2, 3]).tokens == 16   # a branch restores 16: no longer interior
    assert list(m.interior) == [h[1]]


def test_checkpoint_lives_and_dies_with_its_block():
    m = _mgr(num_pages=12, host_pages=0)
    a = list(range(100, 117))
    _run(m, 1, a)
    m.finish(1)
    h16 = chain_hashes(a, 4)[3]
    assert m.entries[h16].ckpt is not None
    _run(m, 2, list(range(300, 320)))      # forces evictions of leaf entries
    assert h16 not in m.entries            # block and checkpoint gone together: no orphan state
    used = {p for e in m.entries.values() for p in [e.page] + list(e.ckpt or [])}
    assert len(used) + len(m.free) + len(m.seqs[2].private) == 12


def test_last_boundary_policy_keeps_one_checkpoint_per_prompt():
    m = _mgr(checkpoint_mode="last")
    ids = list(range(100, 130))
    _run(m, 1, ids)
    assert m.stats["checkpoints"] == 1     # only at 24 = last boundary <= 29
    m.finish(1)
    assert _run(m, 2, ids[:20] + [5, 5, 5, 5, 5]).tokens == 0   # diverges before 24: no hit
