"""The driver: reads like a single-process program.

    plan = make_plan(cfg)                 # graph, columns, consumers, groups: all derived
    dock, workers = start(plan)
    for step: put prompts -> run the stages -> sync weights -> log -> clear -> checkpoint

`rl_config.blocking: true` runs the stages one after another in the graph's topological order;
`false` starts all of them at once and each takes micro-batches as soon as its inputs are ready.
Every wait is bounded: a stage that makes no progress for `trainer.stage_timeout_s`, a worker that
dies, or a failed stage stops the run within seconds, naming the stage and the cause: for a stall,
the stage that is late (found from the graph and the dock's progress), not only the one that waited;
for a dead worker, the worker and every stage it hosted (also when a surviving rank's collective failed
first); for a dock that stops answering, the call, the step and the stages waiting (`dock_calls.py`).
SIGINT and SIGTERM stop the run at once, start-up included, and clean up as a crash does;
`Interrupted` carries the one line to print. Before Ray starts, the output directory is locked and
checked (`run_dir.py`), and a resume's checkpoint is found, checked and compared with the config
(`checkpoint.resume_point`, `resume.py`), so a user's mistake costs seconds, not a cluster start.
While it runs, a dashboard on 127.0.0.1 shows each stage's consumption and a timeline of the
micro-batches; at the end (also after a crash) `report.html` keeps the same views (docs/dashboard.md).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


from ..config import Config, ConfigError
from ..dataflow import MFCDef
from ..models.files import CheckpointFileError
from .checkpoint import (ResumePoint, checkpoint_dir, mark_latest, prune_checkpoints, read_latest, resume_point,
                         save_driver_state)
from .dock_calls import DockCalls, DockSilent
from .resume import check_resume
from .run_dir import RunDirectory, refuse_or_clear_previous
from .plan import Plan, check_cluster, format_plan, make_plan, write_plan_json
from .launch import LaunchError, launch_workers
from .run_dashboard import DashboardError, finish_dashboard, start_dashboard
from .signals import SignalTrap
from .step_metrics import step_record
from .dynamic_sampling import DynamicSampling
from .reward_modeling import save_final, trains_reward_model
from .run_log import MetricsFileError, RunInfo, RunLog, plot_curve

STARTUP_TIMEOUT_S = 300.0
RAY_CONNECT_TIMEOUT_S = 5.0  # placement.ray_address: a TCP connect to it, before ray.init retries for minutes
LIVENESS_TIMEOUT_S = 5.0     # after a stage failed: how long the other workers get to answer a ping
POLL_S = 0.25
CLOSE_TIMEOUT_S = 30.0  # shutdown: how long engine-split rollout actors get to close their engines (vLLM: ~7 s)
SAVE_EVERY_S = 2.0  # dashboard.json in output_dir: rewritten at most this often while the run goes


class TrainingError(RuntimeError):
    """The run stopped; the message names the stage and the cause."""


class Interrupted(TrainingError):
    """SIGINT or SIGTERM stopped the run (after the same clean-up as a crash).

    `summary(argv)` is the one line a user needs: where the run got to, the checkpoint a resume
    starts from, and the command that resumes it. `exit_code` is the shell's 128 + signal number.
    """

    def __init__(self, signum: int, step: int, steps_done: int, total_steps: int, checkpoint: dict | None,
                 save_interval: int):
        self.signum, self.step, self.steps_done, self.total_steps = signum, step, steps_done, total_steps
        self.checkpoint, self.save_interval = checkpoint, save_interval
        super().__init__(f"stopped by {signal.Signals(signum).name} during step {step} "
                         f"({steps_done} of {total_steps} steps done)")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def summary(self, argv: Sequence[str]) -> str:
        if self.checkpoint is None:
            where = (f"no checkpoint yet (trainer.save_interval={self.save_interval}), a resume starts at step 0")
        else:
            where = f"last checkpoint: step {self.checkpoint['step']} in {self.checkpoint['path']}"
        return f"{self}; {where}; resume with: {resume_command(argv)}"


def resume_command(argv: Sequence[str]) -> str:
    """The command line that ran (`python` + argv), with any trainer.resume override replaced by
    `trainer.resume=true`; each word quoted for a POSIX shell."""
    words = [a for a in argv[1:] if not re.match(r"^\+{0,2}trainer\.resume=", a)]
    return shlex.join(["python", argv[0] if argv else "cli/train_grpo.py", *words, "trainer.resume=true"])


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.plan: Plan = make_plan(cfg, check_files=not cfg.trainer.dry_run)
        self.workers: dict[str, list[Any]] = {}
        self.docks: list = []   # one per step in flight: rl_config.max_weight_staleness + 1
        self._launched = 0      # steps whose prompts are in a dock and whose stages were started
        self._inflight: dict[tuple[int, str], Any] = {}  # (step, stage) -> its calls, started, not yet waited
        self._reports: dict[int, list[dict]] = {}        # step -> reports of stages done before its turn
        self._truncated: dict[int, int] = {}             # step -> its prompts cut to data.max_prompt_length
        self._dock_own: list[int] = []                   # per dock: its own step counter (+1 at each clear)
        self._dock_steps: dict[tuple[int, int], int] = {}  # (dock, its own step) -> trainer step (dashboard)
        self._started_ray = False
        self.placement_groups: dict = {}   # placement.mode=mesh: device -> (Ray placement group, bundle)
        self.worker_nodes: dict[str, list[str]] = {}  # group -> the Ray node id of each rank
        self.device_nodes: dict[int, str] = {}        # mode mesh: device -> the Ray node it was placed on
        self.dashboard = None  # DashboardState while a run with trainer.dashboard or trainer.report goes
        self.dashboard_server = None
        self.log: RunLog | None = None
        self.evaluate = lambda step: {}    # reward modeling: trainer/reward_modeling.py Evaluation, set at start
        self.validation = None             # trainer/validation.py Validation (data.val_dataset), set at start
        self.worker_info: dict[tuple[str, int], dict] = {}  # (group, rank) -> its ping: pid, host, node id
        self.step = 0             # the step running (or about to), for an interrupted run's message
        self.steps_done = 0
        self.signals = SignalTrap()      # SIGINT/SIGTERM raise at once in the main thread (signals.py)
        self.run_dir = RunDirectory(cfg.trainer.output_dir)
        self._resume: ResumePoint | None = None
        self._hf_step = -1               # the step of the last Hugging Face export (trainer.save_hf)
        self.dock_calls: DockCalls | None = None
        self._reaper = None              # trainer/reaper.py: ends this run's Ray session if the driver is killed
        self._t_start = time.time()      # shm_cleanup: records of processes older than this run are not ours

    # ------------------------------------------------------------------ the run
    def preflight(self) -> int | None:
        """What can be checked before Ray starts: the output directory (writable, not another run's, not
        in use), and for a resume its checkpoint (readable, else the previous complete one, with a
        warning) and the config it was saved with. Returns the step the run starts at, or None when a
        resume has nothing left to train. Raises ConfigError (exit 2) naming the key and the fix."""
        t = self.cfg.trainer
        self.run_dir.acquire()
        if t.resume:
            try:
                self._resume = resume_point(t.output_dir, list(self.plan.trained))
            except CheckpointFileError as e:
                raise ConfigError(str(e)) from None
        if self._resume is None:
            if t.resume:
                print(f"trainer.resume=true but no checkpoint in {t.output_dir}/checkpoints; starting at step 0",
                      file=sys.stderr)
            refuse_or_clear_previous(t.output_dir, t.overwrite)
            return 0
        found = self._resume
        for why in found.skipped:
            print(f"warning: resume: skipped a newer checkpoint: {why}; resuming from {found.directory} "
                  f"(step {found.step}) instead", file=sys.stderr)
        notes = check_resume(found.state.get("config"), self.cfg, found.step,
                             [int(s_) for s_ in found.state.get("in_flight", {})], str(found.directory))
        self._check_layouts(found)
        if notes:
            print("resume: changed since the checkpoint: " + "; ".join(notes), file=sys.stderr)
        if found.step >= t.total_steps:
            print(f"trainer.resume=true: the checkpoint {found.directory} is at step {found.step} and "
                  f"trainer.total_steps={t.total_steps}: nothing left to train; raise trainer.total_steps to go on",
                  file=sys.stderr)
            return None
        return found.step

    def _layouts(self) -> dict[str, dict]:
        """Per trained model, the train backend and dp/tp/pp its checkpoint files are written in."""
        out = {}
        for model, train_mfc in self.plan.trained.items():
            g = self.plan.groups[self.plan.group_of(train_mfc)]
            out[model] = {"backend": g.train_backend, "dp": g.resources.dp, "tp": g.tp, "pp": g.pp}
        return out

    def _check_layouts(self, found: ResumePoint) -> None:
        """A checkpoint's engine files are in its train backend's format: another backend cannot read them
        (a tp 2 checkpoint of the mesh backend has no engine.pt for one torch rank)."""
        saved = found.state.get("layouts")
        if not isinstance(saved, dict):
            return
        for model, now in self._layouts().items():
            old = saved.get(model)
            if old and old.get("backend") != now["backend"]:
                raise ConfigError(
                    f"trainer.resume=true: the checkpoint {found.directory} holds {model!r} as written by the "
                    f"{old['backend']} train backend (dp {old['dp']}, tp {old['tp']}, pp {old['pp']}), but this run "
                    f"trains it on {now['backend']} (dp {now['dp']}, tp {now['tp']}, pp {now['pp']}), which cannot "
                    "read those files; resume with the placement and actor_config.backend it was saved with")

    def run(self) -> list[dict]:
        cfg = self.cfg
        if cfg.trainer.dry_run:
            print(self.describe())
            print(f"plan: {write_plan_json(self.plan, cfg.trainer.output_dir)}")
            return []
        error: BaseException | None = None
        self.signals.trap()
        try:
            start_step = self.preflight()
            if start_step is None:  # a resume with nothing left to train
                from .run_log import read_metrics
                path = os.path.join(cfg.trainer.output_dir, "metrics.jsonl")
                return read_metrics(Path(path)) if os.path.exists(path) else []
            write_plan_json(self.plan, cfg.trainer.output_dir)   # what the plan decided, for tools and users
            self._start_dashboard()  # a port in use fails before Ray starts
            self._start_ray()
            self.signals.trap()  # again: ray.init installs a SIGTERM handler of its own (sys.exit)
            self._start()
            start_step = self._maybe_resume()
            self.step = self.steps_done = start_step
            try:
                self.log = RunLog(cfg.trainer.output_dir, cfg.trainer.logger, resume_step=start_step,
                                  info=RunInfo.of(cfg))
            except MetricsFileError as e:
                raise TrainingError(f"trainer.resume=true: {e}") from None
            if self.dashboard is not None:
                for record in self.log.history:  # a resumed run's earlier steps
                    self.dashboard.add_record(record)
                self.dashboard.attach(self.docks, start_step,
                                      step_of=lambda j, own: self._dock_steps.get((j, own), own + start_step))
            self._sync_weights()
            self.validation.before_train(start_step)   # trainer.val_before_train: the starting weights
            bar = self._progress(start_step)
            for step in range(start_step, cfg.trainer.total_steps):
                self.step = step
                self._check_signal()
                record = self.train_step(step, bar)
                record.update(self.evaluate(step))   # reward modeling: held-out accuracy and margin when due
                record.update(self.validation.after_step(step))  # val/* when due, at the weights just synced
                line = self.log.log(record)
                if self.dashboard is not None:
                    self.dashboard.add_record(record)
                    if cfg.trainer.report:
                        self.dashboard.save(cfg.trainer.output_dir, every_s=SAVE_EVERY_S)  # for cli/dashboard.py
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"reward {record['reward/mean']:.3f}", refresh=False)
                if "console" in cfg.trainer.logger:
                    (bar.write if bar is not None else print)(line)
                saving = cfg.trainer.save_interval and (step + 1) % cfg.trainer.save_interval == 0
                if saving or (step + 1 == cfg.trainer.total_steps and cfg.trainer.save_interval):
                    self.save(step + 1)
                    if cfg.trainer.save_hf == "every_save":
                        self.save_hf(step + 1)
                self.steps_done = step + 1
            if bar is not None:
                bar.close()
            if cfg.trainer.save_hf != "never" and self.steps_done > start_step and self._hf_step != self.steps_done:
                exported = self.save_hf(self.steps_done)
                if exported is not None:
                    print(f"policy (Hugging Face checkpoint): {exported.parent / 'final'}", file=sys.stderr,
                          flush=True)
            if trains_reward_model(self.plan) and cfg.trainer.total_steps:
                print(f"reward model: {save_final(self)}", file=sys.stderr, flush=True)
            if cfg.trainer.plot and self.log.history:
                plot_curve(self.log.history, self.log.dir / "curve.png", title=f"{cfg.rl_config.algorithm} "
                           f"({'blocking' if cfg.rl_config.blocking else 'non-blocking'})")
            return self.log.history
        except BaseException as e:
            error = e
            if self.signals.received is not None and not isinstance(e, Interrupted):
                # the signal came first and took workers down with it (a SIGTERM to the process group)
                error = self._interrupted()
                raise error from None
            raise
        finally:
            self.signals.stopping = True
            try:
                self._finish_dashboard(error)  # before shutdown: the dock still answers for the last view
                if self.log is not None:
                    self.log.close()
                self.shutdown()
            finally:
                self.run_dir.release()
                self.signals.restore()

    # ------------------------------------------------------------------ signals (signals.py)
    def _check_signal(self) -> None:
        if self.signals.pending():
            raise self._interrupted()

    def _interrupted(self) -> Interrupted:
        t = self.cfg.trainer
        return Interrupted(self.signals.received or signal.SIGINT, self.step, self.steps_done, t.total_steps,
                           read_latest(t.output_dir), t.save_interval)

    def train_step(self, step: int, bar=None) -> dict:
        """One step: its rows through every stage, the trained weights published as version step + 1.

        With `rl_config.max_weight_staleness` k = 0 a step's stages all run now, on weights of version
        `step`. With k > 0 the stages that may use older weights (rollout, rewards, a frozen reference:
        `Plan.ahead`) run k steps early, in the dock of their own step, beside the training of an older
        step: at step t, step t+k's ahead stages start (the published version is t = (t+k) - k), then
        step t's train-time stages (old log-probs, training). With `guarantee_order` the weights move
        only once step t+k's rollout is done too, so every row of step s is generated by exactly
        version max(0, s - k) and a run is reproducible; without it they move as soon as step t is
        trained and the rollout picks them up at its next micro-batch.
        """
        plan = self.plan
        t0 = time.perf_counter()
        if self.dashboard is not None:
            self.dashboard.begin_step(step)
        reports = self._run_stages(step, self.policy_version, float(self.kl_ctrl.value), bar)
        sampled = self.sampling.finish(step)  # dynamic sampling's metrics (none when off)
        t_stages = time.perf_counter()
        for model in plan.trained:
            self._versions[model] = step + 1
        sync = self._sync_weights()
        if self.dashboard is not None:  # the step's final consumption and events, before clear() resets them
            self.dashboard.end_step(step, [{"stage": r["stage"], "worker": f"{plan.group_of(r['stage'])}/{r['rank']}",
                                            "t_start": r["t_start"], "t_end": r["t_end"],
                                            **({"weight_version": int(r["metrics"]["weight_version_min"])}
                                               if "weight_version_min" in r["metrics"] else {})}
                                           for r in reports])
        self._dock("clear()", self.dock_of(step).clear, context=f"step {step}")
        self._dock_own[step % len(self.docks)] += 1
        record = self._metrics(step, reports, time.perf_counter() - t0, t_stages - t0, sync)
        record.update(sampled)
        record["data/prompts_truncated"] = self._truncated.pop(step, 0)  # this step's prompts cut to max_prompt_length
        if record.get("actor/kl") is not None:
            self.kl_ctrl.update(record["actor/kl"], plan.rows_per_step)
        return record

    def _run_stages(self, step: int, version: int, kl_coef: float, bar) -> list[dict]:
        """Start what this step needs started (its own stages, or with staleness k step t+k's ahead
        stages and step t's train-time ones) and return the reports of all of step t's stages."""
        cfg, plan = self.cfg, self.plan
        k = cfg.rl_config.max_weight_staleness
        # a run that checkpoints keeps its pipeline full to the end: the steps in flight at its last checkpoint
        # are in the checkpoint, so a resume continues exactly as one longer run would (docs/async.md)
        horizon = step + k + 1 if cfg.trainer.save_interval else min(cfg.trainer.total_steps, step + k + 1)
        for s in range(self._launched, horizon):
            self._launch(s, [m for m in plan.order if m.name in plan.ahead or k == 0], kl_coef)
        late = self._calls(step, [m for m in plan.order if m.name not in plan.ahead and k > 0], kl_coef)
        if cfg.rl_config.blocking:
            reports = []
            for m in plan.order:
                reports += self._wait(step, self._inflight.pop((step, m.name)), bar)
        else:
            reports = self._wait(step, self._pop_inflight(step) + late, bar)
            if k and cfg.rl_config.guarantee_order:  # the weights move only between rollout steps
                for s_ in sorted({key[0] for key in self._inflight}):
                    self._reports.setdefault(s_, []).extend(self._wait(s_, self._pop_inflight(s_), bar))
        return self._reports.pop(step, []) + reports

    def _pop_inflight(self, step: int) -> list:
        return [c for key in [key for key in self._inflight if key[0] == step] for c in self._inflight.pop(key)]

    def dock_of(self, step: int):
        """The dock that holds `step`'s rows: one per step in flight (k + 1 with staleness k)."""
        return self.docks[step % len(self.docks)]

    # ------------------------------------------------------------------ stages
    def _launch(self, step: int, mfcs: list[MFCDef], kl_coef: float) -> None:
        """Put `step`'s prompts into its dock and start `mfcs` for it (in blocking mode: record them to start
        one after another)."""
        import torch
        plan, n = self.plan, self.cfg.rl_config.n_samples_per_prompt
        batch = self.loader.next_batch()
        self._truncated[step] = self.loader.last_truncated
        rows = {key: [torch.from_numpy(v) for v in batch[key] for _ in range(n)]
                for key in self.sampling.dataset_keys(plan.dataset_keys)}
        self.sampling.open(step, self.dock_of(step), plan.rows_per_step, self._dock)
        self._dock("put_experience() of the prompts", self.dock_of(step).put_experience, rows,
                   list(range(plan.rows_per_step)), producer="dataset", context=f"step {step}")
        self.sampling.start(step, self.dock_of(step), self.loader, self.sampling.dataset_keys(plan.dataset_keys),
                            self._truncated)
        j = step % len(self.docks)
        self._dock_steps[(j, self._dock_own[j])] = step
        if self.cfg.rl_config.blocking:  # started by _wait's caller one stage at a time: see _calls
            for m in mfcs:
                self._inflight[(step, m.name)] = _Deferred(self, step, m, kl_coef)
        else:
            for m in mfcs:
                self._inflight[(step, m.name)] = self._calls(step, [m], kl_coef)
        self._launched = step + 1

    def _calls(self, step: int, mfcs: list[MFCDef], kl_coef: float) -> list[tuple[str, tuple[str, int], Any]]:
        """Start `mfcs` of `step` on every rank of their worker groups: [(stage, (group, rank), ref)]."""
        out = []
        for m in mfcs:
            group = self.plan.group_of(m.name)
            for rank, w in enumerate(self.workers[group]):
                out.append((m.name, (group, rank), w.run_stage.remote(m.name, step, self.policy_version, kl_coef)))
        return out

    def _wait(self, step: int, pending, bar) -> list[dict]:
        """Wait for stage calls (stage, (group, rank), ref); abort on the first failure, when a stage
        stops making progress, or on SIGINT/SIGTERM."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from ..workers.stage import StageTimeout
        if isinstance(pending, _Deferred):  # blocking mode: the stage starts now, after the ones before it
            pending = pending.start()
        stage_of = {ref: name for name, _, ref in pending}
        worker_of = {ref: where for _, where, ref in pending}
        refs = [ref for _, _, ref in pending]
        reports: list[dict] = []
        last_taken: dict[str, int] = {}
        last_progress = time.time()
        timeout = self.cfg.trainer.stage_timeout_s
        while refs:
            self._check_signal()
            try:
                self.sampling.check(step)
            except RuntimeError as e:
                raise TrainingError(str(e)) from None
            done, refs = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
            for ref in done:
                try:
                    reports.append(ray.get(ref))
                except RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    dead = self._dead_worker(step, stage_of[ref], worker_of[ref])
                    if dead:  # a survivor's collective failed because a peer died: name the dead one
                        raise TrainingError(dead + f"; the surviving {worker_of[ref][0]}/{worker_of[ref][1]} then "
                                            f"failed: {_cause(e)}") from None
                    if isinstance(cause, StageTimeout):  # who waited is known; who is late is found here
                        raise TrainingError(f"step {step}: {self._stall(step, [cause.stage])}"
                                            f"; {cause.stage} (rank {cause.rank}): {cause}") from None
                    raise TrainingError(f"step {step}: {_cause(e)}") from None
                except RayActorError as e:
                    raise TrainingError(f"step {step}: {self._worker_died(worker_of[ref], stage_of[ref], e)}") \
                        from None
            if not refs:
                break
            status = self._dock("get_consumer_status()", self.dock_of(step).get_consumer_status,
                                context=f"step {step}, stages {sorted({stage_of[r] for r in refs})} running")
            taken = {c: s["taken"] for c, s in status.items()}
            if taken != last_taken:
                last_taken, last_progress = taken, time.time()
            elif time.time() - last_progress > timeout + 5.0:
                stuck = sorted({stage_of[r] for r in refs})
                raise TrainingError(f"step {step}: {self._stall(step, stuck)}; stages {stuck} made no progress "
                                    f"for {timeout:.0f} s (trainer.stage_timeout_s); consumption: "
                                    + ", ".join(f"{c} {s['taken']}/{s['total']}" for c, s in status.items()))
            if bar is not None:
                bar.set_postfix_str(" ".join(f"{c} {taken[c]}/{status[c]['total']}" for c in self.plan.consumers),
                                    refresh=True)
        return reports

    def _stall(self, step: int, waiting: list[str]) -> str:
        """The late stages behind `waiting`, with their progress, read from the dock now."""
        try:
            dock = self.dock_of(step)
            columns = self._dock("get_column_status()", dock.get_column_status, context=f"step {step}")
            consumers = self._dock("get_consumer_status()", dock.get_consumer_status, context=f"step {step}")
        except Exception as e:  # the dock itself is gone: say so rather than hide the stall
            return f"stages {waiting} stalled (the dock did not answer for details: {_first_line(e)})"
        groups = {m.name: self.plan.group_of(m.name) for m in self.plan.order}
        lanes = {name: f"{g}/{_ranks(self.plan.groups[g].world)}" for name, g in groups.items()}
        return describe_stall(self.plan.order, waiting, columns, consumers, lanes,
                              self.cfg.trainer.stage_timeout_s)

    def _dock(self, what: str, fn, *args, context: str = "", **kwargs):
        """A dock call from the driver: bounded and interruptible (`dock_calls.py`); a silent dock ends
        the run naming the call, the step and the stages that were running."""
        try:
            return self.dock_calls.call(what, fn, *args, context=context, **kwargs)
        except DockSilent as e:
            raise TrainingError(str(e)) from None

    def _dead_worker(self, step: int, stage: str, where: tuple[str, int]) -> str | None:
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
                return f"step {step}: {self._worker_died(key, stage_here, e)}"
            except Exception:
                continue
        return None

    def _worker_died(self, where: tuple[str, int], stage: str, e: Exception) -> str:
        """A dead worker by group/rank, Ray actor and pid, with every stage it hosted."""
        group, rank = where
        info = self.worker_info.get(where, {})
        actor = getattr(e, "actor_id", None) or info.get("actor_id")
        ids = ", ".join(x for x in (f"Ray actor {actor}" if actor else "",
                                    f"pid {info['pid']} on {info.get('host', '?')}" if "pid" in info else "") if x)
        hosted = [m.name for m in self.plan.groups[group].mfcs]
        return (f"worker {group}/{rank}{f' ({ids})' if ids else ''} died while running stage '{stage}'; it hosted "
                f"stages {hosted} ({type(e).__name__}): {_first_line(e)}")

    # ------------------------------------------------------------------ weights
    @property
    def dock(self):
        """The dock of step 0's slot (the only one with max_weight_staleness 0)."""
        return self.docks[0] if self.docks else None

    @property
    def policy_version(self) -> int:
        return self._versions.get("actor", 0)

    def _sync_weights(self) -> dict:
        """Publish each trained model's weights to its readers, a bucket at a time; with
        `weight_sync.verify`, compare the checksums of what was sent, received and is served."""
        out = {}
        for model, train_mfc in self.plan.trained.items():
            members = self._sync_members[model]
            version = self._versions.get(model, 0)
            results = self._get([w.sync_weights.remote(model, version) for w in members], f"weight sync of '{model}'")
            sent = next((r["sent"] for r in results if "sent" in r), None)
            received = [c for r in results for c in r["received"]]
            if sent is not None and any(c != sent for c in received):
                raise TrainingError(f"weight sync of '{model}' (version {version}): checksums differ: trainer "
                                    f"{sent}, readers {received}")
            transfer = next((r["transfer"] for r in results if "transfer" in r), {})
            out[model] = {"checksum": sent, "readers": sum(r["readers"] for r in results),
                          "bytes": transfer.get("bytes", 0), "seconds": max(r["seconds"] for r in results)}
        return out

    # ------------------------------------------------------------------ metrics
    def _metrics(self, step: int, reports: list[dict], step_s: float, stages_s: float, sync: dict) -> dict:
        return step_record(self.plan, step, reports, step_s=step_s, stages_s=stages_s, sync=sync,
                           kl_coef=float(self.kl_ctrl.value), policy_version=self.policy_version)

    # ------------------------------------------------------------------ dashboard and report (run_dashboard.py)
    def _start_dashboard(self) -> None:
        try:
            self.dashboard, self.dashboard_server = start_dashboard(self.cfg, self.plan)
        except DashboardError as e:
            raise TrainingError(str(e)) from None

    def _finish_dashboard(self, error: BaseException | None) -> None:
        finish_dashboard(self.dashboard, self.dashboard_server, self.cfg, error)
        self.dashboard_server = None

    # ------------------------------------------------------------------ start-up and shutdown
    def describe(self) -> str:
        from ..dataflow import describe
        memory = "\n".join(self.plan.memory.lines()) if self.plan.memory is not None else ""
        return ("dataflow graph\n" + describe(self.plan.graph) + "\n\nplacement plan\n" + format_plan(self.plan)
                + ("\n\n" + memory if memory else ""))

    def _start_ray(self) -> None:
        import ray
        p = self.cfg.placement
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                                      "logging_level": "ERROR", "configure_logging": True}
            if p.ray_address:
                check_ray_address(p.ray_address)
                kwargs["address"] = p.ray_address
            elif p.ray_num_cpus is not None:
                kwargs["num_cpus"] = int(p.ray_num_cpus)
            self._started_ray = True  # before: an interrupted ray.init is shut down too
            from .reaper import start_reaper
            self._reaper = start_reaper()  # kill -9 of this driver must not leave Ray's processes and shm behind
            try:
                ray.init(**kwargs)
            except Exception as e:  # e.g. "The current node timed out during startup" on an overloaded machine
                raise TrainingError(f"Ray did not start ({type(e).__name__}: {_first_line(e)}); is the machine "
                                    "overloaded or /tmp full? see /tmp/ray/session_latest/logs") from None
        check_cluster(self.plan, ray.available_resources())
        if self.plan.placement is not None:
            from ..config import ConfigError
            try:
                self.plan.placement.check_cluster(ray.cluster_resources(), self.cfg.placement.cpus_per_device,
                                                  n_ray_nodes=sum(1 for n in ray.nodes() if n.get("Alive")))
            except ValueError as e:
                raise ConfigError(f"placement.mfcs: {e}") from None

    def _start(self) -> None:
        from ..algorithms import make_kl_controller
        from ..models import load_tokenizer
        from ..transfer_dock.client import create_transfer_dock
        from .reward_modeling import Evaluation, make_loader

        cfg, plan = self.cfg, self.plan
        t = cfg.trainer
        self.dock_calls = DockCalls(timeout_s=max(10.0, t.stage_timeout_s))
        self.sampling = DynamicSampling(cfg)  # rl_config.dynamic_sampling (a no-op when off)
        for _ in range(cfg.rl_config.max_weight_staleness + 1):  # the steps in flight each hold their rows
            self.docks.append(create_transfer_dock(plan.columns, self.sampling.consumers(plan.consumers),
                                                   self.sampling.prompts_num(),
                                                   cfg.rl_config.n_samples_per_prompt,
                                                   guarantee_order=cfg.rl_config.guarantee_order,
                                                   default_timeout=t.stage_timeout_s))
            self.docks[-1].worker = "driver"  # its puts' lane in the dock's event log (workers label theirs)
        self._dock_own = [0] * len(self.docks)
        env = {"MINDSPEED_RL_CACHE": _cache_env()}
        if plan.placement is not None:
            from ..parallel import create_placement_groups
            try:
                self.placement_groups = create_placement_groups(plan.placement, cfg.placement.cpus_per_device,
                                                                timeout_s=STARTUP_TIMEOUT_S)
                from ..parallel import placement_group_nodes
                self.device_nodes = placement_group_nodes(self.placement_groups)
            except (ValueError, TimeoutError) as e:
                raise TrainingError(f"placement.mfcs: {e}") from None
        try:
            launched = launch_workers(cfg, plan, self.docks, self.placement_groups, env, self._get)
        except LaunchError as e:
            raise TrainingError(str(e)) from None
        self.workers, self.worker_nodes = launched.workers, launched.worker_nodes
        self.worker_info, self._sync_members = launched.worker_info, launched.sync_members
        self._versions = {m: 0 for m in plan.trained}
        a = cfg.actor_config
        self.kl_ctrl = make_kl_controller(a.kl_ctrl, kl_coef=a.kl_loss_coef, target_kl=a.kl_target,
                                          horizon=a.kl_horizon)
        tokenizer = load_tokenizer(plan.model_paths[plan.tokenizer_model])
        # prompts, or preference pairs with a held-out part when the graph trains a reward model
        self.loader, held = make_loader(cfg, plan, tokenizer)
        self.evaluate = Evaluation(self, held, tokenizer)
        from .validation import Validation
        self.validation = Validation(self, tokenizer)
        truncation = self.loader.truncation_warning()  # once, at start: the count over the whole dataset
        if truncation:
            print(truncation, file=sys.stderr, flush=True)

    def _get(self, refs, what: str):
        """ray.get, bounded by STARTUP_TIMEOUT_S, that stops at a signal within POLL_S."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        deadline = time.time() + STARTUP_TIMEOUT_S
        waiting = list(refs)
        while waiting:
            self._check_signal()
            if time.time() > deadline:
                raise TrainingError(f"{what}: no answer within {STARTUP_TIMEOUT_S:.0f} s (are the Ray resources "
                                    "free? see `ray status`)")
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_S)
        try:
            return ray.get(refs, timeout=POLL_S)
        except RayTaskError as e:
            raise TrainingError(f"{what}: {_cause(e)}") from None
        except RayActorError as e:
            raise TrainingError(f"{what}: a worker died: {_first_line(e)}") from None

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> None:
        directory = checkpoint_dir(self.cfg.trainer.output_dir, step)
        for model, train_mfc in self.plan.trained.items():  # every rank: a sharded engine writes its shards
            self._get([w.save_checkpoint.remote(str(directory)) for w in self.workers[self.plan.group_of(train_mfc)]],
                      "saving a checkpoint")
        try:
            save_driver_state(directory, {"step": step, "loader": self.loader.state_dict(),
                                          "kl_coef": float(self.kl_ctrl.value), "versions": dict(self._versions),
                                          "config": self.cfg, "launched": self._launched, "layouts": self._layouts(),
                                          "in_flight": self._in_flight_state(step)})
            mark_latest(self.cfg.trainer.output_dir, directory, step)
        except CheckpointFileError as e:
            raise TrainingError(f"saving the checkpoint of step {step}: {e}") from None
        prune_checkpoints(self.cfg.trainer.output_dir, self.cfg.trainer.keep_checkpoints)  # only once complete

    def save_hf(self, step: int) -> Path | None:
        """The policy as a Hugging Face checkpoint in <output_dir>/hf/step_N (trainer.save_hf), and `hf/final`
        pointing at it: the actor's group exports its weights (every rank, the gathers being collective), its
        rank 0 writes them a bucket at a time (models/hf_export.py). None when the graph trains no policy."""
        from ..models.hf_export import link_final
        train_mfc = self.plan.trained.get("actor")
        if train_mfc is None:
            return None
        directory = Path(self.cfg.trainer.output_dir) / "hf" / checkpoint_dir(self.cfg.trainer.output_dir, step).name
        written = self._get([w.save_hf.remote("actor", str(directory))
                             for w in self.workers[self.plan.group_of(train_mfc)]],
                            f"saving the policy as a Hugging Face checkpoint in {directory}")
        if not any(written):   # no model to write (simulated stages)
            return None
        link_final(directory.parent, directory)
        self._hf_step = step
        return directory

    def _in_flight_state(self, steps_done: int) -> dict[int, dict]:
        """The steps already started beyond the last one trained (max_weight_staleness > 0): their stages
        are let finish, then each one's dock (rows, columns written, what each consumer took), the reports
        of its stages so far and its truncation count go into the checkpoint, so a resume neither loses
        nor repeats a row nor regenerates one with other weights."""
        out = {}
        for s in range(steps_done, self._launched):
            done = self._wait(s, self._pop_inflight(s), None)
            self._reports.setdefault(s, []).extend(done)
            out[s] = {"dock": self._dock("state_dict()", self.dock_of(s).state_dict, context=f"saving step {s}'s "
                                         "rows in flight"), "reports": list(self._reports[s]),
                      "truncated": self._truncated.get(s, 0)}
        return out

    def _maybe_resume(self) -> int:
        """Load the checkpoint `preflight` chose and checked into the workers, the loader and the docks."""
        if self._resume is None:
            return 0
        directory, state = self._resume.directory, self._resume.state
        for model, train_mfc in self.plan.trained.items():
            self._get([w.load_checkpoint.remote(str(directory))
                       for w in self.workers[self.plan.group_of(train_mfc)]], "loading a checkpoint")
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.value = state["kl_coef"]
        self._versions = dict(state["versions"])
        step = int(state["step"])
        self._launched = int(state.get("launched", step))
        for s_, st in state.get("in_flight", {}).items():
            self._dock("load_state_dict()", self.dock_of(s_).load_state_dict, st["dock"],
                       context=f"resuming step {s_}'s rows in flight")
            j = s_ % len(self.docks)
            self._dock_own[j] = int(st["dock"].get("step", 0))
            self._dock_steps[(j, self._dock_own[j])] = s_
            self._reports[s_] = list(st["reports"])
            self._truncated[s_] = st["truncated"]
        return step

    def _progress(self, start: int):
        if not self.cfg.trainer.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.cfg.trainer.total_steps, initial=start, desc="steps", dynamic_ncols=True,
                    file=sys.stderr)

    def shutdown(self) -> None:
        import ray
        split = [w for name, ws in self.workers.items() if self.plan.groups[name].rollout_backend for w in ws]
        if split:  # vLLM's worker processes end with the actor, but only a close removes their /dev/shm queues
            try:
                ray.wait([w.close_rollout.remote() for w in split], num_returns=len(split), timeout=CLOSE_TIMEOUT_S)
            except Exception:
                pass
        for ws in self.workers.values():
            for w in ws:
                try:
                    ray.kill(w)
                except Exception:
                    pass
        from ..engines.sync.shm_cleanup import remove_vllm_shm
        try:  # what vLLM's tensor-parallel engines left in /dev/shm, also when they died (their recorded objects)
            remove_vllm_shm([info["pid"] for info in self.worker_info.values() if "pid" in info],
                            started_after=self._t_start)
        except Exception as e:  # never hide the run's own error
            print(f"warning: removing vLLM's shared memory failed: {type(e).__name__}: {e}", file=sys.stderr)
        self.workers = {}
        if self.placement_groups:
            from ..parallel import remove_placement_groups
            try:
                remove_placement_groups(self.placement_groups)
            except Exception:
                pass
            self.placement_groups = {}
        for dock in self.docks:
            try:
                dock.close()  # its shared memory outlives the actor otherwise
                ray.kill(dock.actor)
            except Exception:
                pass
        self.docks = []
        if self.validation is not None:
            self.validation.close()
        if self.dock_calls is not None:
            self.dock_calls.close()
            self.dock_calls = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None


def check_ray_address(address: str) -> None:
    """Fail fast (ConfigError, exit 2) when nothing listens at `placement.ray_address`; ray.init would
    retry for minutes. `auto` and `local` are Ray's own words and are left to it."""
    import socket
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"placement.ray_address={address!r}: expected host:port (the head's GCS address, e.g. "
                          "10.0.0.1:6379), 'auto', or null to start a local Ray")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConfigError(f"placement.ray_address={address!r}: nothing answers there ({e.strerror or e}); start the "
                          "cluster's head (`ray start --head`), fix the address, or set placement.ray_address=null to "
                          "start a local Ray") from None


def _cache_env() -> str:
    from ..models import cache_dir
    return str(cache_dir())


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


def _ranks(dp: int) -> str:
    return "0" if dp == 1 else f"0-{dp - 1}"


def _cause(e: Exception) -> str:
    """The original error of a failed Ray task, without Ray's wrapping."""
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{cause}" if "stage '" in str(cause) else f"{type(cause).__name__}: {cause}"
    return _first_line(e)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class _Deferred:
    """A stage of a blocking-mode step, started when the driver gets to it (after the stages before it)."""

    def __init__(self, trainer: Trainer, step: int, mfc: MFCDef, kl_coef: float):
        self.trainer, self.step, self.mfc, self.kl_coef = trainer, step, mfc, kl_coef

    def start(self) -> list:
        return self.trainer._calls(self.step, [self.mfc], self.kl_coef)
