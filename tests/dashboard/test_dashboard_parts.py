"""The dashboard's parts on their own: the snapshot over a real dock, the HTTP server, the report
file, the CLI's errors, and a busy port stopping a run before anything starts."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dashboard import (SNAPSHOT_FILE, TIMELINE_STEPS, DashboardServer, DashboardState, load_snapshot,
                                    render_page, write_report)
from mindspeed_rl.trainer import Trainer, TrainingError
from mindspeed_rl.transfer_dock import TransferDock

ROOT = Path(__file__).resolve().parents[2]
INFO = {"title": "unit", "consumers": ["gen", "train"], "columns": ["prompts", "responses"], "rows_per_step": 8,
        "stages": ["gen", "train"], "lanes": [{"stage": "gen", "worker": "g/0"}, {"stage": "train", "worker": "t/0"}]}


def _rows(n: int) -> list[torch.Tensor]:
    return [torch.arange(3, dtype=torch.int64) + r for r in range(n)]


def _step(dock: TransferDock, state: DashboardState, step: int, train_rows: int = 8, end: bool = True) -> None:
    state.begin_step(step)
    dock.put_experience({"prompts": _rows(8)}, range(8), producer="dataset", worker="driver")
    _, rows = dock.get_experience("gen", ["prompts"], 8, worker="g/0")
    dock.put_experience({"responses": _rows(8)}, rows, producer="gen", worker="g/0")
    dock.get_experience("train", ["responses"], train_rows, worker="t/0")
    if end:
        state.end_step(step, [{"stage": "train", "worker": "t/0", "t_start": time.time() - 0.1, "t_end": time.time()}])
        state.add_record({"step": step, "reward/mean": 0.1 * step, "weight_sync/actor_checksum": "ab12"})
        dock.clear()


def test_snapshot_keeps_the_last_steps_and_the_final_consumption(tmp_path):
    dock = TransferDock(["prompts", "responses"], ["gen", "train"], prompts_num=2, n_samples_per_prompt=4)
    state = DashboardState(INFO)
    assert state.snapshot()["status"] == "starting"
    state.attach(dock)
    for step in range(5):
        _step(dock, state, step)
    snap = state.snapshot()
    json.dumps(snap)  # plain JSON
    assert snap["status"] == "running" and snap["step"] == 4
    assert {e["step"] for e in snap["events"]} == set(range(5 - TIMELINE_STEPS, 5))
    assert sorted(int(s) for s in snap["steps"]) == list(range(5 - TIMELINE_STEPS, 5))
    # the step's end as it was before clear(), although the dock itself is cleared now
    assert snap["consumers"] == {"gen": {"taken": 8, "total": 8}, "train": {"taken": 8, "total": 8}}
    assert dock.get_consumer_status()["gen"]["taken"] == 0
    assert [(e["op"], e["stage"], e["worker"], e["rows"]) for e in snap["events"] if e["step"] == 4] == [
        ("put", "dataset", "driver", 8), ("get", "gen", "g/0", 8), ("put", "gen", "g/0", 8), ("get", "train", "t/0", 8)]
    assert [r["step"] for r in snap["history"]] == [0, 1, 2, 3, 4]
    assert "weight_sync/actor_checksum" not in snap["history"][0]
    state.finish()
    assert state.snapshot()["status"] == "finished"
    assert state.snapshot()["consumers"]["train"]["taken"] == 8, "finish keeps the last step's end"
    state.save(tmp_path)
    assert load_snapshot(tmp_path)["events"] == state.snapshot()["events"]


def test_a_failed_run_shows_where_its_step_stood(tmp_path):
    dock = TransferDock(["prompts", "responses"], ["gen", "train"], prompts_num=2, n_samples_per_prompt=4)
    state = DashboardState(INFO)
    state.attach(dock)
    _step(dock, state, 0)
    _step(dock, state, 1, train_rows=3, end=False)  # the run dies with train at 3 of 8
    state.finish(RuntimeError("stage 'train' died"))
    snap = state.snapshot()
    assert snap["status"] == "failed" and snap["error"] == "RuntimeError: stage 'train' died"
    assert snap["consumers"]["train"] == {"taken": 3, "total": 8}
    assert [e["rows"] for e in snap["events"] if e["step"] == 1 and e["stage"] == "train"] == [3]


@pytest.mark.slow
@pytest.mark.ray
def test_a_dead_dock_leaves_the_last_view_and_says_why(ray_session):
    from mindspeed_rl.transfer_dock import create_transfer_dock
    dock = create_transfer_dock(["prompts"], ["gen"], 2, 4)
    state = DashboardState(INFO)
    state.attach(dock)
    state.begin_step(0)
    dock.put_experience({"prompts": _rows(8)}, range(8))
    dock.get_experience("gen", ["prompts"], 5)
    state.snapshot()
    assert state.consumers["gen"]["taken"] == 5
    dock.close()
    ray_session.kill(dock.actor, no_restart=True)
    time.sleep(0.6)  # past the snapshot's rate limit
    t0 = time.time()
    snap = state.snapshot()
    assert time.time() - t0 < 10
    assert snap["consumers"]["gen"]["taken"] == 5 and snap["dock_error"], snap["dock_error"]


def test_server_serves_the_page_the_state_and_a_report():
    state = DashboardState(INFO)
    server = DashboardServer(state.snapshot, port=0)
    url = server.start()
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url) and server.port > 0
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'data-mode="live"' in page and "{{" not in page
        assert json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())["info"]["title"] == "unit"
        report = urllib.request.urlopen(url + "report.html", timeout=10).read().decode()
        assert 'data-mode="report"' in report and '"title":"unit"' in report
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "nothing", timeout=10)
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_report_embeds_any_text_safely(tmp_path):
    nasty = "</script><script>alert(1)</script> {{JS}} <!-- \u2028"
    snap = DashboardState({**INFO, "title": nasty}).snapshot()
    snap["error"] = nasty
    path = write_report(snap, tmp_path)
    html = path.read_text()
    assert html.count("</script>") == 2, "only the page's own two script elements end"
    embedded = html.split('<script type="application/json" id="snapshot">', 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded) == snap
    assert "{{" not in render_page(None)


def test_cli_says_what_is_missing(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "cli" / "dashboard.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{tmp_path / SNAPSHOT_FILE} does not exist" in proc.stderr and "trainer.report=true" in proc.stderr


def _saved_snapshot(run_dir: Path) -> bytes:
    state = DashboardState(INFO)
    state.add_record({"step": 0, "reward/mean": 0.5})
    state.finish()
    return state.save(run_dir).read_bytes()


@pytest.mark.parametrize("corrupt, what", [
    (lambda good: good[:len(good) // 2], "bytes; it does not end with '}': cut short?)"),
    (lambda good: b"", "is not valid JSON (Expecting value: line 1, column 1 of its 0 bytes; it does not end"),
    (lambda good: b"\xff\xfe\x00\x01" + good, "is not a snapshot (not UTF-8 text: byte 0 of"),
    (lambda good: b"[1, 2]", "is not a snapshot this version can show: it holds a list, not an object"),
    (lambda good: good.replace(b'"history":[', b'"history":"x","old":['), "field 'history' is a string, not a list"),
    (lambda good: good.replace(b'"format":1', b'"format":7'), "snapshot format 7, this version reads 1"),
], ids=["truncated", "empty", "binary", "list", "wrong-type", "other-version"])
def test_cli_names_a_corrupt_dashboard_json(tmp_path, corrupt, what):
    path = tmp_path / SNAPSHOT_FILE
    path.write_bytes(corrupt(_saved_snapshot(tmp_path)))
    proc = subprocess.run([sys.executable, str(ROOT / "cli" / "dashboard.py"), str(tmp_path), "--write-only"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"dashboard: {path} ") and what in proc.stderr, proc.stderr
    assert "report.html" in proc.stderr, "it says what to do instead"
    assert not (tmp_path / "report.html").exists(), "nothing is written from a bad snapshot"
    with pytest.raises(ValueError):
        load_snapshot(tmp_path)


def test_cli_says_when_it_cannot_write_the_report(tmp_path):
    _saved_snapshot(tmp_path)
    (tmp_path / "report.html").mkdir()  # os.replace onto a directory fails, as an unwritable directory would
    proc = subprocess.run([sys.executable, str(ROOT / "cli" / "dashboard.py"), str(tmp_path), "--write-only"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("dashboard: cannot write ") and "somewhere writable" in proc.stderr, proc.stderr


def test_cli_writes_the_report_from_dashboard_json(tmp_path):
    state = DashboardState(INFO)
    state.add_record({"step": 0, "reward/mean": 0.5})
    state.finish()
    state.save(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "cli" / "dashboard.py"), str(tmp_path), "--write-only"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    html = (tmp_path / "report.html").read_text()
    assert '"reward/mean":0.5' in html


def test_a_busy_port_stops_the_run_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        trainer = Trainer(config_from_dict({"trainer": {"output_dir": str(tmp_path / "run"), "dashboard_port": port}}))
        t0 = time.time()
        with pytest.raises(TrainingError) as err:
            trainer.run()
    assert time.time() - t0 < 5
    msg = str(err.value)
    assert f"trainer.dashboard_port={port}" in msg and "0 for any free one" in msg and "trainer.dashboard=false" in msg
    assert msg.replace(str(port), "8266") in (ROOT / "docs" / "dashboard.md").read_text(), "docs quote the message"
    assert not trainer.docks and not trainer.workers, "nothing started"
