#!/usr/bin/env python
"""Print how closely each tp x SP x dp layout reproduces one process (fp32, same seed).

    python tools/parity_report.py [--steps 5] [--layouts 1n2,2n1,2s1,2n2,2s2,4n1,4s1,4n2,4s2]

Layout code: <tp><n|s><dp> (n: no sequence parallelism, s: sequence parallelism). For each layout it
prints the relative L2 error of all step-0 gradients, the worst single parameter, the step-0 loss
difference and the largest loss difference over the trajectory. Same routine as
tests/test_parity_tp.py (megak3.train.parity.run_steps on the parity model).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--layouts", default="1n2,2n1,2s1,2n2,2s2,4n1,4s1,4n2,4s2")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from megak3.train.parity import run_steps
    from parallel.testing import PARITY_MODEL, run_distributed

    ref = run_steps(0, 1, 1, 1, False, args.steps, PARITY_MODEL, lr=args.lr)
    for code in args.layouts.split(","):
        tp, sp, dp = int(code[0]), code[1] == "s", int(code[2:])
        got = run_distributed(run_steps, tp * dp, tp, dp, sp, args.steps, PARITY_MODEL, lr=args.lr,
                              timeout_s=900)[0]
        worst, d2, r2 = 0.0, 0.0, 0.0
        for name, g in ref["grads"].items():
            d = float((got["grads"][name].double() - g.double()).norm())
            r = float(g.double().norm())
            worst, d2, r2 = max(worst, d / max(r, 1e-30)), d2 + d * d, r2 + r * r
        dl0 = abs(got["losses"][0] - ref["losses"][0])
        dl = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        print(f"tp{tp} {'sp  ' if sp else 'nosp'} dp{dp}: grads rel {(d2 / r2) ** 0.5:.2e} (worst param "
              f"{worst:.2e}) | loss step 0 diff {dl0:.1e} | max {args.steps}-step loss diff {dl:.1e}", flush=True)


if __name__ == "__main__":
    main()
