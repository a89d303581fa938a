"""Shared fixtures: a small real corpus turned into an indexed dataset, and a fast k3_tiny variant."""
import os

import pytest
import torch

from parallel.testing import PARITY_MODEL

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)  # xdist runs one worker per core

@pytest.fixture(autouse=True)
def no_leaked_process_group():
    """A test that leaves a default process group alive in the pytest process fails (in its teardown),
    and the group is destroyed so the tests after it start clean."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        dist.destroy_process_group()
        pytest.fail(f"this test left a torch.distributed process group ({backend}) alive; destroy it "
                    "(parallel.state.destroy_parallel or dist.destroy_process_group) in a finally block")


# The parity model (k3_tiny's structure at tiny widths) with 2 heads: trains in milliseconds.
SMALL_MODEL = {**PARITY_MODEL, "kda.num_heads": 2, "mla.num_heads": 2}


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
