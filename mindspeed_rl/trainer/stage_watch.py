"""Starting a step's stages on their workers and waiting for them, with every wait bounded.

A wait ends on the first failure, when a stage makes no progress for `trainer.stage_timeout_s`, or
on SIGINT/SIGTERM, and the message names the cause: for a stall, the stage that is late (found from
the graph and the dock's progress), not only the one that waited; for a dead worker, the worker and
every stage it hosted (also when a surviving rank's collective failed first).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..dataflow import MFCDef
from .errors import TrainingError, cause_of, first_line

POLL_S = 0.25
LIVENESS_TIMEOUT_S = 5.0     # after a stage failed: how long the other workers get to answer a ping


def at(step: int | str) -> str:
    """What a message calls the run being waited for: `step N`, or the label given instead of a step."""
    return f"step {step}" if isinstance(step, int) else step


@dataclass(frozen=True)
class StageCall:
    """One rank's `run_stage` call of one stage: what the driver waits for."""
    stage: str
    where: tuple[str, int]       # (worker group, rank)
    ref: Any                     # the Ray object ref of the call's report


@dataclass
class StageWatch:
    """Starts stage calls and waits for them; explains a failure, a stall or a dead worker.

    `dock_call(what, fn, *args, context=...)` is the driver's bounded dock call (`dock_calls.py`);
    `check_signal()` raises at a pending SIGINT/SIGTERM.
    """
    plan: Any                                   # planning/plan.py Plan
    workers: dict[str, list]                    # group -> its actors
    worker_info: dict[tuple[str, int], dict]    # (group, rank) -> its ping: pid, host, node id
    timeout_s: float                            # trainer.stage_timeout_s
    dock_call: Callable[..., Any]
    check_signal: Callable[[], None]

    def start(self, step: int, mfcs: Iterable[MFCDef], version: int, kl_coef: float,
              validation: bool = False) -> list[StageCall]:
        """Start `mfcs` of `step` on every rank of their worker groups, at weight version `version`
        (`validation`: the MFCs' validation run over the validation dock, trainer/validation.py)."""
        out = []
        for m in mfcs:
            group = self.plan.group_of(m.name)
            for rank, w in enumerate(self.workers[group]):
                call = w.run_stage.remote(m.name, step, version, kl_coef, validation)
                out.append(StageCall(m.name, (group, rank), call))
        return out

    def wait(self, step: int | str, calls: list[StageCall], dock, *, bar=None,
             check: Callable[[], None] | None = None) -> list[dict]:
        """The calls' reports. Between polls: a signal, `check()` (it raises what went wrong beside the
        stages), and the step's progress in `dock`, which a stall is measured and explained by. `step`
        names the run in messages: a step number, or a label (a validation's)."""
        import ray
        by_ref = {c.ref: c for c in calls}
        refs = list(by_ref)
        reports: list[dict] = []
        last_taken: dict[str, int] = {}
        last_progress = time.time()
        while refs:
            self.check_signal()
            if check is not None:
                check()
            done, refs = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
            reports += [self._report(step, by_ref[ref], dock) for ref in done]
            if not refs:
                break
            running = sorted({by_ref[r].stage for r in refs})
            status = self.dock_call("get_consumer_status()", dock.get_consumer_status,
                                    context=f"{at(step)}, stages {running} running")
            taken = {c: s["taken"] for c, s in status.items()}
            if taken != last_taken:
                last_taken, last_progress = taken, time.time()
            elif time.time() - last_progress > self.timeout_s + 5.0:
                raise TrainingError(f"{at(step)}: {self.stall(step, dock, running)}; stages {running} made no "
                                    f"progress for {self.timeout_s:.0f} s (trainer.stage_timeout_s); consumption: "
                                    + ", ".join(f"{c} {s['taken']}/{s['total']}" for c, s in status.items()))
            if bar is not None:
                bar.set_postfix_str(" ".join(f"{c} {taken[c]}/{status[c]['total']}" for c in self.plan.consumers),
                                    refresh=True)
        return reports

    def _report(self, step: int | str, call: StageCall, dock) -> dict:
        """A finished call's report, or the TrainingError that names why it failed."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from ..workers.stage import StageTimeout
        try:
            return ray.get(call.ref)
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            dead = self.dead_worker(step, call.stage, call.where)
            if dead:  # a survivor's collective failed because a peer died: name the dead one
                raise TrainingError(dead + f"; the surviving {call.where[0]}/{call.where[1]} then "
                                    f"failed: {cause_of(e)}") from None
            if isinstance(cause, StageTimeout):  # who waited is known; who is late is found here
                raise TrainingError(f"{at(step)}: {self.stall(step, dock, [cause.stage])}"
                                    f"; {cause.stage} (rank {cause.rank}): {cause}") from None
            raise TrainingError(f"{at(step)}: {cause_of(e)}") from None
        except RayActorError as e:
            raise TrainingError(f"{at(step)}: {self.worker_died(call.where, call.stage, e)}") from None

    def stall(self, step: int | str, dock, waiting: list[str]) -> str:
        """The late stages behind `waiting`, with their progress, read from `step`'s `dock` now."""
        try:
            columns = self.dock_call("get_column_status()", dock.get_column_status, context=at(step))
            consumers = self.dock_call("get_consumer_status()", dock.get_consumer_status, context=at(step))
        except Exception as e:  # the dock itself is gone: say so rather than hide the stall
            return f"stages {waiting} stalled (the dock did not answer for details: {first_line(e)})"
        return describe_stall(self.plan.order, waiting, columns, consumers, lanes(self.plan), self.timeout_s)

    def dead_worker(self, step: int | str, stage: str, where: tuple[str, int]) -> str | None:
        """After a stage failed on `where`: is another worker dead (killed, OOM)? Then that one is the
        cause (a peer's gloo/NCCL error, "Connection reset by peer", is only its echo). Every worker
        is pinged at once, for at most LIVENESS_TIMEOUT_S; a worker that does not answer is not
        counted as dead (it may be busy)."""
        import ray
        from ray.exceptions import RayActorError
        pings = [((g, r), w.ping.remote()) for g, ws in self.workers.items() for r, w in enumerate(ws)
                 if (g, r) != where]
        if not pings:
            return None
        ray.wait([r for _, r in pings], num_returns=len(pings), timeout=LIVENESS_TIMEOUT_S)
        for key, ref in pings:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as e:
                hosted = [m.name for m in self.plan.groups[key[0]].mfcs]
                stage_here = stage if stage in hosted else hosted[0]
                return f"{at(step)}: {self.worker_died(key, stage_here, e)}"
            except Exception:
                continue
        return None

    def worker_died(self, where: tuple[str, int], stage: str, e: Exception) -> str:
        """A dead worker by group/rank, Ray actor and pid, with every stage it hosted."""
        group, rank = where
        info = self.worker_info.get(where, {})
        actor = getattr(e, "actor_id", None) or info.get("actor_id")
        ids = ", ".join(x for x in (f"Ray actor {actor}" if actor else "",
                                    f"pid {info['pid']} on {info.get('host', '?')}" if "pid" in info else "") if x)
        hosted = [m.name for m in self.plan.groups[group].mfcs]
        return (f"worker {group}/{rank}{f' ({ids})' if ids else ''} died while running stage '{stage}'; it hosted "
                f"stages {hosted} ({type(e).__name__}): {first_line(e)}")


def collect(refs: list, what: str, check_signal: Callable[[], None], timeout_s: float) -> list:
    """ray.get of calls to workers outside a step (set-up, checkpoints, exports), bounded by `timeout_s`
    and stopping at a signal within POLL_S; a failure is a TrainingError that starts with `what`."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    deadline = time.time() + timeout_s
    waiting = list(refs)
    while waiting:
        check_signal()
        if time.time() > deadline:
            raise TrainingError(f"{what}: no answer within {timeout_s:.0f} s (are the Ray resources "
                                "free? see `ray status`)")
        _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_S)
    try:
        return ray.get(refs, timeout=POLL_S)
    except RayTaskError as e:
        raise TrainingError(f"{what}: {cause_of(e)}") from None
    except RayActorError as e:
        raise TrainingError(f"{what}: a worker died: {first_line(e)}") from None


def lanes(plan) -> dict[str, str]:
    """Stage -> the workers that run it, as "group/ranks" (a stall message's names)."""
    out = {}
    for m in plan.order:
        g = plan.group_of(m.name)
        world = plan.groups[g].world
        out[m.name] = f"{g}/{'0' if world == 1 else f'0-{world - 1}'}"
    return out


def describe_stall(order: Sequence[MFCDef], waiting: Iterable[str], columns: Mapping[str, Mapping[str, int]],
                   consumers: Mapping[str, Mapping[str, int]], lanes: Mapping[str, str], timeout_s: float) -> str:
    """Who is late, not only who waited.

    From each waiting stage, follow its input columns not yet fully written back to the stages that
    produce them (the graph), and on through their own missing inputs, to the first stages whose
    inputs are all there: those are late. Each is named with its worker and progress (rows taken /
    total from its consumer status, rows written / total of each output column it still owes).
    """
    by_name = {m.name: m for m in order}
    producer = {c: m.name for m in order for c in m.output_keys}

    def unwritten(cols: Iterable[str]) -> list[str]:
        return [c for c in cols if c in columns and columns[c]["written"] < columns[c]["total"]]

    late: list[str] = []
    seen: set[str] = set()
    todo = [w for w in waiting if w in by_name]
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        upstream = [producer[c] for c in unwritten(by_name[name].input_keys) if c in producer]
        if upstream:
            todo += upstream
        else:
            late.append(name)

    def progress(name: str) -> str:
        c = consumers.get(name, {})
        owed = unwritten(by_name[name].output_keys)
        parts = [f"took {c.get('taken', '?')}/{c.get('total', '?')} rows"]
        parts += [f"wrote {col} for {columns[col]['written']}/{columns[col]['total']}" for col in owed]
        return f"stage '{name}' (worker {lanes.get(name, '?')}) {', '.join(parts)}"

    waited = sorted(set(waiting))
    if late == waited:  # in blocking mode, or a stage with all its inputs that does not finish
        return f"{' and '.join(progress(n) for n in late)} and is late itself: its inputs are all written"
    return (f"{' and '.join(progress(n) for n in late)}: late, so {waited} waited "
            f"{timeout_s:.0f} s (trainer.stage_timeout_s) for its outputs")
