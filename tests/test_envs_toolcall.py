"""The tool-call format: well-formed calls parse, every malformed turn becomes an error message."""
import pytest

from megak3.envs.toolcall import ToolCall, ToolCallError, parse_tool_call


def test_well_formed_calls():
    c = parse_tool_call('I will look.\n<tool_call>{"name": "shell", "arguments": {"cmd": "ls -la"}}</tool_call>')
    assert c == ToolCall("shell", {"cmd": "ls -la"})
    assert parse_tool_call('<tool_call>{"name": "list_dir", "arguments": {}}</tool_call>') == \
        ToolCall("list_dir", {"path": "."})                       # default filled in
    call = ToolCall("write_file", {"path": "a.txt", "content": "x</tool_call>y"})
    assert parse_tool_call(call.to_text()) == call                 # '</' is escaped as '<\\/' inside the JSON
    assert parse_tool_call(ToolCall("submit", {"answer": "42"})) == ToolCall("submit", {"answer": "42"})


@pytest.mark.parametrize("text, fragment", [
    ("just thinking", "no tool call"),
    ('<tool_call>{"name": "shell"', "without a closing"),
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["shell"]</tool_call>', "must be"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool"),
    ('<tool_call>{"name": "shell", "arguments": {}}</tool_call>', "missing ['cmd']"),
    ('<tool_call>{"name": "shell", "arguments": {"cmd": "ls", "x": 1}}</tool_call>', "unknown ['x']"),
    ('<tool_call>{"name": "shell", "arguments": {"cmd": 3}}</tool_call>', "must be strings"),
    ('<tool_call>{"name": "shell", "arguments": "ls"}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "shell", "arguments": {"cmd": "a"}}</tool_call><tool_call>{}</tool_call>', "2 tool calls"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "not valid JSON"),
    (None, "must be text"),
    (b"bytes", "must be text"),
])
def test_malformed_calls_are_messages(text, fragment):
    out = parse_tool_call(text)
    assert isinstance(out, ToolCallError) and fragment in out.message, out
