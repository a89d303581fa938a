"""Generation from megak3 checkpoints: incremental decoding with a KDA-aware prefix cache.

    engine.py    Engine, SeqHandle: sequence handles, continuous batching, chunked prefill, preemption (the contract)
    handles.py   SeqHandle (one sequence's record) and PrefillChunk (a prefill result kept for its prompt's twins)
    cache.py     CacheManager: pages, prefix-hash blocks, KDA checkpoints, LRU, host tier (no tensors)
    runner.py    ModelRunner: the incremental K3 forward over the paged pool (KDA state, absorbed MLA)
    sampling.py  greedy / temperature / top-k / top-p with per-request generators
    loading.py   megak3 checkpoints of any layout and Hugging Face directories
    types.py     SamplingParams, Completion, Scored, InferenceError
    cli.py       python -m megak3.generate;  server.py  its ``serve`` command (FastAPI + uvicorn), over
                 api_models.py (schemas), service.py (OpenAI logic), engine_client.py (the engine thread: begin/step),
                 metrics.py (Prometheus), media.py (images of requests)
"""
from .cache import CacheConfig, CacheManager
from .engine import Engine, SeqHandle
from .runner import ModelRunner
from .types import Completion, InferenceError, SamplingParams, Scored

__all__ = ["Engine", "SeqHandle", "SamplingParams", "Completion", "Scored", "InferenceError", "CacheConfig",
           "CacheManager", "ModelRunner"]
