"""The dashboard as a person sees it: a real tiny run, its pages opened in headless Chromium.

One 3-step run (shared `ray_session`). Its reward worker holds still at the first row of step 1
(`gated_rewards.py`), so the live page can be read at a point whose numbers are known: rollout and
both log-prob stages have taken the whole step, the reward stage one micro-batch, the stages after
it nothing. Then the run finishes, and report.html and `cli/dashboard.py` show the finished run.
Screenshots of the live page and the report go to the test's temporary directory (and, with
MINDSPEED_RL_SCREENSHOTS=<dir>, there too).
"""
from __future__ import annotations

import json
import math
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dataflow import get_algorithm
from mindspeed_rl.trainer import Trainer

from . import gated_rewards
from .browser import CHROMIUM, NO_CHROMIUM, dump_dom, parse, png_size, read_page, screenshot

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
HELD_STEP = 1


def _api(url: str) -> dict:
    with urllib.request.urlopen(url + "api/state", timeout=10) as r:
        return json.loads(r.read())


def _expected_when_held(cfg) -> tuple[dict, dict]:
    """Consumption while the reward stage holds its first micro-batch of a step: a stage has taken
    every row when all its inputs' producers have, the rest none, and the reward stage two
    micro-batches: the one it holds and the next, which its loop asked for before computing
    (`run_stage_loop` prefetches one micro-batch ahead)."""
    mfcs, dataset_keys = get_algorithm(cfg.rl_config.algorithm)
    rows = cfg.rl_config.prompts_per_step * cfg.rl_config.n_samples_per_prompt
    producer = {**{c: "dataset" for c in dataset_keys}, **{c: m.name for m in mfcs for c in m.output_keys}}
    done = {"dataset"}
    taken = {}
    for m in mfcs:  # in the graph's order
        if m.name == "rule_reward":
            taken[m.name] = min(rows, 2 * cfg.rl_config.dock_micro_batch_size)
        elif all(producer[c] in done for c in m.input_keys):
            taken[m.name] = rows
            done.add(m.name)
        else:
            taken[m.name] = 0
    written = {c: rows if p in done else 0 for c, p in producer.items()}
    return taken, written


def _micro_batches(cfg) -> dict[str, int]:
    """Micro-batches (non-empty gets) per stage per step, from the batch sizes in the config."""
    rows = cfg.rl_config.prompts_per_step * cfg.rl_config.n_samples_per_prompt
    size = {"actor_rollout": cfg.generate_config.micro_batch_size_per_device,
            "rule_reward": cfg.rl_config.dock_micro_batch_size,
            "ref_log_prob": cfg.ref_config.log_prob_micro_batch_size_per_device,
            "actor_log_prob": cfg.actor_config.log_prob_micro_batch_size_per_device,
            "compute_advantage": cfg.rl_config.dock_micro_batch_size,
            "actor_train": cfg.actor_config.ppo_micro_batch_size_per_device}
    return {stage: math.ceil(rows / s) for stage, s in size.items()}


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    cfg = config_from_dict({
        "trainer": {"total_steps": STEPS, "output_dir": str(tmp / "run"), "progress": False,
                    "logger": ["jsonl", "tensorboard"], "plot": False, "save_interval": 0, "stage_timeout_s": 60,
                    "dashboard": True, "dashboard_port": 0, "report": True},
        "rl_config": {"reward_fn": "tests.dashboard.gated_rewards:digits_paused_in_second_step"}})
    gate = gated_rewards.Gate.options(name=gated_rewards.GATE_NAME).remote()
    trainer = Trainer(cfg)
    outcome: dict = {}

    def train():
        try:
            outcome["history"] = trainer.run()
        except BaseException as e:  # re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=train, name="trainer", daemon=True)
    t0 = time.time()
    thread.start()
    out: dict = {"cfg": cfg, "tmp": tmp, "run_dir": tmp / "run"}
    try:
        deadline = time.time() + 60
        while trainer.dashboard_server is None and thread.is_alive() and time.time() < deadline:
            time.sleep(0.05)
        assert trainer.dashboard_server is not None, f"the trainer served no dashboard: {outcome.get('error')}"
        url = out["url"] = trainer.dashboard_server.url
        taken, written = _expected_when_held(cfg)
        out["expected_taken"], out["expected_written"] = taken, written
        deadline = time.time() + 120
        while True:  # until the run stands still where the gate holds it
            state = _api(url)
            now_taken = {c: s["taken"] for c, s in state["consumers"].items()}
            if state["step"] == HELD_STEP and now_taken == taken:
                break
            assert thread.is_alive(), f"the run ended before the gate: {outcome.get('error')}"
            assert time.time() < deadline, f"the run did not reach the held point: {now_taken} vs {taken}"
            time.sleep(0.2)
        out["held_api"] = state
        out["live_dom"] = dump_dom(url, str(tmp))
        out["live_png"] = screenshot(url, str(tmp / "dashboard_live.png"), str(tmp))
    finally:
        ray_session.get(gate.release.remote())
        thread.join(timeout=180)
        ray_session.kill(gate)
    assert not thread.is_alive(), "the run did not finish after the gate opened"
    if "error" in outcome:
        raise outcome["error"]
    out["history"] = outcome["history"]
    out["run_s"] = time.time() - t0
    report = out["run_dir"] / "report.html"
    out["report_dom"] = dump_dom(report.as_uri(), str(tmp), offline=True)  # anything it fetched would fail
    out["report_png"] = screenshot(report.as_uri(), str(tmp / "dashboard_report.png"), str(tmp))
    keep = os.environ.get("MINDSPEED_RL_SCREENSHOTS")
    if keep:
        for name in ("live_png", "report_png"):
            shutil.copy(out[name], Path(keep) / Path(out[name]).name)
    return out


def _check_lanes(page: dict, cfg, steps: dict[int, dict[str, int]]) -> None:
    """One lane per stage and worker; per step, each stage's boxes are its micro-batches, covering
    the rows it took."""
    stages = [m.name for m in get_algorithm(cfg.rl_config.algorithm)[0]]
    lanes = page["lanes"]
    for stage in stages:
        mine = [key for key in lanes if key[0] == stage]
        assert len(mine) == 1, f"{stage}: lanes {mine}"
    assert ("dataset", "driver") in lanes
    for step, per_stage in steps.items():
        assert [b for b in lanes[("dataset", "driver")] if b[1] == step] == [("put", step, 128)]
        for stage, (n_boxes, n_rows) in per_stage.items():
            (key,) = [k for k in lanes if k[0] == stage]
            boxes = [b for b in lanes[key] if b[1] == step]
            assert len(boxes) == n_boxes, f"step {step}, {key}: {len(boxes)} boxes, expected {n_boxes}"
            assert sum(b[2] for b in boxes) == n_rows, f"step {step}, {key}: rows {boxes}"
            assert all(b[0] == "get" for b in boxes)


def test_live_page_shows_where_each_stage_stands(run):
    page = read_page(run["live_dom"])
    cfg = run["cfg"]
    assert page["status"] == "running" and f"step {HELD_STEP} of steps 0–{STEPS - 1}" in page["status_text"]
    assert page["step_title"] == f"Step {HELD_STEP} (in progress)"
    rows = 128
    assert page["consumers"] == {c: (n, rows) for c, n in run["expected_taken"].items()}
    assert page["columns"] == {c: (n, rows) for c, n in run["expected_written"].items()}
    mb = _micro_batches(cfg)
    # the held stage: one box per get it made (the micro-batch it holds and the prefetched next one)
    held = {stage: (mb[stage], rows) if n == rows else (math.ceil(n / cfg.rl_config.dock_micro_batch_size), n)
            if n else (0, 0) for stage, n in run["expected_taken"].items()}
    _check_lanes(page, cfg, {0: {s: (mb[s], rows) for s in mb}, HELD_STEP: held})
    assert set(page["charts"]["Reward"]) == {"reward/mean", "reward/max_fraction"}
    assert page["charts"]["Reward"]["reward/mean"] == 1, "one step finished so far"
    assert png_size(run["live_png"])[0] == 1400


def test_report_shows_the_finished_run(run):
    html = (run["run_dir"] / "report.html").read_text()
    outside = re.findall(r"""(?:src|href)\s*=\s*["']?[a-z]*:?//|<link\b|@import|url\(\s*["']?[a-z]*:?//""", html)
    assert not outside, f"report.html loads something from outside itself: {outside}"
    page = read_page(run["report_dom"])
    cfg = run["cfg"]
    assert page["status"] == "finished" and f"{STEPS} steps" in page["status_text"]
    assert page["step_title"] == f"Step {STEPS - 1} (complete)"
    assert page["consumers"] == {c: (128, 128) for c in run["expected_taken"]}
    assert page["columns"] == {c: (128, 128) for c in run["expected_written"]}
    mb = _micro_batches(cfg)
    _check_lanes(page, cfg, {s: {stage: (mb[stage], 128) for stage in mb} for s in range(STEPS)})
    for title, series in page["charts"].items():
        assert all(n == STEPS for n in series.values()), (title, series)
    for title in ("Reward", "KL to the reference", "Policy loss", "Step time (s)", "Throughput (tokens/s)",
                  "Per-stage time (s)"):
        assert title in page["charts"], f"no chart {title!r}: {list(page['charts'])}"
    assert set(page["charts"]["Per-stage time (s)"]) == {f"timing/{s}" for s in mb}
    assert sorted(page["overlap"]) == list(range(STEPS))
    assert png_size(run["report_png"])[0] == 1400


def test_cli_serves_the_finished_run_again(run):
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli" / "dashboard.py"), str(run["run_dir"]), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        url = None
        deadline = time.time() + 60
        while url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                raise AssertionError(f"cli/dashboard.py printed no address within 60 s (exit code {proc.poll()})")
            if line.startswith("dashboard: "):
                url = line.split()[1]
        assert url.startswith("http://127.0.0.1:")
        served = read_page(dump_dom(url, str(run["tmp"])))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report = read_page(run["report_dom"])
    for key in ("status", "consumers", "columns", "lanes", "charts"):
        assert served[key] == report[key], key


def test_tensorboard_has_every_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run["run_dir"] / "tensorboard"))
    acc.Reload()
    for key in ("reward/mean", "actor/pg_loss", "timing/step", "throughput/tokens_per_s"):
        scalars = acc.Scalars(key)
        assert [s.step for s in scalars] == list(range(STEPS)), key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in run["history"]], rel=1e-6)


def test_boxes_pair_each_put_with_its_get(tmp_path):
    """A worker's k-th put closes its k-th box, even when the dock saw the put after the next get
    (puts are sent without waiting); a stage that puts nothing closes a box at its next get, its
    last one at the end of its stage call; a lane that only puts (the driver) gets put marks."""
    from mindspeed_rl.dashboard import DashboardState, write_report

    def ev(seq, op, stage, worker, t0, t1, rows=4):
        return {"seq": seq, "op": op, "stage": stage, "worker": worker, "step": 0, "rows": rows,
                "t_start": 1000.0 + t0, "t_end": 1000.0 + t1}
    snap = DashboardState({"title": "pairs", "stages": ["gen", "train"], "consumers": ["gen", "train"],
                           "columns": ["x"], "rows_per_step": 8,
                           "lanes": [{"stage": "dataset", "worker": "driver"}, {"stage": "gen", "worker": "g/0"},
                                     {"stage": "train", "worker": "t/0"}]}).snapshot()
    snap.update(status="finished", step=0, steps={"0": {"t_start": 1000.0, "t_end": 1000.6}},
                spans=[{"step": 0, "stage": "train", "worker": "t/0", "t_start": 1000.02, "t_end": 1000.5}],
                events=[ev(1, "put", "dataset", "driver", 0.0, 0.0, 8),
                        ev(2, "get", "gen", "g/0", 0.01, 0.02), ev(3, "get", "gen", "g/0", 0.10, 0.11),
                        ev(4, "put", "gen", "g/0", 0.105, 0.105), ev(5, "put", "gen", "g/0", 0.2, 0.2),
                        ev(6, "get", "train", "t/0", 0.02, 0.21), ev(7, "get", "train", "t/0", 0.3, 0.31)])
    path = write_report(snap, tmp_path)
    root = parse(dump_dom(path.as_uri(), str(tmp_path)))
    boxes = {(lane.attrs["data-stage"]): [(b.attrs["data-op"], round(float(b.attrs["data-t0"]) - 1000, 3),
                                          round(float(b.attrs["data-tw"]) - 1000, 3),
                                          round(float(b.attrs["data-t1"]) - 1000, 3))
                                         for b in lane.find_all("g", cls="mb")]
             for lane in root.find_all("g", cls="lane")}
    assert boxes == {"dataset": [("put", 0.0, 0.0, 0.0)],
                     "gen": [("get", 0.01, 0.02, 0.1), ("get", 0.1, 0.11, 0.2)],
                     "train": [("get", 0.02, 0.21, 0.3), ("get", 0.3, 0.31, 0.5)]}
