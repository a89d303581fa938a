"""Loading for generation (megak3/inference/loading.py): trainer checkpoints of any layout (a real
tp2 x pp2 run) and Hugging Face exports (fp32, and MXFP4-packed experts from a QAT model) give the
logits of the model they came from; bad paths are one-line errors."""
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from megak3.inference import Engine, InferenceError
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry
from parallel.testing import PARITY_MODEL
from test_inference_decode import REL, rel_err, small_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import convert_hf  # noqa: E402

IDS = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9]


def _tokenizer(tmp_path):
    from megak3.data.tokenizer import train_bpe_tokenizer

    path = tmp_path / "tok" / "tokenizer.json"
    train_bpe_tokenizer(["for i in range(10):\n    print(i)\n" * 20], 300, path)
    return path


def _save(root, model, quant=None):
    ent = {f"model/{k}": ShardEntry(v.detach(), tuple(v.shape), (0,) * v.dim())
           for k, v in model.state_dict().items()}
    config = {"model": asdict(model.config), **({"quant": quant} if quant else {})}
    ShardedCheckpointer(root, 0, 1).save(3, ent, common={"step": 3}, meta={"config": config})


def _ref_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_checkpoint_and_hf_export_load_with_the_same_logits(tmp_path):
    tok = _tokenizer(tmp_path)
    model = small_model("plain", seed=2)
    _save(tmp_path / "run" / "checkpoints", model)
    eng = Engine.from_pretrained(str(tmp_path / "run"), tokenizer=str(tok))   # run dir: newest checkpoint
    assert eng.load_info["kind"] == "megak3" and eng.tokenizer.eos_id == 2
    assert torch.equal(eng.next_logits([IDS])[0], eng.next_logits([IDS])[0])
    assert rel_err(eng.next_logits([IDS])[0], _ref_logits(model)) <= REL
    hf = tmp_path / "hf"
    convert_hf.export(tmp_path / "run" / "checkpoints", hf, experts="bf16", dtype="fp32", log=lambda s: None)
    eng = Engine.from_pretrained(str(hf), tokenizer=str(tok))
    assert eng.load_info["kind"] == "hf"
    assert rel_err(eng.next_logits([IDS])[0], _ref_logits(model)) <= REL


def test_qat_checkpoint_generates_with_its_quantisation(tmp_path):
    tok = _tokenizer(tmp_path)
    model = small_model("qat", seed=2)
    _save(tmp_path / "ckpt", model, quant={"qat": "mxfp4_experts", "scale_mode": "floor", "fp8": "none"})
    step = next((tmp_path / "ckpt").glob("step_*"))
    eng = Engine.from_pretrained(str(step), tokenizer=str(tok))
    assert eng.load_info["quant"].qat == "mxfp4_experts"
    assert rel_err(eng.next_logits([IDS])[0], _ref_logits(model)) <= REL
    hf = tmp_path / "hf"
    convert_hf.export(tmp_path / "ckpt", hf, experts="mxfp4", dtype="fp32", log=lambda s: None)
    eng = Engine.from_pretrained(str(hf), tokenizer=str(tok))     # packed experts: QAT forward re-applied
    assert eng.load_info["quant"].qat == "mxfp4_experts"
    assert rel_err(eng.next_logits([IDS])[0], _ref_logits(model)) <= REL


def test_bad_paths_are_one_line(tmp_path):
    for path, needle in ((tmp_path / "nope", "no such directory"), (tmp_path, "no complete megak3 checkpoint")):
        with pytest.raises(InferenceError, match=needle) as e:
            Engine.from_pretrained(str(path))
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ a real tp2 x pp2 training run
def _job(corpus, run_dir, world, **par):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.metrics.config import LoggingConfig
    from megak3.optim.config import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig

    return JobConfig(
        model=load_model_config("k3_tiny", **PARITY_MODEL),
        data=DataConfig(path=corpus[0], tokenizer=corpus[1], seq_len=32, valid_fraction=0.1),
        optim=OptimConfig(lr=1e-3, warmup_steps=1, ns_dtype="float32"),
        train=TrainConfig(max_steps=2, global_batch_size=4, micro_batch_size=1, eval_interval=0,
                          eval_batches=1, save_interval=2, run_dir=run_dir, seed=3, device="cpu", threads=1,
                          resume="auto"),
        logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1),
        parallel=ParallelConfig(backend="gloo", timeout_s=120, **par),
    ).validate(world)


def _train(rank, world, corpus, run_dir, par):
    from megak3.train.trainer import Trainer
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = _job(corpus, run_dir, world, **par)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    config = {"model": asdict(job.model), "data": {"path": corpus[0], "tokenizer": corpus[1]},
              "quant": asdict(job.quant)}
    tr = Trainer(job, run_dir, config_dict=config, pstate=ps)
    tr.fit()
    return tr.model if world == 1 else None


@pytest.mark.slow
def test_tp2_pp2_checkpoint_loads_with_the_same_logits(corpus_dataset, tmp_path):
    from parallel.testing import run_distributed

    src = tmp_path / "src"
    run_distributed(_train, 4, corpus_dataset, str(src), {"tp": 2, "pp": 2}, timeout_s=300)
    eng = Engine.from_pretrained(str(src))                   # tokenizer found through the run's data config
    assert eng.tokenizer.vocab_size <= eng.model.config.vocab_size
    # the reference: the trainer's own resume path reads the same checkpoint into a one-process model
    one = tmp_path / "one"
    import shutil

    shutil.copytree(src / "checkpoints", one / "checkpoints")
    ref_model = _train(0, 1, corpus_dataset, str(one), {})   # resumes at step 2 == max_steps: no step
    ref_model.eval()
    ids = eng.tokenizer.encode("def main():\n    return 0\n")
    assert rel_err(eng.next_logits([ids])[0], _ref_logits(ref_model, ids)) <= REL
    out = eng.generate([ids], __import__("megak3.inference", fromlist=["SamplingParams"]).SamplingParams(
        max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and isinstance(out.text, str)
