"""Shared fixtures: a small real corpus turned into an indexed dataset, and a fast k3_tiny variant."""
import os

import pytest
import torch

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)  # xdist runs one worker per core

# k3_tiny's structure (layer schedule, 3 AttnRes blocks, dense layer 0, MoE + shared, vision)
# at widths that train in milliseconds per step.
SMALL_MODEL = {
    "hidden_size": 64, "dense_intermediate_size": 128,
    "kda.num_heads": 2, "kda.head_dim": 16, "kda.gate_rank": 8, "kda.chunk_size": 16,
    "mla.num_heads": 2, "mla.q_lora_rank": 32, "mla.kv_lora_rank": 16, "mla.qk_nope_head_dim": 8,
    "mla.qk_rope_head_dim": 8, "mla.v_head_dim": 8,
    "moe.num_experts": 8, "moe.top_k": 2, "moe.expert_intermediate_size": 32, "moe.latent_size": 32,
    "vision.enabled": False, "vocab_size": 512,
}


@pytest.fixture(scope="session")
def corpus_dataset(tmp_path_factory):
    """(prefix, tokenizer.json) of 40 real stdlib sources with a 400-token BPE."""
    from megak3.data.demo import demo_files
    from megak3.data.preprocessing import preprocess

    root = tmp_path_factory.mktemp("corpus")
    src = root / "src"
    src.mkdir()
    for i, f in enumerate(demo_files()[:40]):
        (src / f"doc{i:03d}.txt").write_text(f.read_text(encoding="utf-8", errors="replace")[:6000])
    prefix = root / "ds" / "corpus"
    preprocess([src], prefix, train_tokenizer=True, vocab_size=400, workers=1, progress=False)
    return str(prefix), str(prefix.parent / "tokenizer.json")
