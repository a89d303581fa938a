#!/usr/bin/env python
"""Forward + backward of k3_tiny on random tokens and one image; prints parameters, loss and grad norm.

    python tools/smoke.py
"""
import argparse

import torch

from megak3.config import load_model_config
from megak3.model.k3 import build_model


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    cfg = load_model_config("k3_tiny")
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, cfg.vocab_size, (2, 128), generator=g)
    n_img = model.vision.num_tokens(56, 56)
    ids[0, 5:5 + n_img] = cfg.media_placeholder_token_id
    image = torch.randn(3, 56, 56, generator=g)
    labels = torch.roll(ids, -1, dims=1)
    out = model(ids, labels=labels, images=[image])
    out.loss.backward()
    gn = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None))
    print(f"k3_tiny: {sum(p.numel() for p in model.parameters()):,} params, loss {out.loss.item():.4f}, grad norm {gn:.4f}")


if __name__ == "__main__":
    main()
