"""Checkpoints, one module per role:

    atomic        staging dirs, fsync, rename, the ``latest`` pointer, retention, validation, find_latest
    safe          safe_load / safe_dumps / UnsafeCheckpointError (tensors, plain containers, JSON only)
    shard_format  the per-shard format's file names and on-disk layout
    writer        ShardedCheckpointer: every rank writes its own boxes, rank 0 commits (sync or async)
    reader        CheckpointReader: any layout reads only the bytes of its boxes
    key_index     the per-group index parts (metadata read per rank is O(its own keys))
    legacy        the older formats (state.pt + per-rank parts), kept to read and convert them
    train_state   TrainCheckpoint: model + ZeRO-1 optimizer + step/data state <-> the store
    dcp           lossless conversion to and from torch.distributed.checkpoint (``python -m
                  megak3.checkpoint.convert``)
"""
