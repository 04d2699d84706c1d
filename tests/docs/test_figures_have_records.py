"""Every figure in the docs can be reproduced: each markdown table of measured numbers in README.md and
docs/*.md sits under a line naming the command that measured it and its record in docs/benchmarks/.

A figure table has at least two body cells, outside its first column, that are measured numbers: a
decimal (0.812), a number with a unit (24.3 s, 69.2 GB, 1.71x, 83%), or a few of them joined by `/`, `,`
or a range dash (0.188 / 0.206 / 0.231), emphasis and a trailing parenthesis aside. Plain integers, code
(`0.5`: a config default) and cells of text (names, formulas) are not measured numbers. Between the table
and the previous heading (or previous figure table) one line must name a command (`python benchmarks/...py`,
`python cli/...py` or `python -m pytest ...`, in a code span or a fenced block) and a record: a file of
docs/benchmarks/, by path or bare name."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORDS = {p.name for p in (REPO / "docs" / "benchmarks").iterdir() if p.is_file()}
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Tables the rule catches that hold no measurement, as (file name, the table's header line): each with why.
ALLOWED: dict[tuple[str, str], str] = {}

_NUM = r"[~≈<>+-]?\d[\d,]*(?:\.\d+)?"
_UNIT = r"\s?(?:x|×|%|s|ms|min|h|[KMGT]i?B(?:/s)?|tok/s)"
_ONE = rf"{_NUM}(?:{_UNIT})?"
MEASURED = re.compile(rf"{_ONE}(?:\s*(?:/|,|-|–)\s*{_ONE})*")
COMMAND = re.compile(r"python (?:(?:benchmarks|cli)/\S+\.py|-m pytest)")
SEPARATOR = re.compile(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?")


def _measured(cell: str) -> bool:
    cell = re.sub(r"\s*\([^()]*\)$", "", cell.replace("*", "").strip())
    return bool(MEASURED.fullmatch(cell)) and bool(re.search(rf"\d\.\d|\d{_UNIT}(?!\w)", cell))


def _names_command_and_record(line: str, in_code: bool) -> bool:
    code = [line] if in_code else re.findall(r"`([^`]+)`", line)
    return any(COMMAND.search(c) for c in code) and any(n in RECORDS for n in re.findall(r"[\w.-]+\.\w+", line))


def offending_tables(path: Path) -> list[str]:
    lines, out = path.read_text().splitlines(), []
    fence, cited, i = False, False, 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("```"):
            fence = not fence
        cited = cited or _names_command_and_record(line, fence)
        if not fence and line.startswith("#"):
            cited = False
        if not fence and line.startswith("|") and i + 1 < len(lines) and SEPARATOR.fullmatch(lines[i + 1].strip()):
            end = i + 2
            while end < len(lines) and lines[end].strip().startswith("|"):
                end += 1
            rows = [row.strip().strip("|").split("|") for row in lines[i + 2:end]]
            if sum(_measured(c) for row in rows for c in row[1:]) >= 2 and (path.name, line) not in ALLOWED:
                if not cited:
                    out.append(f"{path.relative_to(REPO)}:{i + 1}: {line[:100]}")
                cited = False
            i = end
            continue
        i += 1
    return out


FIX = ("Fix: above each table, one line such as 'Command: `python benchmarks/x.py ... --json docs/benchmarks/x.json`; "
       "record: `docs/benchmarks/x.json` (commit, machine).', the record committed there; a figure no record backs "
       "is removed, with a sentence saying it was not recorded.")


def test_every_figure_table_names_its_command_and_record():
    bad = [entry for path in DOCS for entry in offending_tables(path)]
    assert not bad, "figure tables without a line naming their command and record above them:\n  " + \
        "\n  ".join(bad) + "\n" + FIX


def test_the_rule_tells_figures_from_reference_tables():
    figures = ["0.812", "1.71x", "24.3 s", "69.2 GB", "83%", "0.188 / 0.206 / 0.231", "**0.55** (paired 0.53)"]
    assert all(map(_measured, figures))
    assert not any(map(_measured, ["8", "0,0,1", "0-15", "`0.5`", "4 P / shards", "see `trainer`", "84 / 95 / 111"]))
    named = "Command: `python benchmarks/e2e_grpo.py`; record: `docs/benchmarks/e2e_grpo.json`"
    assert _names_command_and_record(named, False)
    assert not _names_command_and_record(named.replace("`", ""), False)  # the command outside code
    assert not _names_command_and_record(named.replace("e2e_grpo.json", "missing.json"), False)
