"""Backends from outside the package (`trainer.plugins`): a module that is not in the repository registers a
rollout and a train backend, each extending a built-in engine, and the tiny job runs on them with no edit to
the package, giving the built-ins' losses under rl_config.guarantee_order."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "cli" / "train_grpo.py"

PLUGIN = textwrap.dedent('''
    """A user's backends: the built-in engines, counting their calls in a file (to prove they ran)."""
    import os

    from mindspeed_rl.engines import (HFRolloutEngine, TorchTrainEngine, register_rollout_backend,
                                      register_train_backend)


    def _mark(what):
        with open(os.environ["PLUGIN_MARKS"], "a") as f:
            f.write(what + "\\n")


    class CountingRollout(HFRolloutEngine):
        def generate(self, prompts, params, seeds):
            _mark("generate")
            return super().generate(prompts, params, seeds)


    class CountingTrain(TorchTrainEngine):
        def train_step(self, micro_batches, loss_fn):
            _mark("train_step")
            return super().train_step(micro_batches, loss_fn)


    register_rollout_backend("counting_hf", CountingRollout, doc="hf, counting its generate calls")
    register_train_backend("counting_torch", CountingTrain, doc="torch, counting its optimizer steps")
''')


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), str(ROOT)]),
           "PLUGIN_MARKS": str(tmp_path / "marks.txt")}
    proc = subprocess.run([sys.executable, str(CLI), f"trainer.output_dir={out}", "trainer.total_steps=3",
                           "trainer.dashboard=false", "trainer.report=false", "trainer.plot=false",
                           "trainer.progress=false", "rl_config.guarantee_order=true", *overrides],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "plan.json").is_file()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.slow_budget(60, reason="two CLI runs of the tiny job, each starting its own Ray, to load the plugin")
def test_a_plugin_outside_the_package_runs_the_tiny_job_with_the_builtins_losses(tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "my_backends.py").write_text(PLUGIN)
    builtin = _run(tmp_path, "builtin")
    plugged = _run(tmp_path, "plugged", "trainer.plugins=[my_backends]", "generate_config.backend=counting_hf",
                   "actor_config.backend=counting_torch")
    marks = (tmp_path / "marks.txt").read_text().split()
    assert marks.count("generate") >= 3 and marks.count("train_step") >= 3, marks  # the plugin's engines ran
    plan = json.loads((tmp_path / "plugged" / "plan.json").read_text())
    assert {g["rollout_backend"] for g in plan["groups"].values()} >= {"counting_hf"}
    assert {g["train_backend"] for g in plan["groups"].values()} >= {"counting_torch"}
    for key in ("actor/pg_loss", "reward/mean", "actor/entropy"):
        assert [r[key] for r in plugged] == [r[key] for r in builtin], key


def test_a_plugin_that_does_not_import_is_refused_naming_it(tmp_path):
    from mindspeed_rl.config import ConfigError
    from mindspeed_rl.planning import make_plan
    from mindspeed_rl.config import config_from_dict
    with pytest.raises(ConfigError) as e:
        make_plan(config_from_dict({"trainer": {"plugins": ["no_such_module_xyz"]}}), check_files=False)
    assert "trainer.plugins: 'no_such_module_xyz' failed to import" in str(e.value)


def test_register_refuses_what_is_not_an_engine():
    from mindspeed_rl.engines import register_train_backend
    with pytest.raises(TypeError, match="must subclass TrainEngine"):
        register_train_backend("bad", dict)
    with pytest.raises(TypeError, match="unknown fields"):
        register_train_backend("bad", "x.y:Z", colour="red")
