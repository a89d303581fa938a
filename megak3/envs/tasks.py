"""Multi-turn tool tasks with verifiable rewards, generated deterministically from a seed.

A task is named by its spec ``{"family": name, "seed": int}`` (optionally ``"max_turns"``; what
checkpoints store); ``make_task`` rebuilds the same files, prompt and answer from it. Families:

- ``ledger``: CSV sales files spread over nested directories; the question asks for the total revenue
  of one item over all of them. Needs listing, reading (or a script) and arithmetic; reward 1.0 when
  the submitted integer is exact, else 0.0.
- ``fixbug``: a small module with one planted bug and a test script; reward 1.0 when, at submit,
  ``python3 test_program.py`` exits 0 in the sandbox and the test script is unchanged, else 0.0.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Dict, Optional

ITEMS = ("anvil", "bolt", "cog", "drill", "gear", "hinge", "lathe", "nail", "rivet", "spring")
REGIONS = ("north", "south", "east", "west")
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun")


@dataclass
class Task:
    family: str
    seed: int
    prompt: str
    files: Dict[str, str]
    max_turns: int
    answer: Optional[str]                      # exact answer (ledger) or None (scored by running tests)
    scorer: Callable[["Task", str, object], float]

    @property
    def spec(self) -> Dict:
        return {"family": self.family, "seed": self.seed, "max_turns": self.max_turns}

    def score(self, answer: str, sandbox) -> float:
        return self.scorer(self, answer, sandbox)


def _ledger(seed: int) -> Task:
    rng = random.Random(f"ledger/{seed}")
    item = rng.choice(ITEMS)
    files, total = {}, 0
    for region in rng.sample(REGIONS, rng.randint(2, 4)):
        for month in sorted(rng.sample(MONTHS, rng.randint(1, 3)), key=MONTHS.index):
            rows = ["id,item,qty,unit_price"]
            for i in range(rng.randint(4, 12)):
                it = item if rng.random() < 0.3 else rng.choice(ITEMS)
                qty, price = rng.randint(1, 40), rng.randint(2, 500)
                rows.append(f"{i},{it},{qty},{price}")
                total += qty * price if it == item else 0
            files[f"data/{region}/{month}.csv"] = "\n".join(rows) + "\n"
    files["README.txt"] = "Sales ledgers: data/<region>/<month>.csv with columns id,item,qty,unit_price.\n"
    prompt = (f"The directory /work holds sales ledgers (see README.txt). What is the total revenue "
              f"(sum of qty * unit_price) of item '{item}' over every ledger file? Submit the integer.")

    def score(task, answer, sandbox):
        return 1.0 if answer.strip().replace(",", "") == task.answer else 0.0

    return Task("ledger", seed, prompt, files, max_turns=12, answer=str(total), scorer=score)


# (correct body, buggy body, test inputs generator) per function; seed picks one and its test data
FIXBUG = {
    "top_mean": ("def top_mean(xs, k):\n    return sum(sorted(xs, reverse=True)[:k]) / k\n",
                 "def top_mean(xs, k):\n    return sum(sorted(xs)[:k]) / k\n",
                 lambda r: ([r.randint(-50, 50) for _ in range(r.randint(5, 9))], r.randint(1, 4))),
    "clamp_all": ("def clamp_all(xs, lo):\n    return [max(x, lo) for x in xs]\n",
                  "def clamp_all(xs, lo):\n    return [min(x, lo) for x in xs]\n",
                  lambda r: ([r.randint(-20, 20) for _ in range(r.randint(4, 8))], r.randint(-5, 5))),
    "count_runs": ("def count_runs(xs):\n    return sum(1 for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x)\n",
                   "def count_runs(xs):\n    return sum(1 for i, x in enumerate(xs) if i > 0 and xs[i - 1] != x)\n",
                   lambda r: ([r.randint(0, 2) for _ in range(r.randint(3, 10))],)),
}


def _fixbug(seed: int) -> Task:
    rng = random.Random(f"fixbug/{seed}")
    name = sorted(FIXBUG)[rng.randrange(len(FIXBUG))]
    good, bad, gen = FIXBUG[name]
    ns: Dict = {}
    exec(good, ns)                               # the reference implementation gives the expected values
    cases = []
    while len(cases) < 4:
        args = gen(rng)
        cases.append((args, ns[name](*args)))
    tests = "from program import " + name + "\n\n" + "".join(
        f"assert {name}(*{args!r}) == {want!r}, {name + repr(args)!r}\n" for args, want in cases) + 'print("ok")\n'
    files = {"program.py": bad, "test_program.py": tests}
    prompt = ("/work/program.py has a bug: /work/test_program.py fails. Fix program.py (do not edit the test), "
              "check with `python3 test_program.py`, then submit any answer.")
    digest = hashlib.sha256(tests.encode()).hexdigest()

    def score(task, answer, sandbox):
        try:
            unchanged = hashlib.sha256(sandbox.read_file("test_program.py").encode()).hexdigest() == digest
        except Exception:  # noqa: BLE001 - a deleted or unreadable test is a failure, not a crash
            return 0.0
        res = sandbox.run_command([sandbox.python, "test_program.py"])
        return 1.0 if unchanged and res.exit_code == 0 and not res.timed_out else 0.0

    return Task("fixbug", seed, prompt, files, max_turns=10, answer=None, scorer=score)


FAMILIES = {"ledger": _ledger, "fixbug": _fixbug}


def make_task(spec) -> Task:
    """The task a spec names: {"family", "seed"[, "max_turns"]} (max_turns overrides the family's), or a Task."""
    if isinstance(spec, Task):
        return spec
    turns = spec.get("max_turns") if isinstance(spec, dict) else None
    ok_turns = turns is None or isinstance(turns, int) and turns > 0
    if not isinstance(spec, dict) or spec.get("family") not in FAMILIES or not isinstance(spec.get("seed"), int) \
            or set(spec) - {"family", "seed", "max_turns"} or not ok_turns:
        raise ValueError(f"task spec {spec!r} must be {{'family': one of {sorted(FAMILIES)}, 'seed': int"
                         f"[, 'max_turns': positive int]}}")
    task = FAMILIES[spec["family"]](spec["seed"])
    if turns is not None:
        task.max_turns = turns
    return task
