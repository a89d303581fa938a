"""Hugging Face interop (megak3/interop/, tools/convert_hf.py): MXFP4 pack/unpack bit-exact against
megak3.quant.mx and torchao, the name adapter both ways, config.json both ways, the inventory
against a real export and the public K3 totals, the round trip trainer checkpoint (2 ranks, tp2) ->
HF -> ``train.init_from_hf`` at ep2 and at one process (identical weights, logits, next-step loss),
QAT export -> import with the QAT model's logits, and a one-line error for every malformed input."""
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.interop import hf_names
from megak3.interop.hf_config import compare_configs, from_hf_config, to_hf_config
from megak3.interop.hf_load import load_hf_into
from megak3.interop.mxfp4_pack import pack_mxfp4, unpack_mxfp4
from megak3.model.k3 import build_model
from megak3.quant import QuantConfig, apply_quantization, mx
from megak3.checkpoint.reader import CheckpointReader
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry
from parallel.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import convert_hf  # noqa: E402

FP4 = "fp4_e2m1"


# ---- MXFP4 pack / unpack ----------------------------------------------------------------------------
def _adversarial(seed=0):
    """[rows, 64] weights: random at many scales, all-zero and -0 rows, ties of every E2M1 threshold,
    saturation, fp32 subnormals (scale clamps to 2^-127), values near the fp32 maximum."""
    from test_mx import adversarial

    g = torch.Generator().manual_seed(seed)
    a = adversarial(seed)                                                  # [n, 32]
    a = torch.cat([a, a.flip(0)], 1)                                       # [n, 64]
    # near the fp32 top but inf-free under both rules: rceil rounds a block amax above 3.5 * 2^126
    # (~2.98e38) up to 4 * 2^126 = 2^128 = inf, floor saturates at 6 * 2^125
    extra = torch.stack([torch.full((64,), 2.9e38), -torch.full((64,), 2.9e38) * torch.rand(64, generator=g),
                         torch.full((64,), 2.0 ** -149), torch.linspace(-6, 6, 64)])
    return torch.cat([a, extra, torch.randn(16, 64, generator=g) * 0.02])


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_pack_unpack_is_the_qat_fake_quant_bit_for_bit(mode):
    w = _adversarial(0)
    packed, scale = pack_mxfp4(w, mode)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (w.shape[0], 32) and scale.shape == (w.shape[0], 2)
    fq = mx.fake_quant_values(w, FP4, 32, mode)
    got = unpack_mxfp4(packed, scale)
    assert torch.equal(got.view(torch.int32), fq.view(torch.int32))      # bits, signed zeros included
    # and against the independent reference (tests/test_mx.py's NumPy OCP quantizer): scale bytes,
    # every element's code (low nibble = even element, sign bit 0x8) and value
    from test_mx import ref_quantize

    import numpy as np

    rs, rc, rd = ref_quantize(w.double().numpy(), FP4, mode)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(-1)
    assert np.array_equal(scale.reshape(-1).numpy(), rs)
    assert np.array_equal(codes.numpy(), rc)
    assert np.array_equal(got.double().reshape(-1).numpy(), rd)
    assert np.array_equal(np.signbit(got.reshape(-1).numpy()), np.signbit(rd))
    assert torch.equal(unpack_mxfp4(packed, scale, torch.bfloat16), fq.to(torch.bfloat16))
    # idempotent (export -> import -> export): the same values; under floor also the same bytes (rceil may
    # re-encode a block whose amax rounded down to 3X as 6 * X/2)
    p2, s2 = pack_mxfp4(got, mode)
    assert torch.equal(unpack_mxfp4(p2, s2), got)
    if mode == "floor":
        assert torch.equal(p2, packed) and torch.equal(s2, scale)
    # low nibble = even element: element 0 of row r is packed[r, 0] & 0xF
    assert torch.equal(mx.e2m1_to_float(packed[:, 0] & 0xF) * mx.scales_to_float(scale[:, 0]), got[:, 0])


def test_rceil_scale_of_an_underflowing_block():
    """amax / 6 underflows fp32 to 0 (amax < 6 * 2^-150): the scale clamps to 2^-127 (byte 0), as OCP
    and the NumPy reference say (mx.py gave byte 127 before: frexp(0) has exponent 0)."""
    _, scale = pack_mxfp4(torch.full((1, 32), 2.0 ** -149), "rceil")
    assert scale.reshape(-1).tolist() == [0]       # OCP / the NumPy reference: 2^-127


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_pack_matches_torchao(mode):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    w = _adversarial(1)
    # torchao divides by max(X, 2^-126) when the scale clamps to 2^-127 (blocks with amax < ~2^-118),
    # where OCP and megak3 divide by 2^-127: those rows are left to the bit-level test above.
    w = w[w.reshape(len(w), -1, 32).abs().amax(-1).amin(1) > 2.0 ** -100]  # every block of the row
    ts, td = mx_tensor.to_mx(w, torch.float4_e2m1fn_x2, 32, getattr(ScaleCalculationMode, mode.upper()))
    packed, scale = pack_mxfp4(w, mode)
    assert torch.equal(scale.reshape(-1), ts.view(torch.uint8).reshape(-1))
    assert torch.equal(packed.reshape(-1), td.view(torch.uint8).reshape(-1))
    ref = mx_tensor.to_dtype(td, ts, torch.float4_e2m1fn_x2, 32, torch.float32)
    assert torch.equal(unpack_mxfp4(packed, scale), ref.reshape(w.shape))


def test_pack_unpack_refuse_what_the_format_cannot_hold():
    for bad, match in ((torch.randn(4, 48), "multiple of 32"), (torch.randn(2, 2, 32), "2-D"),
                       (torch.tensor([[float("inf")] + [0.0] * 31]), "NaN/Inf")):
        with pytest.raises(ValueError, match=match):
            pack_mxfp4(bad, name="x.w1")
    p, s = pack_mxfp4(torch.randn(3, 64))
    with pytest.raises(ValueError, match="0xFF"):
        unpack_mxfp4(p, torch.full_like(s, 0xFF))
    with pytest.raises(ValueError, match="does not match"):
        unpack_mxfp4(p, s[:, :1])


# ---- names and config ---------------------------------------------------------------------------------
def test_names_round_trip_tables_and_legacy_spellings():
    cfg = load_model_config("k3_tiny")
    listing = hf_names.hf_tensors(cfg, "mxfp4")
    assert len({t.name for t in listing}) == len(listing)
    for t in listing:
        r = hf_names.from_hf_name(t.name, cfg)
        assert r is not None and r.canonical == t.canonical and r.expert == t.expert, t
    L = "language_model.model.layers"
    kda, mla = cfg.layer_kinds().index("kda"), cfg.layer_kinds().index("mla")
    # g_proj is resolved by the layer's kind: same HF suffix, two different megak3 tensors/shapes
    shapes = hf_names.canonical_shapes(cfg)
    assert hf_names.from_hf_name(f"{L}.{kda}.self_attn.g_proj.weight", cfg).canonical == f"layers.{kda}.self_attn.g_proj.weight"
    assert shapes[f"layers.{kda}.self_attn.g_proj.weight"] != shapes[f"layers.{mla}.self_attn.g_proj.weight"]
    assert hf_names.from_hf_name(f"{L}.{mla}.self_attn.A_log", cfg) is None          # no A_log in MLA layers
    assert hf_names.from_hf_name(f"{L}.0.block_sparse_moe.gate.weight", cfg) is None  # layer 0 is dense
    assert hf_names.from_hf_name(f"{L}.1.block_sparse_moe.experts.32.w1.weight", cfg) is None  # E = 32
    assert hf_names.from_hf_name(f"{L}.9.input_layernorm.weight", cfg) is None        # 9 layers
    r = hf_names.from_hf_name(f"{L}.2.block_sparse_moe.experts.5.w2.weight_scale", cfg)
    assert (r.canonical, r.expert, r.part) == ("layers.2.mlp.experts.w2", 5, "weight_scale")
    for legacy, want in ((f"{L}.4.self_attention_res.norm.weight", "layers.4.attn_res.norm.weight"),
                         (f"{L}.4.mlp_res.proj_weight", "layers.4.mlp_res.proj.weight"),
                         (f"{L}.4.block_sparse_moe.e_score_correction_bias", "layers.4.mlp.gate.e_score_correction_bias"),
                         ("language_model.model.output_attn_res.proj.weight", "output_attn_res.proj.weight")):
        assert hf_names.from_hf_name(legacy, cfg).canonical == want
    assert hf_names.to_hf_name("layers.4.attn_res.proj.weight", cfg) == f"{L}.4.self_attention_res_proj.weight"
    assert hf_names.to_hf_name("output_attn_res.norm.weight", cfg) == "language_model.model.output_attn_res_norm.weight"
    assert hf_names.padded_sizes(cfg) == {"kda.A_log": 128}
    assert hf_names.padded_sizes(load_model_config("k3_full")) == {"kda.A_log": 128}     # 96 live heads
    with pytest.raises(ValueError, match="no Hugging Face name"):
        hf_names.to_hf_name("layers.0.self_attn.q_a_proj.weight", cfg)                   # layer 0 is KDA


@pytest.mark.parametrize("name", ["k3_tiny", "k3_mini", "k3_full"])
def test_config_json_round_trip(name):
    cfg = load_model_config(name)
    for packed in (True, False):
        d = json.loads(json.dumps(to_hf_config(cfg, packed)))
        assert from_hf_config(d) == cfg
        assert ("quantization_config" in d) == packed == ("quantization_config" in d["text_config"])
    if name == "k3_full":  # the release's config.json has no "megak3" block: K3's own values suffice
        d.pop("megak3")
        rel = from_hf_config(d)
        assert compare_configs(rel, cfg) == []
        q = to_hf_config(cfg, True)["quantization_config"]
        assert q["format"] == "mxfp4-pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    other = load_model_config(name, hidden_size=cfg.hidden_size * 2)
    with pytest.raises(ValueError, match="hidden_size"):
        compare_configs(from_hf_config(to_hf_config(other, True)), cfg)


def test_inventory_of_k3_full_matches_the_public_totals(capsys):
    assert convert_hf.main(["--inventory", "model=k3_full"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 497_220 + 2
    assert "497,220 tensors (497,052 text, 168 vision), 247,296 MXFP4 packed/scale pairs" in out[-2]
    assert "identical counts" in out[-1]
    assert out[0] == "language_model.model.embed_tokens.weight\t[163840, 7168]\tbfloat16"


# ---- checkpoints ---------------------------------------------------------------------------------------
def _job(world, **par):
    from megak3.data.config import DataConfig
    from megak3.metrics.config import LoggingConfig
    from megak3.optim.config import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig

    hf = par.pop("init_from_hf", None)
    qat = par.pop("qat", "none")
    return JobConfig(
        model=load_model_config("k3_tiny", **SMALL_MODEL),
        data=DataConfig(seq_len=32, vocab_size=512),
        optim=OptimConfig(lr=1e-2, warmup_steps=1, ns_dtype="float32"),
        train=TrainConfig(max_steps=4, global_batch_size=2, micro_batch_size=1 if par.get("ep") else 2,
                          seed=3, device="cpu", threads=1, init_from_hf=hf),
        logging=LoggingConfig(progress_bar=False, wandb=False),
        parallel=ParallelConfig(backend="gloo", timeout_s=120, **par),
        quant=QuantConfig(qat=qat),
    ).validate(world)


def _batch(seed, rows=2, T=32, vocab=512):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, T + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _rows(b, rank, n):
    return {k: v[rank::n] for k, v in b.items()}


def _train_and_save(rank, world, root, par):
    """A trainer-layout checkpoint: RankStep at ``par`` takes one step, then every rank saves the
    model boxes it is the saver of (the trainer's _entries rule) through ShardedCheckpointer."""
    from megak3.train.step import RankStep
    from parallel.plan import canonical_name
    from parallel.state import init_parallel

    job = _job(world, **par)
    ps = init_parallel(job.parallel, model_cfg=job.model)
    rs = RankStep(job, ps, "cpu", 1)
    rs.accumulate([_rows(_batch(0), ps.dp_rank, ps.dp_size)])
    rs.apply(0, job.train.max_steps)
    entries = {}
    for k, v in rs.model.state_dict().items():
        n = canonical_name(k)
        if rs.plan.is_saver(n):
            sh = rs.plan.tensors[n]
            entries[f"model/{n}"] = ShardEntry(v.detach(), sh.global_shape, sh.offsets)
    meta = {"config": {"model": asdict(job.model)}} if rank == 0 else None
    saver = ShardedCheckpointer(root, ps.rank, ps.world_size)
    torch.distributed.barrier()  # rank 0's constructor clears stale staging dirs: before anyone saves
    saver.save(1, entries, common={"step": 1} if rank == 0 else None, meta=meta)
    torch.distributed.barrier()
    return None


def _import_and_step(rank, world, hf_dir, par, ckpt_dir=None):
    """RankStep at ``par`` with train.init_from_hf (or, with ckpt_dir, the trainer checkpoint's boxes):
    returns its local tensors, the losses of two steps, the read statistics and (one process) logits."""
    from megak3.train.step import RankStep
    from parallel.data_parallel import build_sharded_optimizer
    from parallel.plan import canonical_name
    from parallel.state import ParallelState, init_parallel

    job = _job(world, **par, init_from_hf=None if ckpt_dir else hf_dir)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rs = RankStep(job, ps, "cpu", 1)
    own = {canonical_name(k): v for k, v in rs.model.state_dict().items()}
    if ckpt_dir:  # the reference: what resuming the trainer checkpoint would load
        reader = CheckpointReader(ckpt_dir)
        with torch.no_grad():
            for n, v in own.items():
                sh = rs.plan.tensors[n]
                v.copy_(reader.read(f"model/{n}", sh.offsets, sh.local_shape))
        rs.optimizer = build_sharded_optimizer(rs.model, job.optim, rs.plan)  # masters from the loaded weights
    boxes = {n: (rs.plan.tensors[n].offsets, v.detach().clone()) for n, v in own.items()}
    logits = None
    if world == 1:
        with torch.no_grad():
            rs.model.eval()
            logits = rs.model(_batch(5)["input_ids"]).logits
    losses = []
    for step in range(2):
        rec = rs.accumulate([_rows(_batch(10 + step), ps.dp_rank, ps.dp_size)])
        losses.append(float(rec["loss_sum"]) / float(rec["step_tokens"]))
        rs.apply(step, job.train.max_steps)
    local_bytes = sum(v.numel() * v.element_size() for v in own.values())
    return {"boxes": boxes, "losses": losses, "logits": logits, "stats": rs.hf_stats, "local_bytes": local_bytes}


def _full(boxes_per_rank, name, shape):
    out = torch.full(shape, float("nan"))
    for boxes in boxes_per_rank:
        if name in boxes:
            off, v = boxes[name]
            out[tuple(slice(o, o + s) for o, s in zip(off, v.shape))] = v
    return out


@pytest.mark.slow
def test_round_trip_tp2_checkpoint_to_hf_to_ep2_and_one_process(tmp_path):
    src = tmp_path / "ckpt"
    run_distributed(_train_and_save, 2, str(src), {"tp": 2}, timeout_s=240)
    hf = tmp_path / "hf"
    st = convert_hf.export(src, hf, experts="bf16", dtype="fp32", shard_size_mb=0.25, log=lambda s: None)
    assert st["shards"] > 3 and (hf / "config.json").exists()
    step_dir = next(src.glob("step_*"))
    ref = _import_and_step(0, 1, None, {}, ckpt_dir=str(step_dir))
    one = _import_and_step(0, 1, str(hf), {})
    ep2 = run_distributed(_import_and_step, 2, str(hf), {"ep": 2}, timeout_s=240)
    # one process: the same weights bit for bit, identical logits and next-step losses
    for n, (_, v) in ref["boxes"].items():
        assert torch.equal(one["boxes"][n][1], v), n
    assert torch.equal(one["logits"], ref["logits"])
    assert one["losses"] == ref["losses"]
    # ep2: every rank holds exactly its box of the reference (its half of the experts), reads no more than it holds
    for n, (_, v) in ref["boxes"].items():
        assert torch.equal(_full([r["boxes"] for r in ep2], n, v.shape), v), n
    assert ep2[0]["boxes"]["layers.1.mlp.experts.w1"][1].shape[0] == 4
    for r in ep2:
        pad = 4 * (128 - 2) * sum(1 for k in ref["boxes"] if k.endswith("A_log"))  # the padding check reads
        assert 0 < r["stats"]["bytes_read"] <= r["local_bytes"] + pad
        assert r["stats"]["notes"] == [] and r["stats"]["skipped"] == []
    # each dp rank's loss is its rows' share of the global mean: the sum is the step's loss
    for s in range(2):
        got = ep2[0]["losses"][s] + ep2[1]["losses"][s]
        assert abs(got - ref["losses"][s]) <= 1e-5 * abs(ref["losses"][s]), (ep2, ref["losses"])


def _single_checkpoint(root, model, cfg, quant=None):
    ent = {f"model/{k}": ShardEntry(v.detach(), tuple(v.shape), (0,) * v.dim()) for k, v in model.state_dict().items()}
    config = {"model": asdict(cfg), **({"quant": quant} if quant else {})}
    ShardedCheckpointer(root, 0, 1).save(7, ent, common={"step": 7}, meta={"config": config})
    return next(Path(root).glob("step_*"))


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_qat_model_exported_packed_reimports_with_the_same_logits(tmp_path, mode):
    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    qcfg = QuantConfig(qat="mxfp4_experts", scale_mode=mode)
    m = apply_quantization(build_model(cfg, seed=4), qcfg)
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.normal_()
    ckpt = _single_checkpoint(tmp_path / "ck", m, cfg, {"scale_mode": mode})
    st = convert_hf.export(ckpt, tmp_path / "hf", dtype="fp32", log=lambda s: None)
    assert st["scale_mode"] == mode
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["quantization_config"]["format"] == "mxfp4-pack-quantized"
    twin = apply_quantization(build_model(cfg, seed=99), qcfg)
    load_hf_into(twin, None, tmp_path / "hf")
    for a, b in zip(m.moe_layers(), twin.moe_layers()):  # masters = the QAT forward's weights
        for w in ("w1", "w3", "w2"):
            assert torch.equal(a.experts.weight_quant(getattr(a.experts, w)), getattr(b.experts, w))
    x = _batch(1)["input_ids"]
    with torch.no_grad():
        assert torch.equal(twin(x).logits, m(x).logits)


def test_inventory_of_k3_tiny_is_what_the_export_writes(tmp_path):
    from safetensors import safe_open

    cfg = load_model_config("k3_tiny")
    m = build_model(cfg, seed=2)
    ckpt = _single_checkpoint(tmp_path / "ck", m, cfg)
    for experts in ("mxfp4", "bf16"):
        out = tmp_path / f"hf_{experts}"
        convert_hf.export(ckpt, out, experts=experts, shard_size_mb=1, log=lambda s: None)
        listing, totals = convert_hf.inventory(cfg, experts)
        wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert list(wm) == [t.name for t in listing]
        assert totals["mxfp4_pairs"] == (8 * 32 * 3 if experts == "mxfp4" else 0)
        on_disk = {}
        for f in sorted(set(wm.values())):
            with safe_open(str(out / f), framework="pt") as sf:
                on_disk.update({k: (tuple(sf.get_slice(k).get_shape()), sf.get_slice(k).get_dtype()) for k in sf.keys()})
        names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}
        assert on_disk == {t.name: (t.shape, names[t.dtype]) for t in listing}
        if experts == "mxfp4":
            assert "quantization_config" in json.loads((out / "config.json").read_text())
        else:
            assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # bf16 export imports as the bf16-rounded masters; A_log padding is zero on disk
    twin = build_model(cfg, seed=9)
    load_hf_into(twin, None, tmp_path / "hf_bf16")
    for (n, a), b in zip(m.state_dict().items(), twin.state_dict().values()):
        keep32 = hf_names._layer_local(n) in hf_names.FP32_ON_DISK
        assert torch.equal(b, a if keep32 else a.to(torch.bfloat16).float()), n
    with safe_open(str(tmp_path / "hf_bf16" / wm["language_model.model.layers.0.self_attn.A_log"]), "pt") as sf:
        a_log = sf.get_tensor("language_model.model.layers.0.self_attn.A_log")
    assert a_log.shape == (128,) and a_log[4:].eq(0).all() and torch.equal(a_log[:4], m.layers[0].self_attn.A_log)


# ---- malformed input ------------------------------------------------------------------------------------
def _one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def _edit(hf, name, fn):
    """Rewrite the shard holding ``name``: fn(dict of its tensors) edits it in place."""
    from safetensors.torch import load_file, save_file

    wm = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    f = hf / wm[name]
    d = load_file(str(f))
    fn(d)
    save_file(d, str(f))


def test_every_malformed_input_is_a_one_line_error(tmp_path):
    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    m = build_model(cfg, seed=1)
    ckpt = _single_checkpoint(tmp_path / "ck", m, cfg)
    good = tmp_path / "good"
    convert_hf.export(ckpt, good, shard_size_mb=0.25, log=lambda s: None)
    L = "language_model.model.layers"

    def fresh(tag):
        d = tmp_path / tag
        shutil.copytree(good, d)
        return d

    def load(d, **kw):
        return load_hf_into(build_model(cfg, seed=0), None, d, **kw)

    with pytest.raises(ValueError) as e:
        load(tmp_path / "nowhere")
    _one_line(e, "train.init_from_hf", "no such directory")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as e:
        load(tmp_path / "empty")
    _one_line(e, "model.safetensors.index.json")
    d = fresh("noshard")
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    (d / wm[f"{L}.2.self_attn.q_proj.weight"]).unlink()
    with pytest.raises(ValueError) as e:
        load(d)
    _one_line(e, "missing", wm[f"{L}.2.self_attn.q_proj.weight"])
    cases = [
        ("shape", f"{L}.2.self_attn.q_proj.weight", lambda t: t[:-1], "has shape"),
        ("padding", f"{L}.0.self_attn.A_log", lambda t: t + 1, "not zero"),
        ("nan_scale", f"{L}.3.block_sparse_moe.experts.1.w2.weight_scale", lambda t: torch.full_like(t, 255), "0xFF"),
        ("dtype", f"{L}.2.self_attn.q_proj.weight", lambda t: t.to(torch.int32), "I32"),
    ]
    for tag, name, fn, needle in cases:
        d = fresh(tag)
        _edit(d, name, lambda dd: dd.__setitem__(name, fn(dd[name]).contiguous()))
        with pytest.raises(ValueError) as e:
            load(d)
        _one_line(e, needle, name.rsplit(".", 1)[0])
    # unknown and missing keys: edit the index (the shard may keep the tensor)
    for tag, edit, needle in (
            ("unknown", lambda wm: wm.__setitem__(f"{L}.2.self_attn.bogus.weight", next(iter(wm.values()))),
             f"unknown key '{L}.2.self_attn.bogus.weight'"),
            ("missing", lambda wm: wm.pop(f"{L}.5.mlp_res_norm.weight"), f"missing key '{L}.5.mlp_res_norm.weight'"),
            ("half_pair", lambda wm: wm.pop(f"{L}.1.block_sparse_moe.experts.7.w3.weight_scale"),
             f"missing key '{L}.1.block_sparse_moe.experts.7.w3.weight_scale'")):
        d = fresh(tag)
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        edit(idx["weight_map"])
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
        with pytest.raises(ValueError) as e:
            load(d)
        _one_line(e, needle)
    # a config.json of another architecture is refused before any tensor is read
    d = fresh("config")
    conf = json.loads((d / "config.json").read_text())
    conf["text_config"]["hidden_size"] = 128
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError) as e:
        load(d)
    _one_line(e, "hidden_size")


def test_export_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    m = build_model(cfg, seed=1)
    ckpt = _single_checkpoint(tmp_path / "ck", m, cfg)
    out = tmp_path / "out"
    (tmp_path / "plain").mkdir()
    for argv, needle in (
            (["export", str(tmp_path / "nope"), str(out)], "no such checkpoint"),
            (["export", str(tmp_path / "plain"), str(out)], "neither a checkpoint"),
            (["export", str(ckpt), str(out), "--experts", "int4"], "invalid choice"),
            (["export", str(ckpt), str(out), "model=k3_tiny"], "shape"),        # not the run's model config
            (["export", str(ckpt), str(tmp_path / "plain")], "already exists"),
            (["--inventory", "model=k3_nano"], "unknown model")):
        with pytest.raises(SystemExit) if "--experts" in argv else _nullcontext() as ex:
            rc = convert_hf.main(argv)
        rc = ex.value.code if "--experts" in argv else rc
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and needle in err, (argv, err)
        assert not out.exists() and not (tmp_path / "out.tmp").exists()
    # a failure in the middle (lm_head, written last, fails its crc32) leaves neither OUT_DIR nor OUT_DIR.tmp
    with CheckpointReader(ckpt) as reader:
        chunk = reader.chunks("model/lm_head.weight")[0]
    with open(ckpt / chunk["file"], "r+b") as f:
        f.seek(chunk["byte_offset"] + 100)
        f.write(b"\x7f\x7f\x7f\x7f")
    assert convert_hf.main(["export", str(ckpt), str(out), "--shard-size-mb", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "lm_head" in err and err.count("\n") == 1, err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_train_init_from_hf_is_checked_before_any_work(tmp_path):
    from megak3.job.compose import check

    rc, msg = check(["train.init_from_hf=" + str(tmp_path / "absent")], env={})
    assert rc == 2 and "train.init_from_hf" in msg and "no such directory" in msg and "\n" not in msg
    from megak3.job.config import TrainConfig

    with pytest.raises(ValueError, match="train.init_from_hf"):
        TrainConfig(init_from_hf=" ").validate()
