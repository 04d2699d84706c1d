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


def test_mean_at_and_a_chosen_metric():
    values = [0.0] * 10 + [1.0] * 10
    assert lc.mean_at(values, 9) == 0.0 and lc.mean_at(values, 14) == 0.5 and lc.mean_at(values, 19) == 1.0
    assert lc.mean_at(values, 20) is None, "past the run's end"
    rows = [{"reward/mean": -5.0, "reward/rule_mean": v, "timing/step": 1.0} for v in values]
    s = lc.summarize(rows, 0.8, metric="reward/rule_mean")
    assert s["reward_first10"] == 0.0 and s["reward_last10"] == 1.0 and s["reaches_target_at_step"] == 17
    with pytest.raises(SystemExit, match="no record holds 'eval/accuracy'"):
        lc.summarize(rows, 0.8, metric="eval/accuracy")


_ss_spec = importlib.util.spec_from_file_location("seed_spread",
                                                  Path(__file__).parents[2] / "benchmarks" / "seed_spread.py")
ss = importlib.util.module_from_spec(_ss_spec)
_ss_spec.loader.exec_module(ss)


def test_seed_spread_parses_seeds_and_picks_the_entry_point(tmp_path):
    assert ss.parse_seeds("1-5") == [1, 2, 3, 4, 5]
    assert ss.parse_seeds("3,1-2,3") == [3, 1, 2]
    with pytest.raises(SystemExit, match="give seeds as"):
        ss.parse_seeds("a-b")
    with pytest.raises(SystemExit, match="no seed"):
        ss.parse_seeds(",")
    assert ss.parse_steps("39, 59") == [39, 59] and ss.parse_steps(None) == []
    assert [ss.cli_for(n) for n in ("grpo_tiny", "ppo_tiny", "remax_tiny", "rm_tiny", "ppo_tiny_rm")] == \
        ["train_grpo", "train_ppo", "train_remax", "train_rm", "train_ppo"]
    (tmp_path / "odd.yaml").write_text("rl_config: {algorithm: dpo}\n")
    with pytest.raises(SystemExit, match="give --cli"):
        ss.cli_for("odd", configs=tmp_path)
    with pytest.raises(SystemExit, match="no .*missing.yaml"):
        ss.cli_for("missing", configs=tmp_path)
    cmd = ss.seed_command("train_ppo", "ppo_tiny", 3, 40, tmp_path / "s3", ["trainer.save_interval=10"])
    assert cmd[1:6] == ["cli/train_ppo.py", "--config-name", "ppo_tiny", "trainer.seed=3", "trainer.total_steps=40"]
    assert cmd[-1] == "trainer.save_interval=10" and "trainer.save_interval=0" in cmd, "the user's override comes last"


def test_seed_spread_rows_spread_and_table():
    seed_rows = []
    for seed in (1, 2, 3):
        rows = [{"reward/mean": min(1.0, 0.01 * i * seed), "timing/step": 0.5} for i in range(50)]
        seed_rows.append(ss.seed_row(seed, rows, "reward/mean", 0.8, [9, 49, 60], wall_s=10.0 * seed))
    assert seed_rows[0] == {"seed": 1, "first10": 0.045, "last10": 0.445, "reaches_target_at": None,
                            "mean10_at_9": 0.045, "mean10_at_49": 0.445, "mean10_at_60": None,
                            "steps": 50, "wall_s": 10.0, "steps_s": 25.0}
    also = ss.seed_row(1, [{"reward/mean": 0.5, "flag": float(i % 2)} for i in range(20)], "reward/mean", 0.8, [],
                       None, also=["flag", "missing"])
    assert (also["flag_last10"], also["flag_sum"], also["missing_last10"]) == (0.5, 10.0, None)
    assert seed_rows[2]["reaches_target_at"] == 32  # 0.03 x (22..31) averages 0.795, 0.03 x (23..32) 0.825
    assert ss.spread([3, None, 1]) == {"min": 1, "median": 3, "max": None}, "never reached counts as largest"
    assert ss.spread([1, 2, 4, 10]) == {"min": 1, "median": 3.0, "max": 10}
    assert ss.spread([1, 2, None, None])["median"] is None
    spreads = ss.summary_rows(seed_rows)
    assert spreads["wall_s"] == {"min": 10.0, "median": 20.0, "max": 30.0}
    lines = ss.table(seed_rows, spreads)
    assert lines[0].startswith("| seed | first10 | last10 | reaches_target_at | mean10_at_9 |")
    assert lines[2].startswith("| 1 | 0.045 | 0.445 | never |")
    assert [x.split(" | ")[0] for x in lines[-3:]] == ["| min", "| median", "| max"]


def test_mean_at_step_reads_a_metric_some_steps_record():
    """eval/accuracy every 100 steps: the value at an evaluated step, None in a window without one."""
    rows = [{"step": i, **({"eval/accuracy": i / 1000} if i % 100 == 99 else {})} for i in range(300)]
    assert lc.mean_at_step(rows, "eval/accuracy", 199) == 0.199 and lc.mean_at_step(rows, "eval/accuracy", 299) == 0.299
    assert lc.mean_at_step(rows, "eval/accuracy", 150) is None
