"""Two Ray nodes as a user starts them (`_ray_nodes.py`: `ray start --head`, and a second node with its own
working directory, /dev/shm and a private mount), the default run joining them by `placement.ray_address` from
the command line: refused where a node does not see the output directory; trained, checkpointed and exported
where it does, with the MFCs on the nodes the plan names; killed after a checkpoint, leaving nothing in either
node's /dev/shm; resumed, equal to the uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._ray_nodes import TwoNodes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
defaults:
  - grpo_tiny
  - _self_
trainer:
  total_steps: 4
  save_interval: 2
  progress: false
  logger: [jsonl]
  plot: false
  dashboard: false
  report: false
  log_samples: 0
  stage_timeout_s: 60
rl_config:
  guarantee_order: true
placement:
  mode: mesh
  n_nodes: 2
  n_devices_per_node: 1
  device_kind: cpu
  cpus_per_device: 1
  mfcs:                                 # rollout on node 0; the actor's log-probs and training, DDP, on both
    actor_rollout: {mesh: 0}
    actor_log_prob: {mesh: all, dp: 2}
    actor_train: {mesh: all}
"""
KEYS = ("actor/pg_loss", "reward/mean", "actor/grad_norm", "weight_version")


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow_budget(120, reason="starts two Ray nodes (about 8 s), then four runs of the tiny job on them "
                                     "(about 20 s each, most of it starting Ray workers): one refused before any "
                                     "model loads, one of 4 steps, one killed after its first checkpoint, its resume")
def test_two_nodes_refuse_a_private_output_dir_then_train_save_survive_a_kill_and_resume_exactly(tmp_path):
    if not __import__("shutil").which("unshare"):
        pytest.fail("unshare (util-linux) is missing: it gives the second node its own /dev/shm and mounts")
    (tmp_path / "two_nodes.yaml").write_text(CONFIG)
    with TwoNodes(tmp_path) as nodes:
        shm_before = nodes.shm()

        def train(out: Path, *overrides: str, wait: bool = True):
            argv = [sys.executable, str(ROOT / "cli" / "train_grpo.py"), "--config-dir", str(tmp_path),
                    "--config-name", "two_nodes", f"trainer.output_dir={out}",
                    f"placement.ray_address={nodes.address}", *overrides]
            env = {**nodes.env(), "PYTHONPATH": str(ROOT)}
            if wait:
                return subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
            return subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)

        # the second node does not see this directory (its own mount there): refused before any model loads
        refused = train(nodes.private_dir / "run")
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert "do not see the driver's output directory" in refused.stderr, refused.stderr[-2000:]
        assert "/1" in refused.stderr.split("do not see")[1] and "Traceback" not in refused.stderr

        full_dir, split_dir = tmp_path / "shared" / "full", tmp_path / "shared" / "split"
        full = train(full_dir)
        assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-3000:]
        assert (full_dir / "hf" / "final" / "model.safetensors").exists()
        plan = json.loads((full_dir / "plan.json").read_text())
        landed, devices = plan["landed"]["workers"], plan["landed"]["devices"]
        trainer = next(g for g, p in plan["groups"].items() if "actor_train" in p["mfcs"])
        rollout = next(g for g, p in plan["groups"].items() if "actor_rollout" in p["mfcs"])
        assert plan["groups"][trainer]["mfcs"] == ["actor_log_prob", "actor_train"]
        assert devices["0"] != devices["1"]
        assert [landed[f"{trainer}/{r}"]["node_id"] for r in (0, 1)] == [devices["0"], devices["1"]], "split"
        assert landed[f"{rollout}/0"]["node_id"] == devices["0"]

        killed = train(split_dir, wait=False)
        latest = split_dir / "checkpoints" / "latest.json"
        deadline = time.monotonic() + 180
        while not latest.exists():
            assert killed.poll() is None and time.monotonic() < deadline, killed.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        during = nodes.shm()
        assert any(f.startswith("msrl-") for f in during["head"]), f"the dock's shared memory on its node: {during}"
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert json.loads(latest.read_text())["step"] < 4, "killed before the end"
        deadline = time.monotonic() + 60     # Ray ends the job's actors; each node's sweeper then cleans up
        while nodes.shm() != shm_before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert nodes.shm() == shm_before, "a killed driver left shared memory behind"

        resumed = train(split_dir, "trainer.resume=true")
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert (split_dir / "hf" / "final" / "model.safetensors").exists()
        by_step = {r["step"]: r for r in metrics(split_dir)}
        assert sorted(by_step) == list(range(4))
        assert [[by_step[s][k] for k in KEYS] for s in range(4)] == [[r[k] for k in KEYS] for r in metrics(full_dir)]
        assert nodes.shm() == shm_before
