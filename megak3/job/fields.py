"""The fields of the job schema: dotted name, type and the docstring written under each dataclass
field (read from the source with ``ast``). ``python -m megak3.train --help`` prints them; the
config errors use them for "did you mean" and for the expected type of a value.

    schema_fields(LaunchJobConfig)    # [Field('model.name', 'str', ...), ..., Field('train.max_steps', 'int', ...)]
    field_docs(TrainConfig)           # {'max_steps': 'optimizer steps to run', ...}
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import List, NamedTuple


class Field(NamedTuple):
    name: str
    """dotted path, e.g. train.max_steps"""
    type: str
    """int, float, str, bool, list, optional str, ..."""
    doc: str
    """the field's docstring on one line"""


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict:
    """{field name: docstring} of a dataclass and its dataclass bases (the string literal that
    follows each annotated assignment in the class body)."""
    docs: dict = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def type_name(tp) -> str:
    """'int', 'float', 'str', 'bool', 'list of int', 'optional str', ... for a field annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return "optional " + (type_name(rest[0]) if len(rest) == 1 else "value")
    if origin in (list, typing.List):
        return "list of " + type_name(args[0]) if args else "list"
    return getattr(tp, "__name__", str(tp))


def schema_fields(cls, prefix: str = "") -> List[Field]:
    """Every leaf field of the dataclass ``cls``, nested sections flattened to dotted names."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: List[Field] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += schema_fields(tp, f"{prefix}{f.name}.")
        else:
            out.append(Field(prefix + f.name, type_name(tp), docs.get(f.name, "")))
    return out


def sections(cls) -> List[tuple]:
    """(name, docstring) of the top-level sections (config groups) of the job schema."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    return [(f.name, docs.get(f.name, "")) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
