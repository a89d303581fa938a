"""Data pipeline: text -> byte-level BPE -> indexed dataset (.bin/.idx) -> packed, resumable batches.

Typical use (see docs/INTERFACES.md for the batch contract)::

    prefix, tok_path = resolve_dataset(DataConfig(path="demo"))
    train = PackedDataset(IndexedDataset(prefix), seq_len=256, split="train")
    for batch in Batcher(train, micro_batch_size=8):   # input_ids, labels, cu_seqlens, num_tokens
        ...
"""
from megak3.data.config import DataConfig, default_cache_dir, resolve_dataset
from megak3.data.demo import build_demo_dataset, demo_files
from megak3.data.errors import DataError
from megak3.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megak3.data.packing import IGNORE_INDEX, Batcher, PackedDataset, Sample, collate, split_documents
from megak3.data.preprocessing import collect_input_files, format_stats, preprocess, read_documents
from megak3.data.tokenizer import SPECIAL_TOKENS, Tokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "DataConfig", "DataError", "default_cache_dir", "resolve_dataset",
    "build_demo_dataset", "demo_files",
    "IndexedDataset", "IndexedDatasetBuilder", "best_dtype",
    "IGNORE_INDEX", "Batcher", "PackedDataset", "Sample", "collate", "split_documents",
    "collect_input_files", "format_stats", "preprocess", "read_documents",
    "SPECIAL_TOKENS", "Tokenizer", "load_tokenizer", "train_bpe_tokenizer",
]
