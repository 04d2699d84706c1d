"""Every test proves something: a test function with no assertion passes whatever the code does.

A test asserts when its body has an `assert`, a `pytest.raises`/`pytest.warns`/`pytest.fail`, an
`assert_*` call (`torch.testing.assert_close`), a hypothesis state machine run (its rules assert), or calls a
function of the test tree that asserts (by name: helpers in conftest, `_common.py` and the test modules themselves, found
transitively). Decorated with `hypothesis.given`, the rule is the same.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKS = {"raises", "warns", "fail", "deprecated_call"}


def _called_names(fn: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def _asserts_itself(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CHECKS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest":
            return True
        if isinstance(node, ast.Raise):   # a helper that raises its own failure on a bad value
            return True
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name.startswith("assert") or name == "run_state_machine_as_test":
                return True   # torch.testing.assert_close, numpy's assert_*; a hypothesis machine's own asserts
    return False


def _functions(root: Path) -> dict[Path, list[ast.FunctionDef]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out[path] = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def silent_tests(root: Path) -> list[str]:
    """The test functions under `root` that assert nothing, as path::name."""
    functions = _functions(root)
    asserting: set[str] = set()
    calls: dict[str, set[str]] = {}
    for fns in functions.values():
        for fn in fns:
            calls.setdefault(fn.name, set()).update(_called_names(fn))
            if _asserts_itself(fn):
                asserting.add(fn.name)
    changed = True
    while changed:   # a function that calls an asserting one asserts
        changed = False
        for name, called in calls.items():
            if name not in asserting and called & asserting:
                asserting.add(name)
                changed = True
    return [f"{path.relative_to(root.parent)}::{fn.name}" for path, fns in functions.items()
            if path.name.startswith("test_") for fn in fns
            if fn.name.startswith("test_") and not _asserts_itself(fn) and not (_called_names(fn) & asserting)]


def test_the_check_finds_a_silent_test(tmp_path):
    (tmp_path / "helpers.py").write_text("def check(x):\n    assert x\n\ndef quiet(x):\n    return x\n")
    (tmp_path / "test_m.py").write_text(
        "def test_silent():\n    quiet(1)\n\n"
        "def test_via_helper():\n    check(1)\n\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n\n"
        "def test_close():\n    torch.testing.assert_close(1, 1)\n")
    assert silent_tests(tmp_path) == [f"{tmp_path.name}/test_m.py::test_silent"]


def test_every_test_function_asserts_something():
    silent = silent_tests(TESTS)
    assert not silent, ("test functions that assert nothing (add an assert, pytest.raises, or call a helper that "
                        f"asserts): {silent}")
