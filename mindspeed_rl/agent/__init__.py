"""Multi-turn rollouts with tool calls (`generate_config.agent`), one concept per module:

* ``tools``: the tool registry (`calc` built in; your own by dotted path).
* ``syntax``: how a call and its result are written (`tags`: `<calc>..</calc>`; `json`: Qwen2.5's
  `<tool_call>{..}</tool_call>`), reading a call, the final answer after the last result.
* ``runner``: one call in a thread, bounded by a timeout; a malformed call, a raising or hung tool
  become error results, never a crash.
* ``loop``: the agent loop over a rollout engine: per row, generate until a call, run it, append the
  result (loss_mask 0), continue, up to max_turns; rows waiting on a tool never stall the others.
"""
from .loop import AgentLoop, AgentRollout, turn_seed
from .runner import STATUSES, ToolRunner
from .syntax import SYNTAXES, CallSyntax, MalformedCall, ToolCall, final_answer, get_syntax
from .tools import BUILTIN_TOOLS, calc, get_tool, get_tools, tool_name

__all__ = ["AgentLoop", "AgentRollout", "BUILTIN_TOOLS", "CallSyntax", "MalformedCall", "STATUSES", "SYNTAXES",
           "ToolCall", "ToolRunner", "calc", "final_answer", "get_syntax", "get_tool", "get_tools", "tool_name",
           "turn_seed"]
