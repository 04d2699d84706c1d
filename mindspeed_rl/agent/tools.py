"""Tools an agent rollout can call, by name: the built-in ones, or your own by dotted path.

A tool is a function

    fn(arguments: str) -> str

`arguments` is the text of the call (between the call markers, or the JSON call's `arguments`,
see `syntax.py`); what it returns is the observation the model reads next. A tool that raises, or
returns something that is not a string, gives an error observation instead (`runner.py`); it never
ends the run. Your own tool: `"my_pkg.my_mod:my_fn"` or `"my_pkg.my_mod.my_fn"`, importable on every
rollout worker, as reward functions are (`rewards/registry.py`).

Built-in: `calc`, exact integer and decimal arithmetic on one expression (`1234+5678` -> `6912`);
`lookup`, a table the model cannot know: a key of digits -> a 3-digit value drawn from the key's hash
(`lookup_value`; the `builtin:lookup` task's answers, docs/agent.md).
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import json
import operator
import re
from fractions import Fraction
from typing import Callable

Tool = Callable[[str], str]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 100  # a result longer than this is refused (no 9**9**9 that runs for minutes)


def calc(arguments: str) -> str:
    """Evaluate one arithmetic expression exactly: integers and decimals, + - * / // % and parentheses.

    `1234+5678` -> `6912`; `7/2` -> `3.5`; `1/3` -> `0.3333333333`. Also takes a JSON object
    `{"expression": "..."}` (the JSON call syntax). Anything else raises ValueError, which the agent
    loop turns into an error observation."""
    text = str(arguments).strip()
    if text.startswith("{"):
        try:
            text = str(json.loads(text)["expression"]).strip()
        except (ValueError, KeyError, TypeError):
            raise ValueError('calc takes an expression, or {"expression": "..."}') from None
    if not text:
        raise ValueError("calc: empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"calc: expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = re.sub(r"(?<![\d.])0+(?=\d)", "", text)  # 0314 is 314 (Python's parser refuses leading zeros)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"calc: cannot parse {text!r}") from None
    value = _eval(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("calc: division by zero")
        out = _BINARY[type(node.op)](left, right)
        out = Fraction(out)
        if len(str(abs(out.numerator))) > MAX_DIGITS or len(str(out.denominator)) > MAX_DIGITS:
            raise ValueError(f"calc: result longer than {MAX_DIGITS} digits")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"calc: only numbers, + - * / // % and parentheses are allowed, not {ast.dump(node)[:40]}")


LOOKUP_KEY_DIGITS = 6  # a longer key is refused


def lookup_value(key: str) -> str:
    """The value of `key` in the lookup table: 3 digits from the SHA-256 of the key (leading zeros kept, so
    every value has the same length). A hash, not a rule: no digit of the value follows from the key's
    digits, so a model can only know it by calling the tool, or by memorizing the table (with 2-digit keys, 90
    of them for training, a run without the tool memorizes part of it: docs/agent.md)."""
    return f"{int.from_bytes(hashlib.sha256(f'lookup:{key}'.encode()).digest()[:8], 'big') % 1000:03d}"


def lookup(arguments: str) -> str:
    """The value of one key of digits (`042` -> `lookup_value('042')`); anything else raises ValueError,
    which the agent loop turns into an error result."""
    key = str(arguments).strip()
    if not key or not key.isdigit() or not key.isascii():
        raise ValueError(f"lookup takes a key of digits, not {key[:20]!r}")
    if len(key) > LOOKUP_KEY_DIGITS:
        raise ValueError(f"lookup: a key has at most {LOOKUP_KEY_DIGITS} digits")
    return lookup_value(key)


BUILTIN_TOOLS: dict[str, Tool] = {"calc": calc, "lookup": lookup}


def _unknown(name) -> str:
    return (f"unknown tool {name!r}: built-in tools are {sorted(BUILTIN_TOOLS)}; for your own tool give its dotted "
            "path, 'my_pkg.my_module:my_fn' or 'my_pkg.my_module.my_fn' (signature fn(arguments: str) -> str)")


def tool_name(spec: str) -> str:
    """The name the model calls a tool by: a built-in's name, or the function's name of a dotted path."""
    spec = str(spec).strip()
    if spec in BUILTIN_TOOLS:
        return spec
    return spec.replace(":", ".").rsplit(".", 1)[-1]


def get_tool(spec: str) -> Tool:
    """The tool `spec` names: a built-in name or a dotted path to your own function (ValueError naming
    the fix otherwise)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(_unknown(spec))
    spec = spec.strip()
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    if ":" in spec:
        module, _, attr = spec.partition(":")
    else:
        module, _, attr = spec.rpartition(".")
    if not module or not attr or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
        raise ValueError(_unknown(spec))
    try:
        obj = importlib.import_module(module)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise ValueError(f"tool {spec!r}: cannot import module {module!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"tool {spec!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"tool {spec!r}: {attr!r} in {module!r} is a {type(obj).__name__}, not a function")
    return obj


def get_tools(specs) -> dict[str, Tool]:
    """{name the model calls it by: tool} for a config's list of tools; two tools of one name are refused."""
    if isinstance(specs, str):
        specs = [specs]
    out: dict[str, Tool] = {}
    for spec in specs:
        name = tool_name(spec)
        if name in out:
            raise ValueError(f"two tools are called {name!r} (generate_config.agent.tools={list(specs)}); "
                             "give each tool its own function name")
        out[name] = get_tool(spec)
    return out


def check_tools(specs, import_module: bool = True) -> None:
    """Resolve a config's tools before any worker starts (ValueError naming the tool and the fix): every tool,
    built-in or your own, with `import_module`; without it (a dry run, whose workers' Python path may differ)
    the built-in names and the duplicates only."""
    if import_module:
        get_tools(specs)
        return
    for spec in [specs] if isinstance(specs, str) else specs:
        if isinstance(spec, str) and ":" not in spec and "." not in spec.strip():
            get_tool(spec)
    names = [tool_name(s) for s in ([specs] if isinstance(specs, str) else specs)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two tools are called {twice[0]!r} (generate_config.agent.tools={list(specs)}); give each "
                         "tool its own function name")
