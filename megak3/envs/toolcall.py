"""The one tool-call format the environments read from model text.

A model turn calls exactly one tool by writing a JSON object between tags::

    <tool_call>{"name": "shell", "arguments": {"cmd": "ls -la"}}</tool_call>

Text outside the tags is free (reasoning); a turn holds exactly one ``<tool_call>`` block. The JSON
may not contain the text ``</tool_call>``: write ``<\\/`` for ``</`` inside strings (valid JSON;
``ToolCall.to_text`` does). ``name`` must be one of the environment's tools and ``arguments`` an
object whose keys are that tool's parameters, all strings (required unless the tool has a default).
``parse_tool_call`` never raises on model text: a malformed call returns a ``ToolCallError`` whose
message is what the model sees as its observation.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple, Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

# tool name -> (required parameters, optional parameters with defaults); values are str unless noted
TOOLS: Dict[str, Tuple[Tuple[str, ...], Dict[str, Any]]] = {
    "shell": (("cmd",), {}),                      # /bin/sh -c cmd in the sandbox
    "python": (("code",), {}),                    # python3 -c code in the sandbox
    "read_file": (("path",), {}),
    "write_file": (("path", "content"), {}),
    "list_dir": ((), {"path": "."}),
    "submit": (("answer",), {}),                  # ends the episode; the task scores the answer
}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Dict[str, Any] = field(default_factory=dict)

    def to_text(self) -> str:
        """The call written in the documented format (what a policy emits)."""
        body = json.dumps({"name": self.name, "arguments": self.arguments}).replace("</", "<\\/")
        return f"{OPEN}{body}{CLOSE}"


@dataclass(frozen=True)
class ToolCallError:
    message: str


def check_call(name: Any, arguments: Any, tools: Mapping = TOOLS) -> Union[ToolCall, ToolCallError]:
    """Validate a (name, arguments) pair against ``tools``; fill defaults."""
    if not isinstance(name, str) or name not in tools:
        return ToolCallError(f"unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
    if not isinstance(arguments, dict):
        return ToolCallError(f"tool {name!r}: 'arguments' must be a JSON object, got {type(arguments).__name__}")
    required, optional = tools[name]
    missing = [k for k in required if k not in arguments]
    unknown = [k for k in arguments if k not in required and k not in optional]
    if missing or unknown:
        return ToolCallError(f"tool {name!r}: missing {missing}, unknown {unknown}; parameters: "
                             f"{list(required) + list(optional)}")
    bad = [k for k, v in arguments.items() if not isinstance(v, str)]
    if bad:
        return ToolCallError(f"tool {name!r}: arguments {bad} must be strings")
    return ToolCall(name, {**optional, **arguments})


def parse_tool_call(text: Any, tools: Mapping = TOOLS) -> Union[ToolCall, ToolCallError]:
    """The tool call in a model turn, or the error the model should see. Never raises."""
    if isinstance(text, ToolCall):
        return check_call(text.name, text.arguments, tools)
    if not isinstance(text, str):
        return ToolCallError(f"a turn must be text, got {type(text).__name__}")
    blocks = _BLOCK.findall(text)
    if not blocks:
        if OPEN in text:
            return ToolCallError(f"{OPEN} without a closing {CLOSE}")
        return ToolCallError(f"no tool call found; write {OPEN}{{\"name\": ..., \"arguments\": {{...}}}}{CLOSE} "
                             f"(call 'submit' to finish)")
    if len(blocks) > 1:
        return ToolCallError(f"{len(blocks)} tool calls in one turn; write exactly one")
    try:
        obj = json.loads(blocks[0])
    except (ValueError, RecursionError) as e:
        return ToolCallError(f"tool call is not valid JSON: {e}")
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments"} or "name" not in obj:
        return ToolCallError('tool call must be {"name": str, "arguments": {...}}')
    return check_call(obj["name"], obj.get("arguments", {}), tools)
