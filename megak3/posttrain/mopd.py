"""MOPD teachers: one per domain tag, checked against the student at start, each scoring only its own rows.

``rl.mopd_teachers=add=PATH,reverse@high=PATH`` maps sample tags (megak3/posttrain/tasks.py: ``TASK`` or
``TASK@EFFORT``) to teacher checkpoints (megak3 run / checkpoint directories, an RL run's included, or Hugging Face
directories), each loaded into every trainer rank that scores rows, or to served teachers
(``add=http://HOST:PORT``: a megak3 server, megak3/posttrain/teacher_client.py), whose weights stay in the server's
processes (``serve --replicas N`` or Ray actors). A sample takes the teacher of its exact tag, else the one of its
task; every entry of the task mixture must have one and every teacher must serve some entry. A single untagged
``PATH`` teaches every sample. Several untagged paths are refused (teachers are assigned by domain, never by
arrival order).

:func:`load_teachers` checks every teacher before any rollout: the same tokenizer as the student (SHA-256 of
its serialised JSON), the same vocabulary size and the same special ids (a served teacher's from its
``GET /v1/models`` card); otherwise one line naming the teacher and what differs. An unreachable URL is
refused there too.

:func:`teacher_logprobs` scores each row with its own teacher only: the rows of a micro-batch are grouped by
teacher and each group is one batched forward of that teacher (a served one: one scoring request), so the teacher
row-forwards of an update equal the rows trained whatever the number of teachers. It also returns, per teacher, the
sum over its response tokens of ``log pi_theta - log pi_teacher`` (on the student's own samples: a one-sample
estimate of KL(pi_theta || pi_teacher), the distillation progress the summary prints) and the token count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Union

import torch

from .teacher_client import ServedTeacher, is_url


@dataclass
class Teacher:
    tag: str
    """the tag it teaches ('' : every sample)"""
    path: str
    """its checkpoint path or server URL"""
    model: Union[torch.nn.Module, ServedTeacher]


def tokenizer_hash(tok) -> str:
    return tok.sha256()


def special_ids(tok) -> dict:
    return tok.special_ids()


def parse_teachers(spec: str) -> List[tuple]:
    """``rl.mopd_teachers`` -> [(tag, path)] (tag '' for one untagged teacher)."""
    items = [p.strip() for p in spec.split(",") if p.strip()]
    out = []
    for it in items:
        tag, sep, path = it.partition("=")
        if not sep or is_url(it):   # an untagged URL (its query, if any, is refused later)
            tag, path = "", it
        if sep and (not tag.strip() or not path.strip()):
            raise ValueError(f"rl.mopd_teachers={spec!r}: {it!r} must be TAG=PATH, e.g. add=runs/teacher_add")
        out.append((tag.strip(), path.strip()))
    untagged = [p for t, p in out if not t]
    if untagged and len(out) > 1:
        raise ValueError(f"rl.mopd_teachers={spec!r}: with several teachers each needs its domain tag "
                         "(rl.mopd_teachers=add=PATH,reverse=PATH); a sample is distilled from its own domain's")
    tags = [t for t, _ in out]
    dup = sorted({t for t in tags if tags.count(t) > 1})
    if dup:
        raise ValueError(f"rl.mopd_teachers={spec!r}: tag {dup[0]!r} has two teachers")
    return out


def route(task_tags: Sequence[str], teachers: Sequence[Teacher], spec: str) -> Dict[str, int]:
    """tag of each mixture entry -> its teacher's index; ValueError when an entry has none or a teacher is idle."""
    by_tag = {t.tag: i for i, t in enumerate(teachers)}
    out = {}
    for full in task_tags:
        if "" in by_tag:
            out[full] = by_tag[""]
            continue
        i = by_tag.get(full, by_tag.get(full.split("@", 1)[0]))
        if i is None:
            raise ValueError(f"rl.mopd_teachers={spec!r}: no teacher for the samples tagged {full!r} (rl.tasks); "
                             f"add {full.split('@', 1)[0]}=PATH")
        out[full] = i
    idle = sorted(set(range(len(teachers))) - set(out.values()))
    if idle:
        raise ValueError(f"rl.mopd_teachers={spec!r}: teacher {teachers[idle[0]].tag!r} matches no task of the "
                         f"mixture ({', '.join(task_tags)}); fix the tag or rl.tasks")
    return out


def load_teachers(spec: str, student_tok, vocab_size: int, device="cpu", temperature: float = 1.0,
                  timeout_s: float = 120.0, retries: int = 2) -> List[Teacher]:
    """Load and check the teachers of ``rl.mopd_teachers`` (module docstring). A served teacher scores at
    ``temperature`` (the trainer's ``rl.temperature``) and waits ``timeout_s`` per request, ``retries`` more
    times after a connection error, timeout or 5xx (megak3/posttrain/teacher_client.py)."""
    from ..inference import Engine

    want_hash, want_ids = tokenizer_hash(student_tok), special_ids(student_tok)
    out = []
    for tag, path in parse_teachers(spec):
        name = f"rl.mopd_teachers: teacher {tag + '=' if tag else ''}{path}"
        if is_url(path):
            model = ServedTeacher(path, name, temperature, timeout_s, retries)
            facts = model.facts()
            V, h, ids = facts["vocab_size"], facts["tokenizer_sha256"], facts["special_ids"]
        else:
            eng = Engine.from_pretrained(path, device=device)
            model = eng.model
            V, h, ids = eng.model.config.vocab_size, tokenizer_hash(eng.tokenizer), special_ids(eng.tokenizer)
        if V != vocab_size:
            raise ValueError(f"{name} has vocabulary size {V}, the student {vocab_size}: distil from teachers of the "
                             "student's vocabulary")
        if h != want_hash:
            raise ValueError(f"{name} has another tokenizer (sha256 {str(h)[:12]}, the student's {want_hash[:12]}): "
                             "distil from teachers trained with the student's tokenizer.json")
        if ids != want_ids:
            raise ValueError(f"{name} has special ids {ids}, the student {want_ids}")
        out.append(Teacher(tag, path, model))
    return out


@torch.no_grad()
def teacher_logprobs(logp_fn, teachers: Sequence[torch.nn.Module], which_B: List[int], make_batch,
                     shape, device) -> tuple:
    """``(logp_teacher_BT, rows_forwarded)``: row b of a ``shape`` [B, T] micro-batch scored by teacher
    ``which_B[b]`` (-1: a padding row, scored by none), each teacher's rows in one forward.
    ``make_batch(rows)``: the micro-batch of those rows (same length); ``logp_fn(model, mb)`` the token
    logprobs of a batch (a :class:`ServedTeacher`: its one scoring request for the rows instead)."""
    out = torch.zeros(shape, device=device)
    forwarded = 0
    for m in range(len(teachers)):
        rows = [b for b, w in enumerate(which_B) if w == m]
        if not rows:
            continue
        t, mb = teachers[m], make_batch(rows)
        lp = t.logprobs(mb) if isinstance(t, ServedTeacher) else logp_fn(t, mb)
        out[torch.tensor(rows, device=device)] = lp[:len(rows)].to(out.dtype)
        forwarded += len(rows)
    return out, forwarded


def tally_kl(tally: dict, logp_student_BT: torch.Tensor, logp_teacher_BT: torch.Tensor, mask_BT: torch.Tensor,
             which_B: torch.Tensor) -> None:
    """Add each teacher's sum of ``log pi_theta - log pi_teacher`` over its rows' masked tokens, and its token
    count, to ``tally`` (rows whose teacher is -1 count for none)."""
    diff = ((logp_student_BT - logp_teacher_BT) * mask_BT).sum(1).double().cpu()
    ntok = mask_BT.sum(1).double().cpu()
    which = which_B.cpu()
    for m in range(len(tally["kl"])):
        sel = which == m
        tally["kl"][m] += float(diff[sel].sum())
        tally["tokens"][m] += float(ntok[sel].sum())


def kl_report(tags: Sequence[str], kl, ntok) -> Dict[str, float]:
    """``{"kl_TAG": mean log pi_theta - log pi_teacher per response token}`` of the teachers that scored rows
    (``kl_teacher`` for an untagged one, ``kl_teacherI`` for teachers given without tags)."""
    name = lambda i: (tags[i] or "teacher") if i < len(tags) else f"teacher{i}"  # noqa: E731
    return {f"kl_{name(i)}": float(kl[i] / ntok[i]) for i in range(len(ntok)) if ntok[i] > 0}


def new_tally(n: int) -> dict:
    """An update's MOPD bookkeeping: teacher row-forwards, and per teacher the KL sum and token count."""
    return {"rows": 0, "kl": torch.zeros(n, dtype=torch.float64), "tokens": torch.zeros(n, dtype=torch.float64)}
