"""Agentic RL on the ledger task family through the real loop (engine turns, sandboxed environments,
RankStep update, refit): episodes pause between iterations with their sandboxes and resume under the new
weights, their trained tokens are exactly the model's own (checked against a hand-built transcript)."""
import itertools

import pytest
import torch

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.data.config import DataConfig
from megak3.data.tokenizer import load_tokenizer
from megak3.envs import EnvPool, ToolCall
from megak3.optim.config import OptimConfig
from megak3.posttrain.agentic import AgentRunner
from megak3.posttrain.buffer import Rollout
from megak3.data.demo_sft import build_demo_sft_dataset
from megak3.posttrain.rl import RLConfig, response_batch
from megak3.job.config import JobConfig, TrainConfig

ENGINE = {"page_size": 8, "num_pages": 512, "prefill_chunk": 64, "checkpoint_interval": 8}
SHORT, LONG = 10, 400   # trajectory budgets: SHORT ends after one turn, LONG reaches the turn limit


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    _, path = build_demo_sft_dataset(tmp_path_factory.mktemp("sft"), vocab_size=512, num_conversations=200,
                                     progress=False)
    return load_tokenizer(path)


def make_job():
    return JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                     optim=OptimConfig(lr=3e-3, warmup_steps=0),
                     train=TrainConfig(max_steps=3, global_batch_size=1, micro_batch_size=1, seed=3)).validate()


def segments(mask):
    """[(value, start, end)] runs of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def check_against_transcript(tok, r: Rollout, transcript, cap):
    """The trajectory equals the chat template of the transcript built here by hand, and its mask is 1
    exactly on the tokens the model sampled."""
    assert transcript[0][0] == "env"
    assert r.prompt_ids == [tok.bos_id] + tok.encode("user\n") + tok.encode(transcript[0][1]) + [tok.eos_id] \
        + [tok.bos_id] + tok.encode("assistant\n")
    model_turns = [t for role, t in transcript if role == "model"]
    observations = [t for role, t in transcript[1:] if role == "env"]
    mask = r.mask or [1] * len(r.token_ids)          # empty: every token is the model's
    runs = segments(mask)
    assert [v for v, _, _ in runs] == [1, 0] * (len(model_turns) - 1) + [1]   # model, tool, ..., model
    for i, (v, a, b) in enumerate(runs):
        ids = r.token_ids[a:b]
        if v == 1:                                   # the model's turn: its own tokens, as the env saw them
            text = tok.decode([t for t in ids if t != tok.eos_id])
            assert text == model_turns[i // 2]
            assert all(x == r.versions[a] >= 0 for x in r.versions[a:b])
            assert all(lp <= 0 for lp in r.logprobs[a:b])
        else:                                        # the observation as a tool message + next header
            closed = r.token_ids[a - 1] == tok.eos_id
            want = ([] if closed else [tok.eos_id]) + [tok.bos_id] + tok.encode("tool\n") \
                + tok.encode(observations[i // 2])[:cap] + [tok.eos_id, tok.bos_id] + tok.encode("assistant\n")
            assert ids == want
            assert set(r.versions[a:b]) == {-1} and set(r.logprobs[a:b]) == {0.0}
    mb = response_batch([r], tok.pad_id)            # the loss mask covers exactly the model's tokens
    P = len(r.prompt_ids)
    assert mb["mask"][0, P - 1:P - 1 + len(mask)].tolist() == [float(m) for m in mask]
    assert float(mb["mask"].sum()) == sum(mask)


def test_agentic_rl_pauses_and_resumes_episodes_with_their_sandboxes(tok):
    rl = RLConfig(env="ledger", prompts=2, group_size=2, max_tokens=4, max_turns=3, obs_tokens=12,
                  partial_fraction=0.5, iterations=3, micro_batch_size=8, seed=1)
    budgets = itertools.cycle([[SHORT] * 2, [LONG] * 2])
    with EnvPool(2, limits={"wall_seconds": 20}) as pool:
        runner = AgentRunner(make_job(), rl, tok, pool=pool, engine_options=ENGINE, budgets=lambda: next(budgets))
        applied, trained = [], []
        apply, update = runner.rs.apply, runner.update

        def spy_apply(*a, **k):
            applied.append(runner.version)
            return apply(*a, **k)

        def spy_update(samples, adv):
            for r in samples:
                eid = f"ep{r.uid}"
                assert r.finished and len(r.token_ids) <= r.budget
                check_against_transcript(tok, r, runner.driver.transcripts[eid], rl.obs_tokens)
                trained.append((eid, r.finish_reason, sorted({v for v in r.versions if v >= 0})))
            return update(samples, adv)

        def stand_in_reward(groups):  # the tiny random policy never solves a ledger: the env's reward is 0.0;
            for g in groups:           # reward the first sample of each group so the update has a gradient
                for k, r in enumerate(g):
                    assert r.reward == 0.0
                    r.reward = float(k == 0)
            return score(groups)

        score = runner.score
        runner.rs.apply, runner.update, runner.score = spy_apply, spy_update, stand_in_reward
        before = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
        paused, resumed = {}, set()
        for it in range(rl.iterations):
            for eid, (digest, state) in paused.items():        # the paused sandboxes, as the test saw them
                assert pool.digest(eid) == digest and pool.state(eid) == state
            rec = runner.iteration()
            for eid, (_, state) in paused.items():            # resumed: each played at least one more turn
                if eid in runner.driver.transcripts:
                    assert sum(role == "model" for role, _ in runner.driver.transcripts[eid]) > state["turn"]
                else:                                          # or finished and was trained on already
                    assert eid in {e for e, _, _ in trained}
                resumed.add(eid)
            assert rec["episodes_resumed"] == len(paused) and rec["groups"] >= 1
            if paused:                                         # a later turn continues a cached conversation
                assert rec["prefix_hit_tokens"] > 0
            paused = {eid: (pool.digest(eid), pool.state(eid)) for eid in runner.driver.unfinished()}
            assert rec["paused"] == len(paused)
            assert all(not s["done"] and s["turn"] >= 1 for _, s in paused.values())

        assert applied == [0, 1, 2]                                # one RankStep.apply per update
        assert all(h["grad_norm"] > 0 and h["reward"] == 0.5 for h in runner.history)
        assert any(not torch.equal(p, before[n]) for n, p in runner.model.named_parameters())
        for (n, p), q in zip(runner.model.state_dict().items(), runner.engine.model.state_dict().values()):
            assert torch.equal(p, q), n                            # refit: the engine runs the new weights
        multi = [(eid, why, vs) for eid, why, vs in trained if len(vs) >= 2]
        assert multi, trained                                      # paused at a boundary, finished after it
        assert all(eid in resumed and why == "env" for eid, why, _ in multi)   # ended by the env's turn limit
        assert {why for _, why, _ in trained} == {"env", "length"}
        eid = sorted(paused)[0]                                    # a sandbox changed while paused is refused
        pool.step(eid, ToolCall("shell", {"cmd": "echo x > tampered"}))
        with pytest.raises(RuntimeError, match="changed while paused"):
            runner.iteration()
        runner.close()
        assert not runner.driver.transcripts.keys() - set(runner.driver.unfinished())   # trained ones forgotten
