"""The export matches the released Kimi-K3 files where issue 27 found it did not: the KDA o_norm is F32
on disk, config.json carries the top-level token ids and tie flag and the vision keys the release's
modeling code reads, the quantization_config targets ``Linear`` with an ignore list that leaves exactly
the routed experts (checked with compressed-tensors' matching rule, written out here), a partial
vision_config is a one-line error, and exporting a checkpoint not trained with MXFP4 QAT says so with
the measured change of its experts."""
import json
import re
import struct
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.interop import hf_names
from megak3.interop.hf_config import from_hf_config, to_hf_config
from megak3.interop.hf_load import load_hf_into
from megak3.model.k3 import build_model
from megak3.quant import mx
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import convert_hf  # noqa: E402


def _checkpoint(root, model, cfg, quant=None):
    ent = {f"model/{k}": ShardEntry(v.detach(), tuple(v.shape), (0,) * v.dim()) for k, v in model.state_dict().items()}
    config = {"model": asdict(cfg), **({"quant": quant} if quant is not None else {})}
    ShardedCheckpointer(root, 0, 1).save(3, ent, common={"step": 3}, meta={"config": config})
    return next(Path(root).glob("step_*"))


def _headers(d: Path) -> dict:
    """{name: (dtype, shape)} from the raw safetensors headers of every shard of ``d``."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        out.update({k: (v["dtype"], v["shape"]) for k, v in h.items() if k != "__metadata__"})
    return out


def test_kda_o_norm_is_f32_on_disk(tmp_path):
    # k3_full's KDA widths on 4 layers and 32 experts (the listing of all 93 layers takes seconds)
    k3 = load_model_config("k3_full", num_layers=4, **{"moe.num_experts": 32, "vision.enabled": False})
    assert k3.kda.head_dim == load_model_config("k3_full").kda.head_dim
    full = {t.name: t for t in hf_names.hf_tensors(k3, "mxfp4")}
    o = full["language_model.model.layers.0.self_attn.o_norm.weight"]
    assert (o.dtype, o.shape) == (torch.float32, (128,))          # the release: F32 [128]
    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    m = build_model(cfg, seed=1)
    convert_hf.export(_checkpoint(tmp_path / "ck", m, cfg), tmp_path / "hf", log=lambda s: None)
    heads = _headers(tmp_path / "hf")
    kda = [i for i, k in enumerate(cfg.layer_kinds()) if k == "kda"]
    for i in kda:
        assert heads[f"language_model.model.layers.{i}.self_attn.o_norm.weight"] == ("F32", [cfg.kda.head_dim])
    assert heads["language_model.model.layers.0.self_attn.q_proj.weight"][0] == "BF16"   # the rest stays bf16
    twin = build_model(cfg, seed=5)
    load_hf_into(twin, None, tmp_path / "hf")
    assert torch.equal(twin.layers[kda[0]].self_attn.o_norm.weight, m.layers[kda[0]].self_attn.o_norm.weight)


@pytest.mark.parametrize("name", ["k3_tiny", "k3_full"])
def test_config_json_top_level_ids_and_vision_keys(name):
    cfg = load_model_config(name)
    d = json.loads(json.dumps(to_hf_config(cfg, True)))
    for key, want in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id),
                      ("tie_word_embeddings", cfg.tie_word_embeddings)):
        assert d[key] == want == d["text_config"][key], key
    if name == "k3_full":
        assert (d["bos_token_id"], d["eos_token_id"], d["tie_word_embeddings"]) == (163584, 163586, False)
    v = d["vision_config"]
    assert v["mm_projector_type"] == "patchmergerv2" and v["merge_type"] == "sd2_tpool"
    assert v["pos_emb_type"] == "divided_fixed" and v["init_pos_emb_time"] == 4
    assert v["projector_hidden_act"] == "gelu" and v["projector_ln_eps"] == cfg.rms_norm_eps
    assert v["mm_hidden_size"] == v["vt_hidden_size"] == cfg.vision.hidden_size
    if name == "k3_full":
        assert v["mm_hidden_size"] == 1024 and v["projector_ln_eps"] == 1e-5
    # a config.json with the ids only at the top level (and a list-valued eos) reads the same ids
    for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        d["text_config"].pop(k)
    d["eos_token_id"] = [cfg.eos_token_id]
    assert from_hf_config(d) == cfg


def _ct_match(name: str, target: str) -> bool:
    """compressed-tensors' name rule: ``re:PATTERN`` is re.match-ed, anything else must equal the name."""
    return bool(re.match(target[3:], name)) if target.startswith("re:") else target == name


def _linear_modules(cfg) -> dict:
    """{HF module name: is a routed expert} of every Linear of an export: 2-D weights that are not
    embeddings, norms, the patch-embedding Conv2d or the position grid."""
    out = {}
    for t in hf_names.hf_tensors(cfg, "mxfp4"):
        base, _, leaf = t.name.rpartition(".")
        if t.kind in ("packed", "scale"):
            out[base] = True
        elif leaf == "weight" and len(t.shape) == 2 and "norm" not in base and "embed" not in base:
            out[base] = False
    return out


@pytest.mark.parametrize("name", ["k3_tiny", "k3_mini"])
def test_quantization_config_targets_linear_and_ignores_all_but_the_routed_experts(name):
    cfg = load_model_config(name)
    q = to_hf_config(cfg, True)["quantization_config"]
    group = q["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and q["format"] == "mxfp4-pack-quantized"
    mods = _linear_modules(cfg)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert sum(mods.values()) == n_moe * cfg.moe.num_experts * 3
    assert any(k.startswith("vision_tower.") for k in mods) == cfg.vision.enabled
    for mod, expert in mods.items():
        ignored = any(_ct_match(mod, pat) for pat in q["ignore"])
        assert ignored != expert, (mod, expert)          # quantised <=> a routed expert


def test_partial_vision_config_is_a_one_line_error(tmp_path):
    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    d = to_hf_config(cfg, False)
    d["vision_config"] = {"patch_size": 14, "vt_hidden_size": 64}
    with pytest.raises(ValueError) as e:
        from_hf_config(d)
    msg = str(e.value)
    assert "\n" not in msg and "vision_config" in msg and "'vt_num_hidden_layers'" in msg
    # through the import: the error names the field and the file, before any tensor is read
    m = build_model(cfg, seed=1)
    convert_hf.export(_checkpoint(tmp_path / "ck", m, cfg), tmp_path / "hf", log=lambda s: None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        load_hf_into(build_model(cfg, seed=0), None, tmp_path / "hf")
    assert "\n" not in str(e.value) and "train.init_from_hf" in str(e.value) and "vt_num_hidden_layers" in str(e.value)


def test_export_of_a_checkpoint_not_trained_with_qat_reports_the_measured_expert_change(tmp_path):
    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    m = build_model(cfg, seed=2)
    ws = [getattr(moe.experts, w).detach().float() for moe in m.moe_layers() for w in ("w1", "w3", "w2")]
    num = sum(float((mx.fake_quant_values(w.reshape(-1, w.shape[-1]), "fp4_e2m1", 32, "floor")
                     - w.reshape(-1, w.shape[-1])).double().square().sum()) for w in ws)
    ref = (num / sum(float(w.double().square().sum()) for w in ws)) ** 0.5
    n_mats = sum(w.shape[0] for w in ws)
    for tag, quant, experts, noted in (("plain", {"qat": "none"}, "mxfp4", True),
                                       ("unrecorded", None, "mxfp4", True),
                                       ("qat", {"qat": "mxfp4_experts", "scale_mode": "floor"}, "mxfp4", False),
                                       ("bf16", {"qat": "none"}, "bf16", False)):
        ck = _checkpoint(tmp_path / f"ck_{tag}", m, cfg, quant)
        lines = []
        st = convert_hf.export(ck, tmp_path / f"hf_{tag}", experts=experts, log=lines.append)
        notes = [ln for ln in lines if "not trained with MXFP4 QAT" in ln]
        assert len(notes) == int(noted), (tag, lines)
        if experts == "mxfp4":
            assert st["experts_rel_change"] == pytest.approx(ref, rel=1e-9)
        if noted:
            assert "--experts bf16" in notes[0] and f"{100 * ref:.2f}%" in notes[0] and f"{n_mats:,} expert" in notes[0]
            assert ("quant.qat=none" if quant else "quant.qat=not recorded") in notes[0]
    assert 0.01 < ref < 0.5  # MXFP4 of N(0, std) weights: a few percent, not zero


def test_cli_prints_the_note_on_stdout(tmp_path, capsys):
    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    ck = _checkpoint(tmp_path / "ck", build_model(cfg, seed=3), cfg, {"qat": "none"})
    assert convert_hf.main(["export", str(ck), str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert sum("not trained with MXFP4 QAT" in ln for ln in out.splitlines()) == 1
