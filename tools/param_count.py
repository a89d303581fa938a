#!/usr/bin/env python
"""Print parameter counts of a model preset as JSON, from the real module tree on the meta device.

    python tools/param_count.py model=k3_full [model.moe.top_k=8 ...]

``total`` includes the vision tower; ``text_total`` is the language model alone; ``active`` is per
token (lm_head counted, input embedding not), as the K3 report counts it.
"""
import json
import sys


def main(argv):
    from megak3.config import load_model_config

    name, overrides = "k3_full", {}
    for arg in argv:
        if arg in ("-h", "--help"):
            print(__doc__)
            return 0
        key, sep, val = arg.partition("=")
        if not sep:
            print(f"param_count: expected key=value, got {arg!r}", file=sys.stderr)
            return 2
        if key == "model":
            name = val
        elif key.startswith("model."):
            overrides[key[len("model."):]] = val
        else:
            print(f"param_count: unknown argument {key!r}; use model=NAME or model.FIELD=VALUE", file=sys.stderr)
            return 2
    try:
        cfg = load_model_config(name, **overrides)
    except ValueError as e:
        print(f"param_count: {e}", file=sys.stderr)
        return 2
    from megak3.model.param_count import count_parameters

    print(json.dumps(count_parameters(cfg), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
