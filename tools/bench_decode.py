"""Decode throughput with the cache vs the full-recompute loop, and cache bytes per sequence.

    python tools/bench_decode.py                              # 1K / 8K / 32K context
    python tools/bench_decode.py --contexts 256 1024 --new 8  # quick look

For each context C: a random C-token prompt is prefilled through megak3.inference.Engine, then
``--new`` tokens are decoded one at a time (batch 1, greedy); tokens/s counts decode steps only.
The baseline is what a generate loop without a cache pays per token: a forward over the whole
C-token sequence, timed in the same run. ``--baseline prefill`` (default) times the engine's cold
chunked prefill of the C tokens (memory bounded by the chunk); ``--baseline forward`` the training
forward (megak3/model/k3.py; on CPU its attention materialises an [H, C, C] score tensor, about
17 GB at 32K for this model). Printed: both rates and their ratio.

Cache bytes per sequence at the largest context: the pages the engine gave the sequence (MLA
latents) plus its KDA state, against the formula
``C x (kv_lora_rank + qk_rope_head_dim) x n_MLA_layers x 4 B + n_KDA_layers x (H K V + 3 (W-1) H K) x 4 B``
(fp32 pool: the model here is fp32; a context that is not a multiple of the page size rounds up to whole pages). The same
formula is printed for the full K3 config (bf16 latents, fp32 state) for scale.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megak3.config import load_model_config  # noqa: E402
from megak3.inference import Engine, SamplingParams  # noqa: E402
from megak3.model.k3 import build_model  # noqa: E402
from parallel.testing import PARITY_MODEL  # noqa: E402


def formula_bytes(cfg, C: int, latent_bytes: int = 4, state_bytes: int = 4) -> tuple:
    kinds = cfg.layer_kinds()
    n_mla, n_kda = kinds.count("mla"), kinds.count("kda")
    k = cfg.kda
    mla = C * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * n_mla * latent_bytes
    kda = n_kda * (k.num_heads * k.head_dim * k.head_dim + 3 * (k.conv_kernel - 1) * k.num_heads * k.head_dim) * state_bytes
    return mla, kda


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--new", type=int, default=16, help="decode steps timed per context")
    p.add_argument("--baseline", choices=("prefill", "forward"), default="prefill",
                   help="full-recompute step timed: the engine's cold chunked prefill or the training forward")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.contexts) < 1 or args.new < 1 or args.page_size < 1 or args.chunk < 1:
        print("--contexts, --new, --page-size and --chunk must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    C_max = max(args.contexts)
    cfg = load_model_config("k3_tiny", **{**PARITY_MODEL, "max_seq_len": C_max + args.new + 1})
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    print(f"model: k3_tiny structure at parity widths ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params), "
          f"{args.threads} thread(s), fp32")
    print(f"{'context':>8}{'cached tok/s':>14}{'recompute tok/s':>17}{'ratio':>9}{'prefill s':>11}")
    last = None
    for C in args.contexts:
        eng = Engine(model, page_size=args.page_size, prefill_chunk=args.chunk, checkpoint_mode="none",
                     num_pages=-(-(C + args.new) // args.page_size) + 1, max_batch=1)
        prompt = torch.randint(4, cfg.vocab_size, (C,), generator=g).tolist()
        stamps = []
        t0 = time.perf_counter()
        for _ in eng.stream(prompt, SamplingParams(max_tokens=args.new + 1, ignore_eos=True)):
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                seq = next(iter(eng.cache.seqs.values()))
                state = sum(t.numel() * t.element_size() for t in eng.runner.new_state().S + eng.runner.new_state().tails)
                measured = (len(seq.table) * eng.runner.page_bytes, state)
        prefill_s = stamps[0] - t0
        cached = args.new / (stamps[-1] - stamps[0])
        t = time.perf_counter()
        if args.baseline == "forward":
            with torch.no_grad():
                model(torch.tensor([prompt]))
        else:
            eng.next_logits([prompt])   # checkpoint_mode="none": a cold prefill of all C tokens
        recompute = 1.0 / (time.perf_counter() - t)
        print(f"{C:>8}{cached:>14.1f}{recompute:>17.2f}{cached / recompute:>9.1f}{prefill_s:>11.2f}", flush=True)
        last = (C, measured)
    C, (mla_b, kda_b) = last
    f_mla, f_kda = formula_bytes(cfg, -(-C // args.page_size) * args.page_size)
    print(f"cache bytes per sequence at {C} tokens: measured MLA pages {mla_b:,} + KDA state {kda_b:,} = "
          f"{mla_b + kda_b:,}; formula {f_mla:,} + {f_kda:,} = {f_mla + f_kda:,} "
          f"({'equal' if (mla_b, kda_b) == (f_mla, f_kda) else 'DIFFERENT'})")
    full = load_model_config("k3_full")
    m, k = formula_bytes(full, C, latent_bytes=2, state_bytes=4)
    print(f"K3 full config at {C} tokens (bf16 latents, fp32 state): MLA {m / 2**30:.2f} GiB + KDA {k / 2**30:.2f} GiB")
    return 0 if (mla_b, kda_b) == (f_mla, f_kda) else 1


if __name__ == "__main__":
    sys.exit(main())
