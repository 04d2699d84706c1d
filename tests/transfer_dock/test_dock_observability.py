"""What the dashboard and Prometheus read from the dock: worker labels in the event log, and the
counters handed to `ray.util.metrics` by the actor's timer (and, where Ray's metrics agent runs,
scraped from it)."""
from __future__ import annotations

import pickle
import re
import time
import urllib.request

import pytest
import torch

from mindspeed_rl.transfer_dock import TransferDock
from mindspeed_rl.transfer_dock.metrics import RAY_METRICS


def _rows(n: int, width: int = 3) -> list[torch.Tensor]:
    return [torch.arange(width, dtype=torch.int64) + r for r in range(n)]


def test_events_carry_stage_and_worker():
    dock = TransferDock(["a", "b"], ["c"], prompts_num=4)
    dock.put_experience({"a": _rows(4)}, range(4), producer="rollout", worker="gen/1")
    dock.get_experience("c", ["a"], 2, worker="train/0")
    dock.put_experience({"b": _rows(2)}, [0, 1])  # no labels: producer is the columns, worker None
    events = dock.get_event_log()
    assert [(e["op"], e["stage"], e["worker"], e["rows"]) for e in events] == [
        ("put", "rollout", "gen/1", 4), ("get", "c", "train/0", 2), ("put", "b", None, 2)]


@pytest.fixture
def ray_dock(ray_session):
    from mindspeed_rl.transfer_dock import create_transfer_dock
    made = []

    def make(**kwargs):
        client = create_transfer_dock(["a", "b"], ["c1", "c2"], 4, 2, **kwargs)
        made.append(client)
        return client
    yield make
    for client in made:
        client.close()
        ray_session.kill(client.actor, no_restart=True)


@pytest.mark.slow
@pytest.mark.ray
def test_client_labels_its_calls_with_its_worker(ray_session, ray_dock):
    dock = ray_dock()
    dock.worker = "rollout/0"
    dock.put_experience({"a": _rows(8)}, range(8), producer="actor_rollout")
    reader = pickle.loads(pickle.dumps(dock))  # as a worker receives it, then labels its own copy
    reader.worker = "train/1"
    reader.get_experience("c1", ["a"], 4, blocking=True, timeout=5)
    assert dock.worker == "rollout/0"
    events = dock.get_event_log()
    assert [(e["op"], e["stage"], e["worker"]) for e in events] == [
        ("put", "actor_rollout", "rollout/0"), ("get", "c1", "train/1")]


@pytest.mark.slow
@pytest.mark.ray
def test_actor_hands_its_counters_to_ray_metrics(ray_session, ray_dock):
    dock = ray_dock(metrics_interval_s=0.1, inline_bytes=1 << 40)
    dock.put_experience({"a": _rows(8)}, range(8), producer="p")
    dock.get_experience("c1", ["a"], 6)
    dock.get_experience("c2", ["b"], 2)  # nothing ready: an empty call
    want = dock.get_metrics()
    deadline = time.time() + 10
    while True:
        status = dock.metrics_export_status()
        sent = status["sent"]
        if all(sent.get(k) == want[k] for k in ("consumer/c1/rows_taken", "consumer/c2/empty_calls", "bytes_in",
                                                  "column/a/step_rows_written")):
            break
        assert time.time() < deadline, f"not exported within 10 s: {status}"
        time.sleep(0.05)
    assert status["error"] is None and status["running"] and status["updates"] >= 1
    assert sent["consumer/c1/rows_taken"] == 6 and sent["column/a/rows_written"] == 8
    assert sent["consumer/c2/empty_calls"] == 1 and sent["consumer/c1/step_rows_taken"] == 6
    # every exported leaf has a value for every consumer / column (at zero too): Grafana sees them all
    leaves = {k.rsplit("/", 1)[-1] if "/" in k else k for k in sent}
    assert leaves == set(RAY_METRICS)
    dock.clear()
    deadline = time.time() + 10
    while dock.metrics_export_status()["sent"].get("consumer/c1/step_rows_taken") != 0:
        assert time.time() < deadline, "the per-step gauges did not follow clear()"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.ray
def test_metrics_interval_zero_turns_export_off(ray_session, ray_dock):
    dock = ray_dock(metrics_interval_s=0)
    dock.put_experience({"a": _rows(8)}, range(8))
    status = dock.metrics_export_status()
    assert status == {"interval_s": 0.0, "running": False, "updates": 0, "sent": {}, "error": None}


def _metrics_agent_port(ray_session):
    """The port of Ray's Prometheus endpoint, or None with the reason it is not there."""
    from ray._private import utils
    missing = utils.get_dashboard_dependency_error()
    if missing is not None:
        return None, (f"Ray's metrics agent is not running: this is a minimal Ray install ({missing}); "
                      "install ray[default] to export metrics to Prometheus")
    port = ray_session._private.worker.global_worker.node.metrics_export_port
    if not port or port <= 0:
        return None, "Ray's metrics agent has no export port in this Ray instance"
    return port, ""


@pytest.mark.slow
@pytest.mark.ray
def test_counters_reach_rays_prometheus_endpoint(ray_session, ray_dock):
    port, why = _metrics_agent_port(ray_session)
    if port is None:
        pytest.skip(why)
    dock = ray_dock(metrics_interval_s=0.1)
    dock.put_experience({"a": _rows(8)}, range(8))
    dock.get_experience("c2", ["a"], 6)
    pattern = re.compile(r'^ray_transfer_dock_rows_taken_total\{[^}]*consumer="c2"[^}]*\} 6(\.0)?$', re.M)
    deadline = time.time() + 60  # the agent exports every few seconds
    text = ""
    while not pattern.search(text):
        assert time.time() < deadline, "ray_transfer_dock_rows_taken_total{consumer=c2} 6 never appeared:\n" + \
            "\n".join(line for line in text.splitlines() if "transfer_dock" in line)
        time.sleep(1.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    assert re.search(r'^ray_transfer_dock_step_rows_written\{[^}]*column="a"[^}]*\} 8(\.0)?$', text, re.M)
