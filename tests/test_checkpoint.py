"""Atomic checkpoints: round trip, crash safety, corruption fallback, pruning, RNG restore."""
import json
import os
import random
import warnings

import numpy as np
import pytest
import torch

from megak3.checkpoint import atomic as ckpt
from megak3.checkpoint.atomic import (CheckpointError, CheckpointWarning, find_latest, list_checkpoints,
                                     validate_checkpoint)
from megak3.checkpoint.legacy import load_checkpoint, save_checkpoint
from megak3.checkpoint.train_state import capture_rng_state, restore_rng_state


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.arange(5)},
            "optim": {"step": seed, "groups": [{"lr": 0.1 * seed, "m": torch.randn(2, generator=g)}]},
            "data_position": seed * 7}


def _assert_state_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_state_equal(x, y)
    else:
        assert a == b


def _truncate_state(path):
    f = path / ckpt.STATE_FILE
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def test_round_trip_and_manifest(tmp_path):
    state = _state(3)
    path = save_checkpoint(tmp_path, 100, state, meta={"run": "t", "tokens": 12345})
    assert path == tmp_path / "step_00000100"
    assert (tmp_path / "latest").read_text().strip() == "step_00000100"
    loaded, manifest = load_checkpoint(path)
    _assert_state_equal(state, loaded)
    assert manifest["step"] == 100 and manifest["meta"] == {"run": "t", "tokens": 12345}
    assert manifest["format_version"] == ckpt.FORMAT_VERSION
    entry = manifest["files"][ckpt.STATE_FILE]
    assert entry["bytes"] == (path / ckpt.STATE_FILE).stat().st_size
    assert entry["sha256"] == ckpt._sha256_file(path / ckpt.STATE_FILE)
    assert validate_checkpoint(path) == (True, "ok")
    assert find_latest(tmp_path) == path


def test_rng_state_restore_reproduces_draws(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leave a cached gaussian in numpy's state
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    expected = (random.random(), np.random.randn(3), torch.randn(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    state, _ = load_checkpoint(find_latest(tmp_path))
    restore_rng_state(state["rng"])
    got = (random.random(), np.random.randn(3), torch.randn(3))
    assert got[0] == expected[0]
    np.testing.assert_array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])


def test_crash_before_pointer_update_keeps_old_latest(tmp_path, monkeypatch):
    first = save_checkpoint(tmp_path, 10, _state(1))
    real_replace = os.replace

    def crash_on_pointer(src, dst):
        if os.path.basename(dst) == ckpt.LATEST_NAME:
            raise OSError("simulated crash while updating latest")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_pointer)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, 20, _state(2))
    monkeypatch.setattr(os, "replace", real_replace)
    # The step dir was written completely, but the commit point (pointer) was not reached.
    assert validate_checkpoint(tmp_path / "step_00000020")[0]
    assert (tmp_path / "latest").read_text().strip() == first.name
    assert find_latest(tmp_path) == first
    _assert_state_equal(load_checkpoint(find_latest(tmp_path))[0], _state(1))


def test_crash_before_rename_leaves_stale_tmp_that_is_ignored_then_cleaned(tmp_path, monkeypatch):
    first = save_checkpoint(tmp_path, 10, _state(1))
    real_replace = os.replace

    def crash_on_dir_rename(src, dst):
        if os.path.basename(dst).startswith("step_"):
            raise OSError("simulated crash before rename")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_dir_rename)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 20, _state(2))
    monkeypatch.setattr(os, "replace", real_replace)
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(stale) == 1
    (stale[0].parent / ".tmp-step_00000030-99999").mkdir()  # a crashed save by another process
    assert list_checkpoints(tmp_path) == [first]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stale tmp dirs are not even worth a warning
        assert find_latest(tmp_path) == first
    save_checkpoint(tmp_path, 40, _state(4))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_truncated_state_falls_back_with_warning(tmp_path):
    first = save_checkpoint(tmp_path, 10, _state(1))
    second = save_checkpoint(tmp_path, 20, _state(2))
    _truncate_state(second)
    ok, reason = validate_checkpoint(second)
    assert not ok and "truncated" in reason
    with pytest.warns(CheckpointWarning, match="step_00000020") as rec:
        assert find_latest(tmp_path) == first
    assert len(rec) == 1  # named by `latest` and found by the scan, reported once
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(second)


def test_same_size_corruption_caught_by_checksum(tmp_path):
    path = save_checkpoint(tmp_path, 10, _state(1))
    f = path / ckpt.STATE_FILE
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))
    ok, reason = validate_checkpoint(path)
    assert not ok and "sha256" in reason
    assert validate_checkpoint(path, verify_checksums=False)[0]


@pytest.mark.parametrize("damage", ["garbage", "missing", "wrong_version"])
def test_bad_manifest_falls_back_with_warning(tmp_path, damage):
    first = save_checkpoint(tmp_path, 10, _state(1))
    second = save_checkpoint(tmp_path, 20, _state(2))
    mpath = second / ckpt.MANIFEST_NAME
    if damage == "garbage":
        mpath.write_text('{"step": 20, "fil')
    elif damage == "missing":
        mpath.unlink()
    else:
        m = json.loads(mpath.read_text())
        m["format_version"] = 999
        mpath.write_text(json.dumps(m))
    assert not validate_checkpoint(second)[0]
    with pytest.warns(CheckpointWarning):
        assert find_latest(tmp_path) == first
    with pytest.raises(CheckpointError):
        load_checkpoint(second)


def test_pointer_to_missing_dir_and_no_checkpoints(tmp_path):
    assert find_latest(tmp_path / "nowhere") is None
    assert find_latest(tmp_path) is None
    first = save_checkpoint(tmp_path, 10, _state(1))
    (tmp_path / "latest").write_text("step_00000099\n")
    with pytest.warns(CheckpointWarning, match="step_00000099"):
        assert find_latest(tmp_path) == first


def test_keep_last_prunes_oldest_complete_only(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, _state(step))
    _truncate_state(tmp_path / "step_00000020")  # incomplete dirs are kept for post-mortems
    save_checkpoint(tmp_path, 40, _state(40), keep_last=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000020", "step_00000030", "step_00000040"]
    # Saving an older step (rollback) keeps the highest step AND the checkpoint just written.
    save_checkpoint(tmp_path, 5, _state(5), keep_last=1)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000005", "step_00000020", "step_00000040"]
    assert find_latest(tmp_path).name == "step_00000005"


def test_saving_same_step_twice_replaces(tmp_path):
    save_checkpoint(tmp_path, 10, _state(1), meta={"v": 1})
    path = save_checkpoint(tmp_path, 10, _state(2), meta={"v": 2})
    state, manifest = load_checkpoint(path)
    _assert_state_equal(state, _state(2))
    assert manifest["meta"] == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000010"]


def test_crash_between_overwrite_renames_is_recovered(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 10, _state(1))
    real_replace = os.replace

    def crash_on_second_rename(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise OSError("simulated crash between renames")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second_rename)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 10, _state(2))
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (tmp_path / "step_00000010").exists()  # old copy sits aside as .old-*
    save_checkpoint(tmp_path, 20, _state(3))  # next save moves it back
    _assert_state_equal(load_checkpoint(tmp_path / "step_00000010")[0], _state(1))


def test_user_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 1, {}, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, {})
    with pytest.raises(ValueError, match="meta"):
        save_checkpoint(tmp_path, 1, {}, meta={"x": torch.ones(1)})
    assert list_checkpoints(tmp_path) == []
