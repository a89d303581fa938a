"""RL tasks: a weighted prompt mixture over task domains and effort levels, and user reward functions.

``rl.tasks=add:0.5,reverse@high:0.5`` (``NAME[@EFFORT][:WEIGHT]``, weight 1 when left out): each new prompt
comes from one entry, in proportion to the weights (a smooth weighted round robin: over any run of prompts each
entry's share is within one prompt of its weight's, so every update sees the mixture), from that task's own
prompt stream
(megak3/data/demo_sft.py ``rl_prompts``); the group's samples carry the task (their domain) and the effort
label, together their tag ``NAME`` or ``NAME@EFFORT`` (:func:`tag`), which MOPD maps to a teacher
(megak3/posttrain/mopd.py) and the summary reports rewards by. The effort is a label here: it selects a
teacher and reaches reward functions, it does not change the prompt or the budget. Empty ``rl.tasks``: the
single task ``rl.task``. The n-th prompt of a run is a function of the seed and n alone (a resumed run skips
the prompts it used).

``rl.reward=module:function``: a batched reward ``function(prompts, completions, metadata) -> floats`` (one per
sample: the prompt's text, the completion's text, and a dict with ``task``, ``effort``, ``answer``,
``prompt_ids`` and ``token_ids``), used instead of the exact answer (the effort override still applies).
:func:`load_reward` imports it and calls it once on a probe (the first prompt of the stream with an empty
completion) before any rollout: an import error, something not callable, or a return that is not one finite
number per sample is one line naming ``rl.reward``.
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator, List, Sequence

from ..data.chat import generation_prompt


@dataclass(frozen=True)
class TaskSpec:
    name: str
    effort: str = ""
    weight: float = 1.0

    @property
    def tag(self) -> str:
        return tag(self.name, self.effort)


@dataclass
class Prompt:
    ids: List[int]
    answer: str
    task: str
    effort: str = ""


def tag(task: str, effort: str = "") -> str:
    """The tag of a sample: its task, ``@`` its effort label when it has one."""
    return f"{task}@{effort}" if effort else task


_ENTRY = re.compile(r"^([A-Za-z_][\w-]*)(?:@([A-Za-z_][\w-]*))?(?::([^:]+))?$")


def parse_tasks(spec: str, default: str) -> List[TaskSpec]:
    """``rl.tasks`` -> entries (module docstring); empty: ``[TaskSpec(default)]``. ValueError naming the field."""
    from ..data.demo_sft import FAMILIES

    if not spec.strip():
        return [TaskSpec(default)]
    out, seen = [], set()
    for raw in spec.split(","):
        m = _ENTRY.match(raw.strip())
        if not m:
            raise ValueError(f"rl.tasks={spec!r}: {raw.strip()!r} is not NAME[@EFFORT][:WEIGHT], e.g. "
                             "rl.tasks=add:0.5,reverse@high:0.5")
        name, effort, w = m.group(1), m.group(2) or "", m.group(3)
        if name not in FAMILIES:
            raise ValueError(f"rl.tasks={spec!r}: task {name!r} must be one of {', '.join(FAMILIES)}")
        try:
            weight = float(w) if w is not None else 1.0
        except ValueError:
            weight = -1.0
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"rl.tasks={spec!r}: the weight of {raw.strip()!r} must be a number > 0")
        t = TaskSpec(name, effort, weight)
        if t.tag in seen:
            raise ValueError(f"rl.tasks={spec!r}: {t.tag} is listed twice")
        seen.add(t.tag)
        out.append(t)
    return out


def prompt_stream(tokenizer, tasks: Sequence[TaskSpec], seed: int) -> Iterator[Prompt]:
    """Prompts of the mixture, forever (module docstring)."""
    from ..data.demo_sft import rl_prompts

    def one(task: str):
        k = 0
        while True:
            for msgs, answer in rl_prompts(256, task, seed=seed * 1000 + k):
                yield generation_prompt(tokenizer, msgs), answer
            k += 1

    streams = {t.name: one(t.name) for t in tasks}
    total = sum(t.weight for t in tasks)
    credit = [0.0] * len(tasks)
    while True:  # smooth weighted round robin
        for i, t in enumerate(tasks):
            credit[i] += t.weight
        i = max(range(len(tasks)), key=lambda j: credit[j])
        credit[i] -= total
        t = tasks[i]
        ids, answer = next(streams[t.name])
        yield Prompt(ids, answer, t.name, t.effort)


# ------------------------------------------------------------------------------------ user rewards

def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def call_reward(fn: Callable, spec: str, prompts: List[str], completions: List[str], meta: List[dict]) -> List[float]:
    """``fn``'s rewards, checked: one finite real number per sample, else ValueError naming ``rl.reward``."""
    try:
        out = fn(prompts, completions, meta)
    except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
        raise ValueError(f"rl.reward={spec}: the function raised {_one_line(e)}") from None
    try:
        vals = [float(v) for v in out]
    except (TypeError, ValueError):
        raise ValueError(f"rl.reward={spec}: must return a list of {len(prompts)} numbers (one per sample), "
                         f"got {type(out).__name__}") from None
    if len(vals) != len(prompts) or not all(math.isfinite(v) for v in vals) or isinstance(out, (str, bytes)):
        raise ValueError(f"rl.reward={spec}: must return {len(prompts)} finite numbers (one per sample), got "
                         f"{len(vals)} ({str(vals)[:80]})")
    return vals


def load_reward(spec: str, tokenizer, probe: Prompt) -> Callable:
    """Import ``rl.reward=module:function`` and check it on ``probe`` (module docstring)."""
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ValueError(f"rl.reward={spec!r} must be module:function, e.g. rl.reward=my_rewards:score")
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - ImportError and whatever the module raises on import
        raise ValueError(f"rl.reward={spec}: cannot import {mod} ({_one_line(e)}); put its directory on "
                         "PYTHONPATH") from None
    fn = getattr(m, name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"rl.reward={spec}: {mod} has no function {name!r}" if fn is None else
                         f"rl.reward={spec}: {mod}.{name} is a {type(fn).__name__}, not a function")
    call_reward(fn, spec, [tokenizer.decode(probe.ids)], [""], [metadata(probe.task, probe.effort, probe.answer,
                                                                             probe.ids, [])])
    return fn


def metadata(task: str, effort: str, answer, prompt_ids, token_ids) -> dict:
    return {"task": task, "effort": effort, "answer": answer, "prompt_ids": list(prompt_ids),
            "token_ids": list(token_ids)}


def score_with(fn: Callable, spec: str, tokenizer, samples) -> None:
    """Set ``reward`` of every rollout in ``samples`` from one batched call of the user's function."""
    if not samples:
        return
    vals = call_reward(fn, spec, [tokenizer.decode(r.prompt_ids) for r in samples], [r.text for r in samples],
                       [metadata(r.task, r.effort, r.answer, r.prompt_ids, r.token_ids) for r in samples])
    for r, v in zip(samples, vals):
        r.reward = v


def rewards_by_tag(groups, R_GK) -> dict:
    """``{"reward_TAG": mean reward of the samples of that tag}`` over the groups of an update."""
    by: dict = {}
    for g, row in zip(groups, R_GK.tolist()):
        by.setdefault(tag(g[0].task, g[0].effort), []).extend(row)
    return {f"reward_{t}": sum(v) / len(v) for t, v in sorted(by.items())}
