"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`): MFCs land on the nodes the plan
says and the tiny GRPO run completes. Runs in a subprocess, because the rest of the suite shares
one local Ray instance and a Cluster brings its own head."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_two_node_cluster_places_mfcs_on_their_planned_nodes(tmp_path):
    pytest.importorskip("ray")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_two_node_run.py")), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert len(r["nodes"]) == 2
    node0, node1 = r["device_nodes"]["0"], r["device_nodes"]["2"]
    assert node0 != node1 and r["device_nodes"]["1"] == node0 and r["device_nodes"]["3"] == node1
    assert node0 == r["head"]  # plan node 0 asks for the head node
    assert r["dock_nodes"] and set(r["dock_nodes"]) == {r["head"]}, "the dock on the driver's node"
    groups = r["groups"]
    assert groups["actor@node0:0"] == ["actor_rollout"] and groups["ref@node0:1"] == ["ref_log_prob"]
    assert groups["actor@node1"] == ["actor_log_prob", "actor_train"]
    assert r["worker_nodes"]["actor@node0:0"] == [node0] and r["worker_nodes"]["ref@node0:1"] == [node0]
    assert r["worker_nodes"]["actor@node1"] == [node1, node1]  # both DDP ranks on the second node
    assert len(r["rewards"]) == 2 and r["versions"] == [1, 2]
