"""How a model writes a tool call and reads its result: the call syntax, by name.

| syntax | a call (the model writes it)                                 | its result (appended, not trained) |
|--------|--------------------------------------------------------------|------------------------------------|
| `tags` | `<calc>1234+5678</calc>`: one tag pair per tool               | `<result>6912</result>`            |
| `json` | `<tool_call>{"name": "calc", "arguments": "1234+5678"}</tool_call>` (Qwen2.5 / Hermes) | `<tool_response>6912</tool_response>` |

The marker that closes a call (`</calc>`, `</tool_call>`) is the stop the rollout generates until: it
must be one token of the tokenizer (Qwen2.5 has `</tool_call>`; the built-in `tiny-qwen2-tool` has the
`tags` markers of `calc`), which the agent loop checks at start. A call that cannot be read (no
opening marker, bad JSON, an unknown tool) is not an error of the run: it becomes an error result the
model reads, as a tool that raises does.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

SYNTAXES = ("tags", "json")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str


class MalformedCall(ValueError):
    """A call the syntax cannot read; its message becomes the error result."""


@dataclass(frozen=True)
class CallSyntax:
    """One syntax: which markers close a call, how a call is read, how a result is written."""

    name: str
    result_start: str
    result_end: str

    def call_ends(self, tools: Sequence[str]) -> list[str]:
        """The markers that close a call (the rollout's extra stops), one per tool for `tags`."""
        return [f"</{t}>" for t in tools] if self.name == "tags" else ["</tool_call>"]

    def parse(self, text: str, tools: Sequence[str]) -> ToolCall:
        """The call that `text` (one turn of the model, ending with a call's closing marker) makes."""
        if self.name == "tags":
            name = next((t for t in tools if text.endswith(f"</{t}>")), None)
            if name is None:
                raise MalformedCall(f"the call ends with no known tool's closing tag; tools: {list(tools)}")
            body = text[:-len(f"</{name}>")]
            start = body.rfind(f"<{name}>")
            if start < 0:
                raise MalformedCall(f"</{name}> without <{name}> before it: write <{name}>arguments</{name}>")
            return ToolCall(name, body[start + len(name) + 2:])
        body = text[:-len("</tool_call>")] if text.endswith("</tool_call>") else text
        start = body.rfind("<tool_call>")
        if start < 0:
            raise MalformedCall("</tool_call> without <tool_call> before it")
        try:
            call = json.loads(body[start + len("<tool_call>"):])
        except ValueError as e:
            raise MalformedCall(f"the call is not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise MalformedCall('a call is {"name": "<tool>", "arguments": ...}')
        if call["name"] not in tools:
            raise MalformedCall(f"unknown tool {call['name']!r}; tools: {list(tools)}")
        args = call.get("arguments", "")
        return ToolCall(call["name"], args if isinstance(args, str) else json.dumps(args))

    def opener(self, tool: str) -> str:
        """What a call of `tool` starts with: the text a forced call (`tool_choice`) is given before the
        model writes the arguments."""
        return f"<{tool}>" if self.name == "tags" else f'<tool_call>{{"name": "{tool}", "arguments": '

    def result(self, text: str) -> str:
        return f"{self.result_start}{text}{self.result_end}"

    def error(self, message: str) -> str:
        return self.result(f"error: {message}")


_SYNTAXES = {"tags": CallSyntax("tags", "<result>", "</result>"),
             "json": CallSyntax("json", "<tool_response>", "</tool_response>")}
RESULT_ENDS = tuple(s.result_end for s in _SYNTAXES.values())
# a result the tool appended: it comes right after the marker that closed a call (a stop of the rollout,
# so the model never writes past it); a result marker the model writes itself matches nothing
_TOOL_RESULTS = re.compile(r"</[A-Za-z_][\w.]*><result>.*?</result>|</tool_call><tool_response>.*?</tool_response>",
                           re.DOTALL)


def get_syntax(name: str) -> CallSyntax:
    if name not in _SYNTAXES:
        raise ValueError(f"unknown call syntax {name!r}; use one of {list(SYNTAXES)}")
    return _SYNTAXES[name]


def final_answer(response: str) -> str:
    """The text after the last tool result in a decoded trajectory (the whole response when it
    called no tool): what an agent task's answer is read from.

    Only a result the tool appended counts: one that follows the marker closing a call
    (`</calc><result>..</result>`). The model can write result markers itself; were they counted, it
    could restart its answer anywhere (measured: a tool run learned to write `</result>1111` in
    place of calls)."""
    cut = 0
    for m in _TOOL_RESULTS.finditer(response):
        cut = m.end()
    return response[cut:]
