"""StepPipeline alone (trainer/pipeline.py): which stages of which step start when, in which dock, and
what a checkpoint keeps of the steps in flight. No Ray: the workers are a recording stand-in for
`StageWatch` and the docks are plain recorders; the real driver runs it in test_async.py and
test_simulated_pipeline.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dataflow import MFCDef
from mindspeed_rl.trainer.dynamic_sampling import DynamicSampling
from mindspeed_rl.trainer.errors import TrainingError
from mindspeed_rl.trainer.pipeline import StepPipeline
from mindspeed_rl.trainer.stage_watch import StageCall

ORDER = [MFCDef("rollout", "actor", "generate", ["prompts"], ["responses"]),
         MFCDef("reward", "reward", "compute", ["responses"], ["scores"], fn="rule_reward"),
         MFCDef("old_log_prob", "actor", "inference", ["responses"], ["old"]),
         MFCDef("train", "actor", "train_step", ["responses", "scores", "old"], [])]
AHEAD = {"rollout", "reward"}   # may run on older weights; the others read the weights their step trains
ROWS = 4


class Dock:
    """A dock that records what the driver did to it; its state is its own step counter."""

    def __init__(self):
        self.own, self.puts, self.loaded = 0, [], None

    def put_experience(self, rows, idx, producer=""):
        self.puts.append((producer, len(idx)))

    def clear(self):
        self.own += 1

    def state_dict(self):
        return {"step": self.own, "puts": len(self.puts)}

    def load_state_dict(self, state):
        self.loaded = state


class Watch:
    """StageWatch's two calls, recorded in one event list: ("start", step, stage) and ("wait", step, stages)."""

    def __init__(self):
        self.events: list[tuple] = []
        self.versions: dict[tuple[int, str], int] = {}

    def start(self, step, mfcs, version, kl_coef):
        out = []
        for m in mfcs:
            self.events.append(("start", step, m.name))
            self.versions[(step, m.name)] = version
            out.append(StageCall(m.name, ("g", 0), (step, m.name)))
        return out

    def wait(self, step, calls, dock, *, bar=None, check=None):
        if check is not None:
            check()
        self.events.append(("wait", step, tuple(c.stage for c in calls)))
        return [{"stage": c.stage, "step": c.ref[0]} for c in calls]


class Loader:
    def __init__(self):
        self.batches, self.last_truncated = 0, 0

    def next_batch(self):
        self.batches += 1
        self.last_truncated = self.batches  # a count to follow: step s's batch had s + 1 prompts cut
        return {"prompts": [np.array([self.batches, 1])] * (ROWS // 2)}


def pipeline(k: int = 0, blocking: bool = False, guarantee_order: bool = True, total_steps: int = 4,
             keep_full: bool = False) -> StepPipeline:
    plan = SimpleNamespace(order=ORDER, ahead=AHEAD, dataset_keys=["prompts"], rows_per_step=ROWS,
                           consumers=[m.name for m in ORDER])
    docks = [Dock() for _ in range(k + 1)]
    sampling = DynamicSampling(config_from_dict({}))  # off: a no-op
    return StepPipeline(plan=plan, docks=docks, loader=Loader(), sampling=sampling, watch=Watch(),
                        dock_call=lambda what, fn, *a, context="", **kw: fn(*a, **kw), staleness=k,
                        blocking=blocking, guarantee_order=guarantee_order, total_steps=total_steps,
                        keep_full=keep_full, n_samples=2, dock_own=[0] * len(docks))


def steps_of(reports: list[dict]) -> set[int]:
    return {r["step"] for r in reports}


def test_k0_starts_every_stage_with_the_prompts_and_waits_for_them_at_once():
    p = pipeline()
    reports = p.run(0, version=0, kl_coef=0.0)
    assert p.watch.events == [("start", 0, m.name) for m in ORDER] + [("wait", 0, tuple(m.name for m in ORDER))]
    assert sorted(r["stage"] for r in reports) == sorted(m.name for m in ORDER) and steps_of(reports) == {0}
    assert p.docks[0].puts == [("dataset", ROWS)] and p.launched == 1
    assert p.clear(0) == {"data/prompts_truncated": 1} and p.docks[0].own == 1 and p.dock_own == [1]


def test_blocking_starts_each_stage_after_the_one_before_it_is_done():
    p = pipeline(blocking=True)
    reports = p.run(0, version=0, kl_coef=0.0)
    expected = []
    for m in ORDER:
        expected += [("start", 0, m.name), ("wait", 0, (m.name,))]
    assert p.watch.events == expected
    assert [r["stage"] for r in reports] == [m.name for m in ORDER]
    assert not p.calls, "nothing is left in flight"


def test_blocking_is_read_at_every_step():
    """benchmarks/steptrace.py flips it between steps of one run."""
    p = pipeline()
    p.run(0, 0, 0.0)
    p.clear(0)
    p.blocking = True
    p.watch.events.clear()
    p.run(1, 1, 0.0)
    assert [e for e in p.watch.events if e[0] == "wait"] == [("wait", 1, (m.name,)) for m in ORDER]


def test_staleness_k_runs_the_ahead_stages_k_steps_early_in_docks_of_their_own():
    p = pipeline(k=2, guarantee_order=False, total_steps=4)
    reports = p.run(0, version=0, kl_coef=0.0)
    starts = [e[1:] for e in p.watch.events if e[0] == "start"]
    # steps 0..2 put their prompts and start rollout and reward on version 0; step 0 then its train-time stages
    assert starts == [(s, n) for s in range(3) for n in ("rollout", "reward")] + [(0, "old_log_prob"), (0, "train")]
    assert all(v == 0 for v in p.watch.versions.values())
    assert [len(d.puts) for d in p.docks] == [1, 1, 1] and p.launched == 3
    assert steps_of(reports) == {0} and len(reports) == len(ORDER)
    assert sorted(p.calls) == [1, 2], "the steps ahead stay in flight without guarantee_order"
    p.clear(0)
    p.run(1, version=1, kl_coef=0.0)
    assert ("start", 3, "rollout") in p.watch.events and p.watch.versions[(3, "rollout")] == 1
    assert p.dock_of(3) is p.docks[0] and p.step_of(0, 1, 0) == 3  # step 3 reuses step 0's cleared dock


def test_guarantee_order_lets_the_steps_ahead_finish_and_keeps_their_reports_for_their_turn():
    p = pipeline(k=1, guarantee_order=True, total_steps=3)
    p.run(0, 0, 0.0)
    assert not p.calls and steps_of(p.reports[1]) == {1}
    p.clear(0)
    reports = p.run(1, 1, 0.0)
    assert sorted(r["stage"] for r in reports) == sorted(m.name for m in ORDER) and steps_of(reports) == {1}
    assert 1 not in p.reports


def test_the_horizon_stops_at_total_steps_unless_the_run_checkpoints():
    assert [pipeline(k=2, total_steps=4).horizon(s) for s in range(4)] == [3, 4, 4, 4]
    assert [pipeline(k=2, total_steps=4, keep_full=True).horizon(s) for s in range(4)] == [3, 4, 5, 6]


def test_state_dict_holds_the_steps_in_flight_and_loads_back():
    p = pipeline(k=2, guarantee_order=False, keep_full=True)
    p.run(0, 0, 0.0)
    p.clear(0)
    state = p.state_dict(1)
    assert state["launched"] == 3 and sorted(state["in_flight"]) == [1, 2]
    assert not p.calls, "a checkpoint lets the steps in flight finish first"
    one = state["in_flight"][1]
    assert one["dock"] == {"step": 0, "puts": 1} and one["truncated"] == 2
    assert {r["stage"] for r in one["reports"]} == AHEAD

    q = pipeline(k=2, guarantee_order=False, keep_full=True)
    q.load_state_dict(state, 1)
    assert q.launched == 3 and q.docks[1].loaded == one["dock"] and q.reports[2] == state["in_flight"][2]["reports"]
    assert q.truncated == {1: 2, 2: 3} and q.step_of(1, 0, 1) == 1
    q.run(1, 1, 0.0)
    # the step k ahead first, then the step's train-time stages
    assert [e[1:] for e in q.watch.events if e[0] == "start"] == [(3, "rollout"), (3, "reward"),
                                                                   (1, "old_log_prob"), (1, "train")]


def test_a_failed_dynamic_sampling_filter_stops_the_wait():
    p = pipeline()

    def failed(step):
        raise RuntimeError(f"step {step}: dynamic sampling failed: boom")
    p.sampling.check = failed
    with pytest.raises(TrainingError, match="step 0: dynamic sampling failed: boom"):
        p.run(0, 0, 0.0)
