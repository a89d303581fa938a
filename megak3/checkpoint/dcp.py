"""torch.distributed.checkpoint (DCP) side by side with the per-shard format, and lossless conversion.

Boxes in DCP. :class:`BoxSavePlanner` saves, per key, one box ``[offsets, offsets + shape)`` of a global
tensor as a DCP chunk (``ChunkStorageMetadata``), the same boxes :class:`.writer.ShardedCheckpointer`
takes; non-tensor values are DCP bytes items. :class:`BoxLoadPlanner` reads, per key, the box a rank
holds in the current layout (DCP's ``create_read_items_for_chunk_list`` finds the overlapping saved
chunks) and loads bytes items with :func:`.safe.safe_load`. :class:`SafeFileSystemReader` reads DCP's
``.metadata`` with an unpickler that admits only DCP's metadata classes, ``torch.Size`` and dtypes (DCP
reads it with ``pickle.load``) and counts the bytes it reads. ``tools/bench_checkpoint.py --vs-dcp``
measures both formats with these.

Conversion (``python -m megak3.checkpoint.convert``). :func:`to_dcp`: every saved chunk of every key
becomes the same chunk in DCP (read one chunk at a time), the common state (``state.pt``) becomes the bytes
item ``megak3/common``, the union of the ranks' objects ``megak3/objects`` and the manifest's meta
``megak3/meta``; ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` reads the result (full
tensors under the same keys; the three dicts as values). :func:`from_dcp`: a DCP checkpoint written by
:func:`to_dcp` back to a per-shard checkpoint under a checkpoint root, every DCP chunk a box of its own (the
chunks are spread over as many writer ranks as the most-chunked key has, written one after another), the
bytes items read with the safe loader; ``train.resume`` reads it at any layout.
"""
from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import atomic
from .atomic import CheckpointError
from .reader import CheckpointReader
from .safe import safe_dumps, safe_load
from .writer import ShardedCheckpointer, ShardEntry

COMMON_KEY, OBJECTS_KEY, META_KEY = "megak3/common", "megak3/objects", "megak3/meta"
METADATA_FILE = ".metadata"
_ONE_PROCESS = "torch.distributed is disabled"  # DCP's warning when it runs without a process group
# ---------------------------------------------------------------------------------------- metadata

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in
    ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
     "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   (torch.dtype, torch.layout))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a safe ``.metadata`` unpickler; ``bytes_read`` counts the payload bytes of the
    storage items read (DCP reads each overlapping saved item whole, then narrows it), ``meta_bytes_read``
    the ``.metadata`` bytes."""

    def __init__(self, path):
        super().__init__(path)
        self.bytes_read = 0
        self.meta_bytes_read = 0

    def read_metadata(self, *args, **kwargs):
        data = (Path(self.path) / METADATA_FILE).read_bytes()
        self.meta_bytes_read += len(data)
        try:
            md = _MetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"DCP checkpoint {self.path}: {METADATA_FILE} holds objects other than DCP "
                                  f"metadata (refused; nothing in it was run): {e}") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner):
        for item in plan.items:
            self.bytes_read += self.storage_data[item.storage_index].length
        return super().read_data(plan, planner)


def read_metadata(path) -> dcp_metadata.Metadata:
    """The ``Metadata`` of the DCP checkpoint directory ``path``, unpickled safely."""
    return SafeFileSystemReader(path).read_metadata()


# ----------------------------------------------------------------------------------------- planners

class BoxSavePlanner(DefaultSavePlanner):
    """Saves ``boxes``: key -> ``(global_shape, offsets, shape, dtype, get)`` (``get()`` returns the box's
    tensor when DCP writes it) and ``objects``: key -> a value of plain containers (a DCP bytes item)."""

    def __init__(self, boxes: dict, objects: Optional[dict] = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.objects = boxes, dict(objects or {})

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, (gshape, offs, shape, dtype, _) in self.boxes.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(shape))
            items.append(WriteItem(index=MetadataIndex(key, torch.Size(offs)), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype),
                                                               size=torch.Size(gshape))))
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(safe_dumps(self.objects[key], key))
        return self.boxes[key][4]().contiguous()


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads into ``boxes``: key -> ``(offsets, out)`` (``out`` a CPU tensor of the box's shape), and the
    bytes items named in ``object_keys`` into :attr:`objects` with the safe loader."""

    def __init__(self, boxes: dict, object_keys=()):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.object_keys, self.objects = boxes, tuple(object_keys), {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for key, (offs, out) in self.boxes.items():
            if not isinstance(md.get(key), TensorStorageMetadata):
                raise CheckpointError(f"DCP checkpoint holds no tensor {key!r}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=out.shape)
            items += create_read_items_for_chunk_list(key, md[key], [chunk])
        for key in self.object_keys:
            if not isinstance(md.get(key), BytesStorageMetadata):
                raise CheckpointError(f"DCP checkpoint holds no bytes item {key!r}")
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        self.plan = LoadPlan(items)
        return self.plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self.objects[key] = safe_load(value.read(), f"{key} (DCP bytes item)")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[index.fqn][1]


def save_boxes(path, boxes: dict, objects: Optional[dict] = None, process_group=None) -> None:
    """DCP save of this rank's ``boxes`` (see :class:`BoxSavePlanner`) into ``path`` (collective over
    ``process_group`` when torch.distributed is initialised; one process otherwise)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        dcp.save({}, storage_writer=FileSystemWriter(str(path), thread_count=1),
                 planner=BoxSavePlanner(boxes, objects), process_group=process_group,
                 no_dist=not dist.is_initialized())


def load_boxes(path, boxes: dict, object_keys=(), process_group=None) -> tuple[dict, SafeFileSystemReader]:
    """DCP load of ``boxes`` (key -> ``(offsets, out)``) and the bytes items ``object_keys`` from ``path``;
    returns ``(objects, reader)`` (the reader's byte counters)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    reader = SafeFileSystemReader(str(path))
    planner = BoxLoadPlanner(boxes, object_keys)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        dcp.load({}, storage_reader=reader, planner=planner, process_group=process_group,
                 no_dist=not dist.is_initialized())
    return planner.objects, reader


# --------------------------------------------------------------------------------------- conversion

def to_dcp(src, dst) -> Path:
    """Write the per-shard checkpoint directory ``src`` as a DCP checkpoint in the new directory ``dst``
    (every saved chunk kept as a DCP chunk; common state, objects and meta as bytes items)."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty; choose a new directory")
    reader = CheckpointReader(src)
    reader.verify()
    chunks = {key: [(reader.global_shape(key), tuple(c["offsets"]), tuple(c["shape"]), reader.dtype(key))
                    for c in reader.chunks(key)] for key in reader.keys()}
    objects = {COMMON_KEY: reader.common, OBJECTS_KEY: reader.objects(), META_KEY: reader.meta}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        dcp.save({}, storage_writer=FileSystemWriter(str(dst), thread_count=1),
                 planner=_ChunksSavePlanner(reader, chunks, objects), no_dist=True)
    reader.close()
    return dst


class _ChunksSavePlanner(BoxSavePlanner):
    """One process saving several chunks per key (the chunks of a per-shard checkpoint)."""

    def __init__(self, reader: CheckpointReader, chunks: dict, objects: dict):
        super().__init__({}, objects)
        self.reader, self.chunks = reader, chunks

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, boxes in self.chunks.items():
            for gshape, offs, shape, dtype in boxes:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(shape))
                items.append(WriteItem(index=MetadataIndex(key, torch.Size(offs)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk,
                                                                   properties=TensorProperties(dtype=dtype),
                                                                   size=torch.Size(gshape))))
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        idx = write_item.index
        return self.reader.read(idx.fqn, tuple(idx.offset), tuple(write_item.tensor_data.chunk.sizes))


def from_dcp(src, out_root) -> Path:
    """Write the DCP checkpoint ``src`` (from :func:`to_dcp`) as a per-shard checkpoint of the same step
    under the checkpoint root ``out_root``; returns its directory."""
    src = Path(src)
    md = read_metadata(src)
    sdm = md.state_dict_metadata
    missing = [k for k in (COMMON_KEY, OBJECTS_KEY, META_KEY) if not isinstance(sdm.get(k), BytesStorageMetadata)]
    if missing:
        raise ValueError(f"DCP checkpoint {src} lacks {', '.join(missing)}: only checkpoints written by "
                         "python -m megak3.checkpoint.convert --to-dcp convert back")
    objs, _ = load_boxes(src, {}, (COMMON_KEY, OBJECTS_KEY, META_KEY))
    common, objects, meta = objs[COMMON_KEY], objs[OBJECTS_KEY], objs[META_KEY]
    step = common.get("step", meta.get("step"))
    if not isinstance(step, int):
        raise ValueError(f"DCP checkpoint {src}: its megak3/common holds no int step")
    out_root = Path(out_root)
    final = out_root / atomic.step_dirname(step)
    if final.exists():
        raise ValueError(f"{final} already exists; choose another out_root")
    tensors = {k: v for k, v in sdm.items() if isinstance(v, TensorStorageMetadata)}
    world = max([len(v.chunks) for v in tensors.values()] + [1])
    writers = [ShardedCheckpointer(out_root, r, world, commit_timeout_s=60.0) for r in range(world)]
    for r in list(range(1, world)) + [0]:  # rank 0 commits once every other rank's files are there
        boxes = {}
        for key, v in tensors.items():
            if r < len(v.chunks):
                c = v.chunks[r]
                boxes[key] = (tuple(c.offsets), torch.empty(tuple(c.sizes), dtype=v.properties.dtype))
        load_boxes(src, boxes)
        entries = {k: ShardEntry(out, tuple(tensors[k].size), offs) for k, (offs, out) in boxes.items()}
        writers[r].save(step, entries, objects=objects if r == 0 else None, common=common if r == 0 else None,
                        meta=meta if r == 0 else None)
    return final
