"""fla's Triton KDA kernels under Triton's interpreter, driven through megak3's KDA dispatch, against
the torch twin (megak3.ops.kda.chunk_kda).

Run by tests/test_fla_triton.py in a subprocess, one per fla-core version, with ``TRITON_INTERPRET=1``
and PYTHONPATH = <triton dir>:<fla-core dir>:<repo> (tools/ci_triton.sh installs both dirs):

    TRITON_INTERPRET=1 PYTHONPATH=.cache/triton-interp/triton-3.7.1:.cache/triton-interp/fla-core-0.4.2:. \\
        python tests/fla_interpret_check.py

Every case calls `megak3.ops.kda.kda` (or `kda_cp`, or the KDA layer) with use_fla=True and checks
that fla's chunk_kda actually ran, then runs the same call with use_fla=False (the torch twin) and
compares outputs, final states and the gradients of a random linear loss w.r.t. every input, all
fp32 (the interpreter's bf16 dot is wrong: bf16 is kept out). Error = max|fla - twin| / max|twin|
per tensor; limits: outputs 1e-5, final states 5e-5, gradients 1e-4. Cases: fixed-length rows with
an initial state; packed documents (cu_seqlens + cu_seqlens_cpu) with initial states; kda_cp over 2
threaded CP ranks with packed documents (the segment maps: [v | 0] started at [0 | I]); the KDA
layer with model.kda.gate_lower_bound = -12 on gates near the bound, plus a control showing fla's
safe_gate tiles (what megak3 used at any bound before) are not finite there. Prints one line per
check and a JSON summary; exit status 1 when any check fails. Arguments: case names to run a subset.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(1, str(ROOT))

import triton_interpret  # noqa: E402  (tools/triton_interpret.py: must patch before fla is imported)

triton_interpret.install()
FLA_CHUNK_KDA = triton_interpret.import_fla()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import megak3.ops.kda.dispatch as kda_ops  # noqa: E402
from megak3.ops.kda import kda  # noqa: E402
from parallel.kda_cp import cp_local_docs, kda_cp  # noqa: E402
from parallel.testing import run_threaded  # noqa: E402

torch.set_num_threads(1)
TOL = {"o": 1e-5, "state": 5e-5, "grad": 1e-4}
RESULTS: list[dict] = []
CALLS = {"fla": 0}


# fla keeps one process-global cache entry per offsets helper (tensor_cache), which threads (the CP
# ranks below) could interleave: every fla forward and backward runs under one lock, and is counted
_FLA_LOCK = threading.RLock()


def _counting(fn):
    def wrapped(*args, **kwargs):
        with _FLA_LOCK:
            CALLS["fla"] += 1
            return fn(*args, **kwargs)
    return wrapped


def _serialise_fla_backward():
    from fla.ops.kda.chunk import ChunkKDAFunction
    backward = ChunkKDAFunction.backward

    def locked_backward(ctx, *grads):
        with _FLA_LOCK:
            return backward(ctx, *grads)

    ChunkKDAFunction.backward = staticmethod(locked_backward)


_serialise_fla_backward()
kda_ops._FLA_TRIED, kda_ops._FLA_CHUNK_KDA = True, _counting(FLA_CHUNK_KDA)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check(case: str, name: str, got, want, kind: str, scale: float | None = None) -> None:
    """One comparison: max|got - want| / max|want|, or / `scale` when given (then the error
    relative to max|want| is printed too, for information)."""
    own = rel_err(got, want)
    err = own if scale is None or own == float("inf") else (
        (got.double() - want.double()).abs().max().item() / scale)
    ok = err <= TOL[kind]
    RESULTS.append({"case": case, "tensor": name, "rel_err": err, "limit": TOL[kind], "ok": ok,
                    **({} if scale is None else {"rel_err_own_max": own, "scale": scale})})
    note = "" if scale is None else f" of the call's largest gradient; {own:.3g} of its own max"
    print(f"{'ok  ' if ok else 'FAIL'} {case:<24} {name:<17} err {err:.3g}{note} (limit {TOL[kind]:g})",
          flush=True)


def inputs(B, T, H, K, V, N, lo, seed, near_bound=False):
    """fp32 leaves q, k (unit), v, g in (lo, 0) (in (0.9 lo, lo) when near_bound), beta, h0 [N,H,K,V]."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    u = torch.rand(B, T, H, K, generator=gen)
    g = lo * (0.9 + 0.1 * u) if near_bound else lo * u
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(N, H, K, V, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def run_both(fn, leaves, seed):
    """fn(use_fla) -> (o, state or None) for fla and the twin; returns both with the gradients of
    <o, Wo> + <state, Ws> w.r.t. the leaves."""
    out = {}
    for use_fla in (True, False):
        before = CALLS["fla"]
        o, s = fn(use_fla)
        ran = CALLS["fla"] - before
        assert (ran > 0) == use_fla, f"use_fla={use_fla}: fla's chunk_kda ran {ran} times"
        gen = torch.Generator().manual_seed(seed)
        loss = (o * torch.randn(o.shape, generator=gen)).sum()
        if s is not None:
            loss = loss + (s * torch.randn(s.shape, generator=gen)).sum()
        grads = torch.autograd.grad(loss, leaves)
        out[use_fla] = (o.detach(), None if s is None else s.detach(), grads)
    return out[True], out[False]


def compare(case, fla, twin, names, gate_grads=()):
    """Outputs, states, gradients; the gradients named in `gate_grads` are judged against the
    largest gradient of the call (see GATE_NOTE)."""
    check(case, "o", fla[0], twin[0], "o")
    if twin[1] is not None:
        check(case, "final state", fla[1], twin[1], "state")
    scale = max(float(g.abs().max()) for g in twin[2] if g is not None)
    for n, a, b in zip(names, fla[2], twin[2]):
        if b is not None:
            check(case, "d" + n, a, b, "grad", scale if n in gate_grads else None)


# Near a bound of -12 every decay is ~e^-12, so d loss / d g (and the gradients of the parameters
# that make g) are ~1e-5 of the other gradients; fla forms dg in fp32 from terms the size of those
# other gradients, so its absolute error there is fp32 rounding of the call's largest gradient
# (~1e-7), which is up to ~20% of dg's own tiny magnitude. Those gradients are judged against the
# largest gradient of the call; everything else against its own magnitude.
GATE_NOTE = "gate gradients judged against the call's largest gradient"


NAMES = ("q", "k", "v", "g", "beta", "h0")


def case_dense():
    leaves = inputs(2, 100, 2, 32, 32, 2, -5.0, seed=1)
    fla, twin = run_both(lambda use_fla: kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                             use_fla=use_fla, lower_bound=-5.0), leaves, seed=2)
    compare("fixed length + h0", fla, twin, NAMES)


def case_varlen():
    cu_cpu = torch.tensor([0, 40, 41, 110], dtype=torch.int64)      # a 1-token document; 2 chunk ends
    cu_dev = cu_cpu.to(torch.int32)                                    # SeqInfo.cu_seqlens' dtype
    leaves = inputs(1, 110, 2, 32, 32, 3, -5.0, seed=3)
    fla, twin = run_both(lambda use_fla: kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                             cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, use_fla=use_fla),
                         leaves, seed=4)
    compare("cu_seqlens + h0", fla, twin, NAMES)


def case_cp():
    """kda_cp over 2 threaded ranks: every rank's local pass runs [v | 0] from [0 | I] through fla."""
    cp, Tg, H, K, V = 2, 128, 2, 16, 16
    cu_global = torch.tensor([0, 50, 70, 128])                         # a document crosses the boundary
    leaves = inputs(1, Tg, H, K, V, 1, -5.0, seed=5)[:5]
    gen = torch.Generator().manual_seed(6)
    Wo = torch.randn(1, Tg, H, V, generator=gen)
    per_impl = {}
    for use_fla in (True, False):
        before = CALLS["fla"]

        def rank_fn(group, use_fla=use_fla):
            r = dist.get_rank(group)
            T = Tg // cp
            docs = cp_local_docs(cu_global, 1, Tg, cp, r)
            xs = [x.detach()[:, r * T:(r + 1) * T].clone().requires_grad_() for x in leaves]
            o, fin = kda_cp(*xs, group, cu_seqlens=docs.cu_seqlens, continues=docs.continues,
                            cu_seqlens_cpu=docs.cu_seqlens.long(), output_final_state=True,
                            use_fla=use_fla)
            (o * Wo[:, r * T:(r + 1) * T]).sum().backward()
            return o.detach(), fin.detach(), [x.grad for x in xs]

        per_impl[use_fla] = run_threaded(cp, rank_fn, timeout=600.0)
        ran = CALLS["fla"] - before
        assert (ran > 0) == use_fla, f"kda_cp use_fla={use_fla}: fla's chunk_kda ran {ran} times"
    for r in range(cp):
        fla, twin = per_impl[True][r], per_impl[False][r]
        compare(f"kda_cp rank {r}/{cp}", fla, twin, NAMES[:5])


def case_gate_bound_12_layer():
    """The KDA layer (packed rows) with model.kda.gate_lower_bound = -12, gates near the bound:
    forward through fla (the layer passes its bound, so fla runs its general path)."""
    from megak3.config import ModelConfig
    from megak3.model.kda import KimiDeltaAttention
    from megak3.model.seqinfo import make_seq_info

    cfg = ModelConfig()
    cfg.hidden_size, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.gate_rank = 32, 2, 16, 8
    cfg.kda.gate_lower_bound = -12.0
    torch.manual_seed(7)
    layer = KimiDeltaAttention(cfg)
    for name, p in layer.named_parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():   # z = f_b(f_a(x)) ~ 0, sigmoid(z + 3.5) ~ 0.97: g ~ -11.6
        layer.f_b_proj.weight.mul_(0.05)
        layer.A_log.zero_()
        layer.dt_bias.fill_(3.5)
    B, T = 2, 32
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(8))
    seq = make_seq_info(B, T, torch.tensor([0, 13, 64]))
    out = {}
    with torch.no_grad():
        for use_fla in (True, False):
            layer.use_fla = use_fla
            before = CALLS["fla"]
            q, k, v, g, beta = layer._core_inputs(x, seq)
            out[use_fla] = layer._core(q, k, v, g, beta, seq)
            assert (CALLS["fla"] > before) == use_fla
    print(f"     gate range [{float(g.min()):.3f}, {float(g.max()):.3f}]", flush=True)
    assert float(g.max()) < -11.0, "the gates are not near the bound"
    check("layer, gate bound -12", "o", out[True], out[False], "o")


def case_gate_bound_12_ops():
    """Op level, gate bound -12, gates near it, packed documents + h0: fla's general path; then the
    control: the same inputs through fla's safe_gate tiles (megak3's call before this fix) are not
    finite, so this case can fail."""
    cu = torch.tensor([0, 24, 64])
    leaves = inputs(1, 64, 2, 16, 16, 2, -12.0, seed=10, near_bound=True)
    fla, twin = run_both(lambda use_fla: kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                             cu_seqlens=cu, cu_seqlens_cpu=cu, use_fla=use_fla,
                                             lower_bound=-12.0), leaves, seed=11)
    compare("ops, gate bound -12", fla, twin, NAMES, gate_grads=("g",))   # GATE_NOTE
    with torch.no_grad():
        o_safe, _ = kda(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu, cu_seqlens_cpu=cu,
                        lower_bound=-5.0)
    finite = bool(torch.isfinite(o_safe).all())
    RESULTS.append({"case": "control: safe_gate at -12", "tensor": "o", "finite": finite, "ok": not finite})
    print(f"{'ok  ' if not finite else 'FAIL'} control: fla's safe_gate tiles on gates near -12 give "
          f"{'finite' if finite else 'non-finite'} output (expected non-finite)", flush=True)


def main() -> int:
    import fla
    import triton
    version = getattr(fla, "__version__", "?")
    print(f"fla-core {version} ({Path(fla.__file__).parent}), triton {triton.__version__}, "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}", flush=True)
    t0 = time.time()
    cases = [case_dense, case_varlen, case_cp, case_gate_bound_12_ops, case_gate_bound_12_layer]
    if len(sys.argv) > 1:   # a subset by name: fla_interpret_check.py case_varlen case_cp
        cases = [c for c in cases if c.__name__ in sys.argv[1:]]
    for case in cases:
        t = time.time()
        case()
        print(f"     {case.__name__}: {time.time() - t:.1f} s", flush=True)
    ok = all(r["ok"] for r in RESULTS)
    print(json.dumps({"fla_core": version, "triton": triton.__version__, "ok": ok,
                      "seconds": round(time.time() - t0, 1), "fla_calls": CALLS["fla"],
                      "max_rel_err": {k: max((r["rel_err"] for r in RESULTS if r.get("limit") == v), default=0.0)
                                      for k, v in TOL.items()}}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
