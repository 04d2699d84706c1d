"""`python cli/train_grpo.py`: a bad config fails fast (exit 2, no Ray), a dry run prints the graph
and the plan and exits 0. Each run is a fresh interpreter (~4 s: Hydra, torch import)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from .helpers import DOCS, REPO

CLI = str(REPO / "cli" / "train_grpo.py")
FAST_S = 20.0

# Imported first by the child interpreter (it is on PYTHONPATH): reports at exit whether Ray ran.
PROBE = '''import atexit, sys
def _report():
    ray = sys.modules.get("ray")
    sys.stderr.write("[ray-probe] initialized=%s\\n" % bool(ray is not None and ray.is_initialized()))
atexit.register(_report)
'''


def run_cli(tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    probe = tmp_path / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(probe), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                    else []))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, CLI, *overrides], cwd=work, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, time.monotonic() - t0


@pytest.mark.slow
def test_bad_config_fails_fast_without_ray(tmp_path):
    proc, seconds = run_cli(tmp_path, "actor_config.ppo_mini_batch_size=6", "generate_config.top_p=2")
    assert proc.returncode == 2, proc.stderr
    assert "config error: invalid config:" in proc.stderr
    assert "actor_config.ppo_mini_batch_size=6" in proc.stderr and "generate_config.top_p=2.0" in proc.stderr
    assert "[ray-probe] initialized=False" in proc.stderr, proc.stderr
    assert seconds < FAST_S, f"took {seconds:.1f} s"
    assert not any((tmp_path / "cwd").iterdir()), "a failed config must write nothing"
    # docs/configs.md quotes exactly this output
    block = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("[ray-probe]"))
    assert block in DOCS.read_text()


@pytest.mark.slow
def test_misspelled_key_added_with_plus_gets_did_you_mean(tmp_path):
    proc, seconds = run_cli(tmp_path, "+trainer.total_step=3")
    assert proc.returncode == 2, proc.stderr
    assert "trainer.total_step: unknown key (did you mean 'total_steps'?)" in proc.stderr
    assert seconds < FAST_S


def test_old_size_key_on_the_command_line_says_what_it_became(tmp_path):
    """Without `+`, Hydra would refuse an old key as 'not in struct' before our loader saw it."""
    proc, _ = run_cli(tmp_path, "rl_config.n_samples_per_prompt=4", "actor_config.mini_batch_size=16",
                      "generate_config.micro_batch_size=64")
    assert proc.returncode == 2, proc.stderr
    assert "not in struct" not in proc.stderr and "Traceback" not in proc.stderr
    assert "actor_config.mini_batch_size=16: renamed: it is now actor_config.ppo_mini_batch_size" in proc.stderr
    assert "set actor_config.ppo_mini_batch_size=4 (16 rows / rl_config.n_samples_per_prompt=4)" in proc.stderr
    assert "generate_config.micro_batch_size=64: renamed: it is now generate_config.micro_batch_size_per_device" \
        in proc.stderr
    assert "[ray-probe] initialized=False" in proc.stderr


@pytest.mark.slow
def test_dry_run_prints_graph_and_plan_and_exits_0(tmp_path):
    proc, seconds = run_cli(tmp_path, "trainer.dry_run=true", "actor_config.kl_loss_coef=0.001",
                            "placement.mode=disaggregated", "+placement.groups.actor.dp=2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dataflow graph 'grpo': 6 MFCs" in out
    assert "placement plan" in out
    for group in ("rollout", "actor", "ref", "rule"):
        assert any(line.startswith(group + " ") for line in out.splitlines()), (group, out)
    assert "total: 2.5 CPU, 0 GPU, 0 NPU; 128 rows per step" in out
    assert "stage order (blocking mode): actor_rollout -> rule_reward" in out
    assert "dry run: model and data paths were not opened" in out
    assert "[ray-probe] initialized=False" in proc.stderr, proc.stderr
    assert seconds < FAST_S, f"took {seconds:.1f} s"
    written = [p.relative_to(tmp_path / "cwd") for p in (tmp_path / "cwd").rglob("*") if p.is_file()]
    assert [str(p) for p in written] == ["outputs/grpo_tiny/plan.json"], "a dry run writes plan.json only"
    import json
    plan = json.loads((tmp_path / "cwd" / written[0]).read_text())
    assert plan["groups"]["actor"]["dp"] == 2 and plan["groups"]["actor"]["actors"] == 2
    assert plan["stage_order"][:2] == ["actor_rollout", "rule_reward"]
