"""RL with the in-process engine: engine vs trainer logprobs of the same tokens (fp32, with and without
QAT; the bf16 gap printed), pause/resume token identity, partial-rollout iterations (versions, budgets)."""
import pytest
import torch

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.data.config import DataConfig
from megak3.data.tokenizer import load_tokenizer
from megak3.inference import SamplingParams
from megak3.optim.config import OptimConfig
from megak3.posttrain.buffer import RolloutBuffer
from megak3.posttrain.engines import RolloutConfig
from megak3.data.demo_sft import build_demo_sft_dataset
from megak3.posttrain.objective import token_logprobs
from megak3.posttrain.rl import RLConfig, RLRunner, response_batch
from megak3.posttrain.rollout import PartialRollouts
from megak3.quant.config import QuantConfig
from megak3.job.config import JobConfig, TrainConfig

ENGINE = {"page_size": 8, "num_pages": 256, "prefill_chunk": 4, "checkpoint_interval": 8}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    _, path = build_demo_sft_dataset(tmp_path_factory.mktemp("sft"), vocab_size=512, num_conversations=400,
                                     progress=False)
    return load_tokenizer(path)


def make_job(qat="none", seed=3):
    return JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                     optim=OptimConfig(lr=3e-3, warmup_steps=0), quant=QuantConfig(qat=qat),
                     train=TrainConfig(max_steps=4, global_batch_size=1, micro_batch_size=1, seed=seed)).validate()


def trainer_logprobs(runner, samples):
    mb = response_batch(samples, runner.tokenizer.pad_id)
    with torch.no_grad():
        out = runner.model(mb["input_ids"], cu_seqlens=mb["cu_seqlens"], return_logits=True)
    lp = token_logprobs(out.logits, mb["targets"])
    m = mb["mask"].bool()
    return lp[m], mb["behaviour"][m]


@pytest.mark.parametrize("qat", ["none", "mxfp4_experts"])
def test_engine_and_trainer_logprobs_agree_fp32(tok, qat):
    rl = RLConfig(prompts=3, group_size=2, max_tokens=6, temperature=1.0)
    runner = RLRunner(make_job(qat), rl, tok, engine_options=ENGINE)
    runner.generate()
    samples = [r for g in runner.buffer.take_trainable() for r in g]
    assert len(samples) == 6
    ours, engine = trainer_logprobs(runner, samples)
    gap = float((ours - engine).abs().max())
    print(f"engine vs trainer logprobs, fp32, qat={qat}: max |delta| = {gap:.2e} over {ours.numel()} tokens")
    assert gap <= 1e-5


def test_tempered_behaviour_logprobs_equal_the_trainers(tok):
    # issue 35: the engine samples from softmax(logits / T); its recorded behaviour logprob and the
    # trainer's logprob (ratio and staleness weights) must both be that distribution's
    T = 0.5
    runner = RLRunner(make_job(), RLConfig(prompts=2, group_size=2, max_tokens=6, temperature=T), tok,
                      engine_options=ENGINE)
    runner.generate()
    samples = [r for g in runner.buffer.take_trainable() for r in g]
    mb = response_batch(samples, runner.tokenizer.pad_id)
    with torch.no_grad():
        logits = runner.model(mb["input_ids"], cu_seqlens=mb["cu_seqlens"], return_logits=True).logits
        want = torch.log_softmax(logits.float() / T, -1).gather(-1, mb["targets"].clamp_min(0)[..., None])[..., 0]
        ours = runner._logp(runner.model, mb)[0]
    m = mb["mask"].bool()
    behaviour_gap = float((mb["behaviour"][m] - want[m]).abs().max())
    trainer_gap = float((ours[m] - want[m]).abs().max())
    print(f"T={T}: behaviour vs tempered forward {behaviour_gap:.2e}, trainer vs tempered forward {trainer_gap:.2e}")
    assert behaviour_gap <= 1e-5 and trainer_gap <= 1e-5
    untempered = torch.log_softmax(logits.float(), -1).gather(-1, mb["targets"].clamp_min(0)[..., None])[..., 0]
    assert float((mb["behaviour"][m] - untempered[m]).abs().max()) > 1e-2   # the test can tell them apart


def test_bf16_engine_gap_is_reported(tok):
    rl = RLConfig(prompts=2, group_size=2, max_tokens=6, engine_dtype="bfloat16")
    runner = RLRunner(make_job(), rl, tok, engine_options=ENGINE)
    runner.generate()
    samples = [r for g in runner.buffer.take_trainable() for r in g]
    ours, engine = trainer_logprobs(runner, samples)
    gap = float((ours - engine).abs().max())
    print(f"engine (bf16) vs trainer (fp32) logprobs: max |delta| = {gap:.3e}, mean {float((ours - engine).abs().mean()):.3e}")
    assert 0 < gap < 1.0


@pytest.mark.parametrize("pause_steps", [1, 4])  # 1: paused inside the prompt's prefill; 4: while decoding
def test_paused_and_resumed_sample_is_token_identical(tok, pause_steps):
    runner = RLRunner(make_job(), RLConfig(), tok, engine_options=ENGINE)
    eng = runner.engine
    prompt = [tok.bos_id] + tok.encode("user\nWhat is 3 + 4?") + [tok.eos_id, tok.bos_id] + tok.encode("assistant\n")
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)

    def fresh():
        buf = RolloutBuffer(2)
        return buf.add_prompt(prompt, budget=10)  # two samples: batch mates of each other

    straight = fresh()
    PartialRollouts(eng, params, seed=5).run(straight, version=0)
    paused = fresh()
    sampler = PartialRollouts(eng, params, seed=5)
    sampler.run(paused, version=0, max_steps=pause_steps)
    assert not any(r.finished for r in paused) and len(sampler.live) == 2
    assert all(len(r.token_ids) < 10 for r in paused)
    used = eng.cache.used_pages() if callable(getattr(eng.cache, "used_pages", None)) else None
    other = RolloutBuffer(1).add_prompt(prompt[:5], budget=3)  # unrelated work while they are paused
    PartialRollouts(eng, params, seed=9).run(other, version=0)
    sampler.run(paused, version=0)
    for a, b in zip(straight, paused):
        assert a.finished and b.finished and len(a.token_ids) == 10
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert used is None or used > 0


def test_rollouts_of_two_buffers_share_one_sampler(tok):
    # issue 35: both buffers number their uids from 0; PartialRollouts used to key its samples by uid
    # and crashed with "TypeError: 'NoneType' object is not subscriptable"
    runner = RLRunner(make_job(), RLConfig(), tok, engine_options=ENGINE)
    prompt = [tok.bos_id] + tok.encode("user\nWhat is 2 + 5?") + [tok.eos_id, tok.bos_id] + tok.encode("assistant\n")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a, b = RolloutBuffer(2).add_prompt(prompt, budget=6), RolloutBuffer(2).add_prompt(prompt[:-2], budget=6)
    assert [r.uid for r in a] == [r.uid for r in b]
    sampler = PartialRollouts(runner.engine, params)
    assert sampler.run(a + b, version=0) == 4
    want = runner.engine.generate([prompt, prompt[:-2]], params)
    assert all(r.finished for r in a + b) and sampler.live == {}
    assert [r.token_ids for r in (a[0], b[0])] == [w.token_ids for w in want]


def test_partial_rollout_iterations_record_versions_and_keep_budgets(tok):
    rl = RLConfig(prompts=3, group_size=2, max_tokens=12, temperature=1.0, partial_fraction=0.5, iterations=3)
    runner = RLRunner(make_job(), rl, tok, engine_options=ENGINE)
    seen_mixed = False
    orig = runner.update

    def check(samples, adv):
        nonlocal seen_mixed
        for r in samples:
            assert r.finished and len(r.token_ids) <= r.budget == 12
            assert len(r.versions) == len(r.token_ids) == len(r.logprobs)
            assert r.versions == sorted(r.versions) and r.versions[-1] <= runner.version
            seen_mixed |= len(set(r.versions)) > 1
        return orig(samples, adv)

    runner.update = check
    hist = runner.fit(log=None)
    assert any(h.get("paused", 0) > 0 for h in hist)
    assert runner.version >= 1 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist if "loss" in h)
    # the engine runs the trainer's current weights after every refit
    for (n, p), q in zip(runner.model.state_dict().items(), runner.engine.model.state_dict().values()):
        assert torch.equal(p, q), n
    assert seen_mixed  # a sample paused under one version finished under the next


def test_mopd_update_uses_the_teachers_per_token_reward(tok):
    from megak3.model.k3 import build_model

    rl = RLConfig(prompts=2, group_size=2, max_tokens=5, micro_batch_size=8)
    runner = RLRunner(make_job(), rl, tok, engine_options=ENGINE)
    runner.generate()
    samples = [r for g in runner.buffer.take_trainable() for r in g]
    teacher = build_model(runner.job.model, seed=11).eval()  # another policy
    runner.teachers = [teacher]
    mb = response_batch(samples, tok.pad_id)
    with torch.no_grad():
        lt = token_logprobs(teacher(mb["input_ids"], cu_seqlens=mb["cu_seqlens"], return_logits=True).logits,
                            mb["targets"])
        ls = token_logprobs(runner.model(mb["input_ids"], cu_seqlens=mb["cu_seqlens"], return_logits=True).logits,
                            mb["targets"])
    m = mb["mask"].bool()
    want = -float((lt - ls).clamp(-1, 1)[m].mean())  # ratio 1 on the first step: loss = -mean r_t
    rec = runner.update(samples, torch.zeros(len(samples)))
    assert abs(rec["loss"] - want) < 1e-5 and rec["grad_norm"] > 0
    runner.teachers = [runner.model]  # the policy as its own teacher: zero reward, zero gradient
    assert runner.update(samples, torch.zeros(len(samples)))["grad_norm"] == 0


@pytest.mark.parametrize("bound,lag", [(0, 0), (1, 0), (1, 1)])
def test_max_staleness_bounds_how_old_a_trained_token_is(tok, bound, lag):
    """rl.update_groups=1 updates as soon as one group is whole; a long group (budget 24) then lags behind short
    ones (budget 2) over several updates. With rl.max_staleness=1 no trained token is more than 1 version older
    than the policy it updates; without the bound (the control) one is. At rl.rollout.lag=1 (each batch generated
    one version ahead of its update) the bound counts the lag in: max_staleness=1 holds."""
    import itertools

    budgets = itertools.cycle([[24, 24], [2, 2], [2, 2], [2, 2]])
    rl = RLConfig(prompts=3, group_size=2, max_tokens=24, temperature=1.0, ignore_eos=True, update_groups=1,
                  max_staleness=bound, iterations=5, micro_batch_size=8, rollout=RolloutConfig(lag=lag))
    runner = RLRunner(make_job(), rl, tok, engine_options=ENGINE, budgets=lambda: next(budgets))
    worst = []
    orig = runner.update

    def check(samples, adv):
        worst.append(max(runner.version - min(v for v in r.versions if v >= 0) for r in samples))
        return orig(samples, adv)

    runner.update = check
    runner.fit(log=None)
    print(f"max_staleness={bound} lag={lag}: staleness of the oldest trained token per update {worst}")
    if bound:
        assert max(worst) <= bound
    else:
        assert max(worst) >= 2          # the control: without the bound the long group lags further


def test_length_sorted_micro_batches_pad_less_and_update_alike(tok, monkeypatch):
    """A long-tailed update (budgets 24 and 2, micro-batches of 2): cut from length-sorted samples it pads
    fewer tokens than cut in buffer order (the reference: the sort turned off) and gives the same loss
    and grad norm, from the same initial weights."""
    import itertools

    from megak3.posttrain import update as upd

    budgets = itertools.cycle([[24, 2], [2, 24], [2, 2]])
    rl = RLConfig(prompts=3, group_size=2, max_tokens=24, temperature=1.0, ignore_eos=True, micro_batch_size=2)
    runners = [RLRunner(make_job(), rl, tok, engine_options=ENGINE, budgets=lambda: next(budgets)) for _ in range(2)]
    runners[0].generate()
    samples = [r for g in runners[0].buffer.take_trainable() for r in g]
    adv = torch.linspace(-1, 1, len(samples))
    padded, built = [], upd.response_batch

    def counted(part, *a, **k):
        mb = built(part, *a, **k)
        padded[-1] += mb["input_ids"].numel()
        return mb

    monkeypatch.setattr(upd, "response_batch", counted)
    out = []
    for i, runner in enumerate(runners):
        if i == 1:
            monkeypatch.setattr(upd, "by_length", lambda s, a: (s, a))
        padded.append(0)
        out.append(runner.update(samples, adv))
    (sorted_, plain), (p_sorted, p_plain) = out, padded
    print(f"padded tokens: length-sorted {p_sorted}, buffer order {p_plain}")
    assert p_sorted < p_plain
    assert abs(sorted_["loss"] - plain["loss"]) <= 1e-6 and abs(sorted_["grad_norm"] - plain["grad_norm"]) <= 1e-5
