#!/usr/bin/env python
"""Does the model use the images? Train k3_tiny on the demo image-text corpus twice, same seed and
run length: once with the real images, once with every image replaced by uniform noise of the
same size (same slots, same captions). Print the validation caption loss of both and the margin.

Each arm is the production step (megak3.train.step.RankStep: the trainer's model build,
optimizer and accumulate/apply) fed by the production loader (Batcher over
VisionPackedDataset); only the pixels differ (``noise_images``). The two arms run side by side in
two processes, one thread each. The caption loss is the token mean over every labelled position
of the validation split (captions and eos; vision slots are never labelled); the "content" loss
is the same restricted to the count, colour and shape words, the only tokens the image
determines.

    .venv/bin/python tools/vision_ablation.py                   # ~3-4 minutes on 2 cores
    .venv/bin/python tools/vision_ablation.py --steps 40        # quicker, smaller margin
"""
import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _job(args):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.optim import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig

    # k3_tiny as configured, with the vocabulary cut to the demo tokenizer's size (317 ids) rounded
    # up: the lm_head over 8192 ids would be a third of the step for ids that never occur.
    return JobConfig(model=load_model_config("k3_tiny", vocab_size=args.vocab),
                     data=DataConfig(path="demo_vision", seq_len=args.seq_len, vocab_size=512, valid_fraction=0.1),
                     optim=OptimConfig(lr=args.lr, warmup_steps=args.steps // 10, schedule="cosine"),
                     train=TrainConfig(max_steps=args.steps, global_batch_size=args.batch,
                                       micro_batch_size=args.batch, seed=args.seed, device="cpu",
                                       precision="fp32"))


def run_arm(args, arm: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from megak3.data.config import resolve_dataset
    from megak3.data.packing import Batcher
    from megak3.data.tokenizer import load_tokenizer
    from megak3.data.vision_dataset import open_split
    from megak3.train.step import RankStep

    job = _job(args)
    prefix, tok_path = resolve_dataset(job.data)
    tok = load_tokenizer(tok_path)
    d = job.data
    split = lambda name: open_split(prefix, d.seq_len, name, d.valid_fraction, d.seed, tok, job.model,  # noqa: E731
                                    image_control=arm)
    torch.manual_seed(args.seed)
    rs = RankStep(job, __import__("parallel.state", fromlist=["ParallelState"]).ParallelState.single(), "cpu", 1)
    train = Batcher(split("train"), args.batch)
    t0 = time.perf_counter()
    losses = []
    for step in range(args.steps):
        rec = rs.accumulate([next(train)])
        rs.apply(step, args.steps)
        losses.append(float(rec["loss_sum"]) / float(rec["step_tokens"]))
    train_s = time.perf_counter() - t0
    # validation: every row of the valid split once (or the first --val-rows); content words = the image-determined tokens
    from megak3.data.demo_vision import COLOURS, COUNT_WORDS, SHAPES

    content = set()
    for w in list(COLOURS) + list(SHAPES) + list(COUNT_WORDS) + [s + "s" for s in SHAPES]:
        for text in (w, " " + w):
            ids = tok.encode(text)
            if len(ids) == 1:
                content.add(ids[0])
    content_t = torch.tensor(sorted(content))
    model = rs.model.eval()
    tot = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for i, b in enumerate(Batcher(split("valid"), args.batch, loop=False)):
            if args.val_rows and i * args.batch >= args.val_rows:
                break
            out = model(b["input_ids"], cu_seqlens=b["cu_seqlens"], images=b.get("images"), return_logits=True)
            lab = b["labels"].reshape(-1)
            ce = torch.nn.functional.cross_entropy(out.logits.reshape(lab.numel(), -1).double(), lab,
                                                   ignore_index=-100, reduction="none")
            keep, cont = lab != -100, torch.isin(lab, content_t)
            tot += torch.stack([ce[keep].sum(), keep.sum().double(), ce[cont].sum(), cont.sum().double()])
    return {"arm": arm, "train_first": losses[0], "train_last": sum(losses[-5:]) / len(losses[-5:]),
            "caption_loss": float(tot[0] / tot[1]), "content_loss": float(tot[2] / tot[3]),
            "val_tokens": int(tot[1]), "content_tokens": int(tot[3]), "train_s": train_s}


def _arm(q, args, arm):
    try:
        q.put(run_arm(args, arm))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        q.put({"arm": arm, "error": f"{type(e).__name__}: {e}"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps per arm (default 80)")
    ap.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per row (default 128)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=512, help="model.vocab_size (default 512 >= demo tokenizer)")
    ap.add_argument("--arms", default="real,noise",
                    help="comma-separated arms: real, noise, shuffle (another image of the same size); "
                         "default real,noise")
    ap.add_argument("--serial", action="store_true", help="run the arms one after the other (default: one process each)")
    ap.add_argument("--val-rows", type=int, default=0,
                    help="validate on the first N rows of the valid split (default 0: all of it; for quick checks)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megak3.data.config import resolve_dataset

    resolve_dataset(_job(args).data)  # build the demo corpus once, before the arms start
    t0 = time.perf_counter()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if arms[0] != "real" or not set(arms) <= {"real", "noise", "shuffle"} or len(arms) < 2:
        ap.error(f"--arms={args.arms}: give real first, then noise and/or shuffle")
    if args.serial:
        results = [run_arm(args, a) for a in arms]
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_arm, args=(q, args, a)) for a in arms]
        for p in procs:
            p.start()
        results = sorted((q.get() for _ in procs), key=lambda r: arms.index(r["arm"]))
        for p in procs:
            p.join()
    bad = [r for r in results if "error" in r]
    if bad:
        for r in bad:
            print(f"vision_ablation: {r['arm']} arm failed: {r['error']}", file=sys.stderr)
        return 1
    real = results[0]
    print(f"k3_tiny (vocab {args.vocab}) on demo_vision: {args.steps} steps x {args.batch} rows x {args.seq_len} "
          f"tokens, seed {args.seed}, {time.perf_counter() - t0:.0f} s wall")
    for r in results:
        print(f"  {r['arm']:7s} images: train loss {r['train_first']:.3f} -> {r['train_last']:.3f}; validation caption "
              f"loss {r['caption_loss']:.4f} ({r['val_tokens']} tokens), content words {r['content_loss']:.4f} "
              f"({r['content_tokens']} tokens); {r['train_s']:.0f} s")
    for r in results[1:]:
        print(f"margin ({r['arm']} - real): caption loss {r['caption_loss'] - real['caption_loss']:+.4f} nats/token, "
              f"content words {r['content_loss'] - real['content_loss']:+.4f} nats/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
