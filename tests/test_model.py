"""K3 model assembly: layer schedule, Block AttnRes, packed documents, init, param count, training."""
import dataclasses

import pytest
import torch

from megak3.config import load_model_config, model_config_from_dict
from megak3.model.attn_res import AttnResMix, attn_res_mix
from megak3.model.init import init_model
from megak3.model.k3 import K3Model, build_model
from megak3.model.param_count import count_parameters


def tiny(**kw):
    return load_model_config("k3_tiny", **kw)


# ---- schedule and config --------------------------------------------------------------------
def test_k3_full_layer_schedule():
    cfg = load_model_config("k3_full")
    one_based = [i + 1 for i in cfg.mla_layers()]
    assert one_based == list(range(4, 93, 4)) + [93]
    kinds = cfg.layer_kinds()
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    assert [cfg.is_moe_layer(i) for i in range(93)].count(True) == 92 and not cfg.is_moe_layer(0)


def test_k3_tiny_schedule_has_every_feature():
    cfg = tiny()
    assert cfg.layer_kinds() == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla", "mla"]
    assert cfg.num_layers // cfg.attn_res_block_size >= 2 and cfg.vision.enabled
    assert cfg.moe.num_shared_experts > 0 and cfg.first_k_dense == 1
    n = sum(p.numel() for p in K3Model(cfg).parameters())
    assert n < 30_000_000


@pytest.mark.parametrize("field,value,needle", [
    ("moe.top_k", 64, "model.moe.top_k"),
    ("kda.gate_lower_bound", 1.0, "model.kda.gate_lower_bound"),
    ("first_k_dense", 99, "model.first_k_dense"),
    ("moe.balancing", "aux", "model.moe.balancing"),
])
def test_invalid_config_names_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        tiny(**{field: value})


def test_unknown_model_and_unknown_field():
    with pytest.raises(ValueError, match="unknown model 'k3_huge'"):
        load_model_config("k3_huge")
    with pytest.raises(ValueError, match="hidden_sz"):
        model_config_from_dict({"hidden_sz": 3})


# ---- Block AttnRes ----------------------------------------------------------------------------
def _ref_attn_res(partial, blocks, query, norm_w, eps):
    # independent: per-source loop, explicit RMSNorm, explicit softmax
    srcs = [b.double() for b in blocks] + [partial.double()]
    scores = []
    for v in srcs:
        k = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * norm_w.double()
        scores.append((k * query.double()).sum(-1))
    s = torch.stack(scores)
    w = torch.exp(s - s.max(0).values)
    w = w / w.sum(0)
    return sum(w[i].unsqueeze(-1) * srcs[i] for i in range(len(srcs)))


def test_attn_res_matches_reference_and_zero_query_is_mean():
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    partial = torch.randn(2, 5, 16, generator=g)
    q, w = torch.randn(16, generator=g), torch.rand(16, generator=g) + 0.5
    out = attn_res_mix(partial, blocks, q, w, 1e-5)
    torch.testing.assert_close(out.double(), _ref_attn_res(partial, blocks, q, w, 1e-5), atol=1e-5, rtol=1e-5)
    mix = AttnResMix(16)
    init_model(mix, seed=0)
    assert torch.count_nonzero(mix.proj.weight) == 0
    torch.testing.assert_close(mix(partial, blocks), torch.stack(blocks + [partial]).mean(0), atol=1e-6, rtol=1e-6)


def test_attn_res_gradcheck():
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
    blocks = [mk(1, 3, 6), mk(1, 3, 6)]
    partial, q, w = mk(1, 3, 6), mk(6), mk(6)
    assert torch.autograd.gradcheck(lambda p, b0, b1, q, w: attn_res_mix(p, [b0, b1], q, w, 1e-5),
                                    (partial, *blocks, q, w))


def _record_sources(model):
    seen = {}

    def hook(name):
        def fn(mod, args, out):
            seen[name] = len(args[1]) + 1
        return fn

    for i, layer in enumerate(model.layers):
        layer.attn_res.register_forward_hook(hook(("attn", i)))
        layer.mlp_res.register_forward_hook(hook(("mlp", i)))
    model.output_attn_res.register_forward_hook(hook(("out", 0)))
    return seen


def test_attn_res_source_counts_follow_spec_formula():
    # K3_SPEC §16.6 with a deeper-than-tiny stack: attention input (l-1)//bs + 2 for l >= 1,
    # FFN input l//bs + 2, final mix (L-1)//bs + 2.
    cfg = tiny(num_layers=14, attn_res_block_size=4, hidden_size=32, **{
        "kda.num_heads": 2, "kda.head_dim": 8, "kda.gate_rank": 4, "mla.num_heads": 2,
        "mla.q_lora_rank": 8, "mla.kv_lora_rank": 8, "mla.qk_nope_head_dim": 4, "mla.qk_rope_head_dim": 4,
        "mla.v_head_dim": 4, "moe.num_experts": 4, "moe.expert_intermediate_size": 8,
        "moe.latent_size": 16, "dense_intermediate_size": 16, "vision.enabled": False, "vocab_size": 64})
    model = build_model(cfg, seed=0)
    seen = _record_sources(model)
    model(torch.randint(4, 64, (1, 8)))
    L, bs = cfg.num_layers, cfg.attn_res_block_size
    assert ("attn", 0) not in seen  # layer 0 attention reads x0 directly
    for l in range(1, L):
        assert seen[("attn", l)] == (l - 1) // bs + 2, l
    for l in range(L):
        assert seen[("mlp", l)] == l // bs + 2, l
    assert seen[("out", 0)] == (L - 1) // bs + 2
    assert (93 - 1) // 12 + 2 == 9  # K3: 8 committed blocks + the 9-layer tail


# ---- packed documents -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_model(tiny(), seed=0)


def test_packed_documents_equal_separate_sequences(tiny_model):
    """One row holding two documents == the two documents run alone (conv, KDA, MLA all reset)."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(4, 8192, (1, 37), generator=g), torch.randint(4, 8192, (1, 91), generator=g)
    with torch.no_grad():
        packed = tiny_model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 37, 128])).logits
        la, lb = tiny_model(a).logits, tiny_model(b).logits
    torch.testing.assert_close(packed[:, :37], la, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(packed[:, 37:], lb, atol=2e-4, rtol=1e-4)


def test_row_boundaries_are_document_boundaries(tiny_model):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, 8192, (2, 48), generator=g)
    with torch.no_grad():
        plain = tiny_model(ids).logits
        packed = tiny_model(ids, cu_seqlens=torch.tensor([0, 96])).logits  # row end added automatically
    torch.testing.assert_close(packed, plain, atol=2e-4, rtol=1e-4)


def test_bad_cu_seqlens_rejected(tiny_model):
    with pytest.raises(ValueError, match="cu_seqlens"):
        tiny_model(torch.zeros(1, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))


# ---- forward / backward -----------------------------------------------------------------------
def test_forward_backward_text_and_image(tiny_model):
    cfg = tiny_model.config
    tiny_model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, cfg.vocab_size, (2, 64), generator=g)
    n_img = tiny_model.vision.num_tokens(56, 28)
    ids[1, 10:10 + n_img] = cfg.media_placeholder_token_id
    labels = torch.roll(ids, -1, 1)
    out = tiny_model(ids, labels=labels, images=[torch.randn(3, 56, 28, generator=g)])
    assert out.loss.isfinite() and abs(out.loss.item() - torch.log(torch.tensor(8192.0)).item()) < 1.0
    assert len(out.moe_stats) == cfg.num_layers - 1
    out.loss.backward()
    missing = [n for n, p in tiny_model.named_parameters() if p.grad is None]
    # layer 0's pre-attention AttnRes site has no sources yet (it reads x0); K3 keeps its weights.
    assert missing == ["layers.0.attn_res.norm.weight", "layers.0.attn_res.proj.weight"]
    assert tiny_model.vision.patch_embed.weight.grad.abs().sum() > 0
    assert all(p.grad.isfinite().all() for p in tiny_model.parameters() if p.grad is not None)
    tiny_model.zero_grad(set_to_none=True)


def test_gradient_checkpointing_gives_same_grads():
    cfg = tiny(**{"vision.enabled": False})
    ids = torch.randint(4, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))
    grads = []
    for ckpt in (False, True):
        m = build_model(cfg, seed=1)
        m.gradient_checkpointing = ckpt
        m(ids, labels=torch.roll(ids, -1, 1)).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5)


def test_overfits_one_batch():
    torch.manual_seed(0)
    cfg = tiny(**{"vision.enabled": False})
    model = build_model(cfg, seed=0)
    ids = torch.randint(4, 512, (2, 64), generator=torch.Generator().manual_seed(7))
    labels = torch.roll(ids, -1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for _ in range(30):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# ---- init and parameter count -----------------------------------------------------------------
def test_init_is_a_function_of_seed_and_name():
    cfg = tiny(**{"vision.enabled": False})
    a, b = build_model(cfg, seed=11), build_model(cfg, seed=11)
    c = build_model(dataclasses.replace(cfg, num_layers=5, full_attn_layers=[4, 5]), seed=11)
    d = build_model(cfg, seed=12)
    sa, sb, sc, sd = (m.state_dict() for m in (a, b, c, d))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    shared = [k for k in sc if k in sa and sc[k].shape == sa[k].shape]
    assert "embed_tokens.weight" in shared and "layers.2.self_attn.q_proj.weight" in shared
    assert all(torch.equal(sa[k], sc[k]) for k in shared)  # same name -> same tensor, whatever the depth
    assert not torch.equal(sa["lm_head.weight"], sd["lm_head.weight"])
    A = torch.exp(sa["layers.0.self_attn.A_log"])
    assert bool(((A >= 1) & (A <= 16)).all()) and torch.count_nonzero(sa["layers.0.self_attn.dt_bias"]) == 0
    assert torch.count_nonzero(sa["layers.4.mlp_res.proj.weight"]) == 0
    assert torch.equal(sa["norm.weight"], torch.ones_like(sa["norm.weight"]))


def test_param_count_reproduces_published_k3_figures():
    out = count_parameters(load_model_config("k3_full"))
    assert out["text_total"] == 2_779_484_476_000
    assert out["active"] == 104_189_612_640
    c = out["components"]
    assert c["routed_experts"] == 2_722_740_830_208 and c["shared_experts"] == 12_155_092_992
    assert c["attention"] == 36_190_792_800 and c["norms_attn_res"] == 4_021_248
    assert c["vision"] == 401_214_464 + 46_141_440
