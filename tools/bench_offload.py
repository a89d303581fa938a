"""AdamW step time on the host: torch's AdamW forms against optim.offload=cpu's kernels, one run.

    python tools/bench_offload.py [--model k3_mini] [--vocab-size 8192] [--threads 1] [--steps 10]

The tensors are the AdamW groups of ``--model`` (embed_tokens, lm_head, norms, AttnRes queries,
short convs, A_log / dt_bias; shapes from a meta-device model, ``--vocab-size`` shrinks the
embedding and lm_head to fit a small machine), fp32 on the CPU, with weight decay on the decayed
group as build_optimizer sets it. Variants, each on its own copy of the same weights and gradients:

* torch AdamW foreach (the baseline), fused, and for-loop (``foreach=False``);
* optim.offload=cpu, optim.offload_impl=torch (HostAdamW: torch's fused CPU kernel on the host
  tensors): in place, and through host copies;
* optim.offload=cpu, optim.offload_impl=deepspeed (DeepSpeed's CPU Adam): in place, and through
  host copies (skipped with a note when DeepSpeed is not installed).

"through host copies" runs the copy path CUDA params take (weights and gradients into separate
buffers, the weights back after the update); here the copies are host-to-host, so it shows their
CPU cost, not PCIe time. Every variant is built and stepped once (allocating its state); then
``--steps`` rounds time one step of each variant in turn, the order rotating each round, so load
from other processes falls on all of them alike; a variant's time is the median of its steps.
Memory: about 24 bytes per element per variant (32 with host copies) plus 8 for the shared inputs.
Printed per variant: ms per step, the effective bandwidth (28 bytes per element: p, g, m, v read,
p, m, v written) and its speed relative to the baseline measured in the same run (baseline time /
its time: above 1 is faster).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.config import load_model_config  # noqa: E402
from megak3.model.k3 import build_model  # noqa: E402
from megak3.optim import OptimConfig, classify_parameters  # noqa: E402
from megak3.optim.config import DEEPSPEED_INSTALL  # noqa: E402
from megak3.optim.offload import DeepSpeedHostAdamW, HostAdamW  # noqa: E402

BYTES_PER_ELEM = 28
"""AdamW traffic per fp32 element and step: read p, g, exp_avg, exp_avg_sq; write p, exp_avg, exp_avg_sq"""


def adamw_shapes(model_name: str, vocab_size: int) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, weight decay) of every AdamW-group param of the model, from a meta-device build."""
    ids = {k: i for k, i in zip(("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"),
                                range(vocab_size - 4, vocab_size))}  # the special ids must fit the vocabulary
    cfg = load_model_config(model_name, vocab_size=vocab_size, **ids)
    model = build_model(cfg, device="meta", init=False)
    return [(tuple(s.param.shape), s.weight_decay) for s in classify_parameters(model) if s.optimizer == "adamw"]


def variants(has_deepspeed: bool) -> dict:
    """name -> (constructor of the optimizer over param groups, hyperparameters as keywords)."""
    out = {
        "torch AdamW foreach (baseline)": lambda g, **hp: torch.optim.AdamW(g, foreach=True, **hp),
        "torch AdamW fused": lambda g, **hp: torch.optim.AdamW(g, fused=True, **hp),
        "torch AdamW for-loop": lambda g, **hp: torch.optim.AdamW(g, foreach=False, **hp),
        "offload torch twin, in place": lambda g, **hp: HostAdamW(g, **hp),
        "offload torch twin, host copies": lambda g, **hp: HostAdamW(g, host_copy=True, **hp),
    }
    if has_deepspeed:
        out["offload DeepSpeed CPU Adam, in place"] = lambda g, **hp: DeepSpeedHostAdamW(g, **hp)
        out["offload DeepSpeed CPU Adam, host copies"] = lambda g, **hp: DeepSpeedHostAdamW(g, host_copy=True, **hp)
    return out


def build(make, weights, grads, decays, cfg: OptimConfig):
    """One variant over its own copies of the weights and gradients, stepped once (allocating its state)."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    groups = [{"params": [p for p, d in zip(params, decays) if d == wd], "weight_decay": cfg.weight_decay if wd else 0.0}
              for wd in (True, False) if wd in decays]
    opt = make(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    opt.step()
    return opt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="k3_mini", help="model config whose AdamW groups are stepped")
    ap.add_argument("--vocab-size", type=int, default=8192,
                    help="model.vocab_size override (k3_mini's own 163840 gives 336 M AdamW elements; see the memory "
                         "note above)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads, which DeepSpeed's OpenMP kernel also uses (default: one per rank, as training)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (after one untimed step)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.steps < 1:
        ap.error("--threads and --steps must be >= 1")
    torch.set_num_threads(args.threads)
    try:
        import deepspeed  # noqa: F401
        has_ds = True
    except ImportError:
        has_ds = False
    shapes = adamw_shapes(args.model, args.vocab_size)
    numel = sum(torch.Size(s).numel() for s, _ in shapes)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g) * 0.02 for s, _ in shapes]
    grads = [torch.randn(s, generator=g) * 1e-3 for s, _ in shapes]
    decays = [wd for _, wd in shapes]
    cfg = OptimConfig()
    opts = {name: build(make, weights, grads, decays, cfg) for name, make in variants(has_ds).items()}
    names = list(opts)
    times: dict[str, list[float]] = {name: [] for name in names}
    for k in range(args.steps):  # one step of each variant in turn, the order rotating: load bursts hit all alike
        for name in names[k % len(names):] + names[:k % len(names)]:
            t0 = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - t0)
    print(f"AdamW groups of {args.model} (vocab_size={args.vocab_size}): {len(shapes)} tensors, "
          f"{numel / 1e6:.1f} M fp32 elements; {args.threads} torch thread(s); median of {args.steps} steps "
          f"per variant, the variants interleaved step by step")
    base = statistics.median(times["torch AdamW foreach (baseline)"])
    print(f"{'variant':42s} {'ms/step':>9s} {'GB/s':>7s} {'vs baseline':>12s}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:42s} {t * 1e3:9.1f} {BYTES_PER_ELEM * numel / t / 1e9:7.2f} {base / t:11.2f}x")
    if not has_ds:
        print(f"DeepSpeed not installed: its rows are left out ({DEEPSPEED_INSTALL})")


if __name__ == "__main__":
    main()
