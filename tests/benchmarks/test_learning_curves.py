"""benchmarks/learning_curves.py on hand-made metrics: the 10-step means, the step a run first reaches
the target, the reward parts, the table and the JSON."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("learning_curves",
                                               Path(__file__).parents[2] / "benchmarks" / "learning_curves.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


def test_rolling_means_and_the_first_step_at_the_target():
    assert lc.rolling([0, 10, 20], window=2) == [0, 5, 15]
    assert lc.rolling([1.0] * 3) == [1.0, 1.0, 1.0]
    values = [0.0] * 10 + [1.0] * 10
    assert lc.first_reaching(values, 0.8) == 17  # the mean of steps 8..17 is 0.8
    assert lc.first_reaching(values, 1.1) is None


def _write(run: Path, rewards, parts=True):
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for i, r in enumerate(rewards):
            rec = {"step": i, "reward/mean": r, "timing/step": 0.5 + (i % 2)}
            if parts:
                rec.update({"reward/call_mean": min(1.0, 2 * r), "reward/answer_mean": r / 2})
            f.write(json.dumps(rec) + "\n")


def test_summary_table_json_and_figure(tmp_path, capsys):
    _write(tmp_path / "a", [0.0] * 10 + [1.0] * 20)
    _write(tmp_path / "b", [0.2] * 30, parts=False)
    out = tmp_path / "s.json"
    lc.main([f"tool={tmp_path / 'a'}", f"none={tmp_path / 'b'}", "--json", str(out), "--out", str(tmp_path / "f.png")])
    s = json.loads(out.read_text())
    assert s["tool"] == {"steps": 30, "steps_s": 30.0, "median_step_s": 1.0, "reward_first10": 0.0,
                         "reward_last10": 1.0, "reaches_target_at_step": 17, "answer_mean_last10": 0.5,
                         "call_mean_last10": 1.0}
    assert s["none"]["reaches_target_at_step"] is None and "call_mean_last10" not in s["none"]
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | steps |") and table[2].startswith("| tool | 30 |")
    assert table[3].endswith("| - | - |"), "a run without the parts shows dashes"
    assert (tmp_path / "f.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        lc.main([f"x={tmp_path / 'missing'}"])
    with pytest.raises(SystemExit, match="label=output_dir"):
        lc.main([str(tmp_path / "a")])
