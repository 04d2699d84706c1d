"""The driver: reads like a single-process program.

    plan = make_plan(cfg)                 # graph, columns, consumers, groups: all derived
    docks, workers = start(plan)
    for step: reports = pipeline.run(step) -> sync weights -> log -> clear its dock -> checkpoint

Everything about overlapping stages and steps (`rl_config.blocking`, `max_weight_staleness`) lives in
the step pipeline (`pipeline.py`): the docks of the steps in flight, their stage calls, their reports.
Every wait is bounded (`stage_watch.py`): a stage that makes no progress for `trainer.stage_timeout_s`,
a worker that dies, or a failed stage stops the run within seconds, naming the stage and the cause
(the late stage, not only the one that waited; a dead worker and every stage it hosted); a dock that
stops answering names the call, the step and the stages waiting (`dock_calls.py`).
SIGINT and SIGTERM stop the run at once, start-up included, and clean up as a crash does;
`Interrupted` carries the one line to print (`errors.py`). Before Ray starts, the output directory is
locked and checked (`run_dir.py`), and a resume's checkpoint is found, checked and compared with the
config (`checkpoint.resume_point`, `resume.py`), so a user's mistake costs seconds, not a cluster start.
While it runs, a dashboard on 127.0.0.1 shows each stage's consumption and a timeline of the
micro-batches; at the end (also after a crash) `report.html` keeps the same views (docs/dashboard.md).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Config
from ..models.files import CheckpointFileError
from ..planning import Plan, format_plan, landed_dict, make_plan, write_plan_json
from .checkpoint import (ResumePoint, checkpoint_dir, mark_latest, prune_checkpoints, read_latest, save_driver_state,
                         write_manifest)
from .dock_calls import DockCalls, DockSilent
from .dynamic_sampling import DynamicSampling
from .errors import Interrupted, TrainingError
from .launch import LaunchError, group_bundles, launch_workers
from .pipeline import StepPipeline, close_docks, open_docks
from .ray_session import RaySession, stop_workers
from .preflight import layouts, preflight
from .reward_modeling import save_final, trains_reward_model
from .run_dashboard import DashboardError, finish_dashboard, start_dashboard
from .run_dir import RunDirectory
from .run_log import MetricsFileError, RunInfo, RunLog, plot_curve
from .samples import SampleLog
from .shared_dir import with_absolute_output_dir
from .signals import SignalTrap
from .stage_watch import StageWatch, collect
from .step_metrics import step_record

__all__ = ["Interrupted", "Trainer", "TrainingError"]

STARTUP_TIMEOUT_S = 300.0
SAVE_EVERY_S = 2.0  # dashboard.json in output_dir: rewritten at most this often while the run goes


class Trainer:
    """One training run from a config: the plan, Ray and the workers, the steps (`StepPipeline`), weight
    sync, logs, validation, checkpoints and exports, and a clean end however the run ends."""

    def __init__(self, cfg: Config):
        cfg = with_absolute_output_dir(cfg)   # not each node's `ray start` directory (trainer/shared_dir.py)
        self.cfg = cfg
        self.plan: Plan = make_plan(cfg, check_files=not cfg.trainer.dry_run)
        self.workers: dict[str, list[Any]] = {}
        self.docks: list = []   # one per step in flight: rl_config.max_weight_staleness + 1
        self.pipeline: StepPipeline | None = None  # the steps in flight (pipeline.py), set at start
        self.ray = RaySession()
        self.placement_groups: dict = {}   # placement.mode=mesh: device -> (Ray placement group, bundle)
        self.group_placement_groups: dict = {}  # other groups: group -> its placement group (bundle k: actor k)
        self.worker_nodes: dict[str, list[str]] = {}  # group -> the Ray node id of each rank
        self.device_nodes: dict[int, str] = {}        # mode mesh: device -> the Ray node it was placed on
        self.dashboard = None  # DashboardState while a run with trainer.dashboard or trainer.report goes
        self.dashboard_server = None
        self.log: RunLog | None = None
        self.evaluate = lambda step: {}    # reward modeling: trainer/reward_modeling.py Evaluation, set at start
        self.validation = None             # trainer/validation.py Validation (data.val_dataset), set at start
        self.samples = None                # trainer/samples.py SampleLog: what the model answers, set at start
        self.worker_info: dict[tuple[str, int], dict] = {}  # (group, rank) -> its ping: pid, host, node id
        self.run_id = ""                              # set at launch: the run's token, carried by its checkpoints
        self.step = 0             # the step running (or about to), for an interrupted run's message
        self.steps_done = 0
        self.signals = SignalTrap()      # SIGINT/SIGTERM raise at once in the main thread (signals.py)
        self.run_dir = RunDirectory(cfg.trainer.output_dir)
        self._resume: ResumePoint | None = None
        self._hf_step = -1               # the step of the last Hugging Face export (trainer.save_hf)
        self.dock_calls: DockCalls | None = None
        self._t_start = time.time()      # shm_cleanup: records of processes older than this run are not ours

    # ------------------------------------------------------------------ the run
    def run(self) -> list[dict]:
        cfg = self.cfg
        if cfg.trainer.dry_run:
            print(self.describe())
            print(f"plan: {write_plan_json(self.plan, cfg.trainer.output_dir)}")
            return []
        error: BaseException | None = None
        self.signals.trap()
        try:
            start_step, self._resume = preflight(cfg, self.plan, self.run_dir)  # before Ray starts
            if start_step is None:  # a resume with nothing left to train
                from .run_log import read_metrics
                path = os.path.join(cfg.trainer.output_dir, "metrics.jsonl")
                return read_metrics(Path(path)) if os.path.exists(path) else []
            start_step = self._open()
            bar = self._progress(start_step)
            for step in range(start_step, cfg.trainer.total_steps):
                self.step = step
                self._check_signal()
                record = self.train_step(step, bar)
                record.update(self.evaluate(step))   # reward modeling: held-out accuracy and margin when due
                record.update(self.validation.after_step(step))  # val/* when due, at the weights just synced
                self._log(record, bar)
                self._save_when_due(step + 1)
                self.steps_done = step + 1
            if bar is not None:
                bar.close()
            self._close(start_step)
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
                # before shutdown: the dock still answers for the last view
                finish_dashboard(self.dashboard, self.dashboard_server, cfg, error)
                self.dashboard_server = None
                if self.log is not None:
                    self.log.close()
                self.shutdown()
            finally:
                self.run_dir.release()
                self.signals.restore()

    def _open(self) -> int:
        """Everything a run needs before its first step: plan.json, the dashboard, Ray, the workers, a
        resume's state, the run log, the first weight sync; returns the step it starts at."""
        cfg = self.cfg
        write_plan_json(self.plan, cfg.trainer.output_dir)   # what the plan decided, for tools and users
        try:  # a port in use fails before Ray starts
            self.dashboard, self.dashboard_server = start_dashboard(cfg, self.plan)
        except DashboardError as e:
            raise TrainingError(str(e)) from None
        self.ray.start(cfg, self.plan)
        self.signals.trap()  # again: ray.init installs a SIGTERM handler of its own (sys.exit)
        self._start()
        start_step = self._maybe_resume()
        self.step = self.steps_done = start_step
        try:
            self.log = RunLog(cfg.trainer.output_dir, cfg.trainer.logger, resume_step=start_step,
                              info=RunInfo.of(cfg))
        except MetricsFileError as e:
            raise TrainingError(f"trainer.resume=true: {e}") from None
        self.samples = SampleLog(cfg.trainer.output_dir, cfg.trainer.log_samples, self.dashboard, self.log.trackers,
                                 resume_step=start_step)
        if self.dashboard is not None:
            for record in self.log.history:  # a resumed run's earlier steps
                self.dashboard.add_record(record)
            self.dashboard.attach(self.docks, start_step,
                                  step_of=lambda j, own: self.pipeline.step_of(j, own, start_step))
        self._sync_weights()
        self.validation.before_train(start_step)   # trainer.val_before_train: the starting weights
        return start_step

    def _log(self, record: dict, bar) -> None:
        """The step's record to every logger, the dashboard and the progress bar."""
        t = self.cfg.trainer
        line = self.log.log(record)
        if self.dashboard is not None:
            self.dashboard.add_record(record)
            if t.report:
                self.dashboard.save(t.output_dir, every_s=SAVE_EVERY_S)  # for cli/dashboard.py
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"reward {record['reward/mean']:.3f}", refresh=False)
        if "console" in t.logger:
            (bar.write if bar is not None else print)(line)

    def _save_when_due(self, steps_done: int) -> None:
        """A checkpoint every trainer.save_interval steps and after the last one (and the policy in HF
        format with it under trainer.save_hf=every_save)."""
        t = self.cfg.trainer
        if t.save_interval and (steps_done % t.save_interval == 0 or steps_done == t.total_steps):
            self.save(steps_done)
            if t.save_hf == "every_save":
                self.save_hf(steps_done)

    def _close(self, start_step: int) -> None:
        """After the last step: the policy in HF format, a trained reward model, the curve."""
        cfg = self.cfg
        if cfg.trainer.save_hf != "never" and self.steps_done > start_step and self._hf_step != self.steps_done:
            exported = self.save_hf(self.steps_done)
            if exported is not None:
                print(f"policy (Hugging Face checkpoint): {exported.parent / 'final'}", file=sys.stderr, flush=True)
        if trains_reward_model(self.plan) and cfg.trainer.total_steps:
            print(f"reward model: {save_final(self)}", file=sys.stderr, flush=True)
        if cfg.trainer.plot and self.log.history:
            plot_curve(self.log.history, self.log.dir / "curve.png", title=f"{cfg.rl_config.algorithm} "
                       f"({'blocking' if cfg.rl_config.blocking else 'non-blocking'})")

    # ------------------------------------------------------------------ signals (signals.py)
    def _check_signal(self) -> None:
        if self.signals.pending():
            raise self._interrupted()

    def _interrupted(self) -> Interrupted:
        t = self.cfg.trainer
        return Interrupted(self.signals.received or signal.SIGINT, self.step, self.steps_done, t.total_steps,
                           read_latest(t.output_dir), t.save_interval)

    # ------------------------------------------------------------------ a step
    def train_step(self, step: int, bar=None) -> dict:
        """One step: its rows through every stage (`pipeline.py`: with staleness k, step t+k's rollout
        starts beside step t's training), the trained weights published as version step + 1, its dock
        cleared, its record."""
        t0 = time.perf_counter()
        if self.dashboard is not None:
            self.dashboard.begin_step(step)
        reports = self.pipeline.run(step, self.policy_version, float(self.kl_ctrl.value), bar)
        t_stages = time.perf_counter()
        for model in self.plan.trained:
            self._versions[model] = step + 1
        sync = self._sync_weights()
        if self.dashboard is not None:  # the step's final consumption and events, before its dock is cleared
            self.dashboard.end_step(step, [{"stage": r["stage"], "worker": f"{self.plan.group_of(r['stage'])}/"
                                            f"{r['rank']}", "t_start": r["t_start"], "t_end": r["t_end"],
                                            **({"weight_version": int(r["metrics"]["weight_version_min"])}
                                               if "weight_version_min" in r["metrics"] else {})}
                                           for r in reports])
        own = self.pipeline.clear(step)  # dynamic sampling's metrics and the prompts cut to max_prompt_length
        self.samples.training(step, reports)
        record = self._metrics(step, reports, time.perf_counter() - t0, t_stages - t0, sync)
        record.update(own)
        if record.get("actor/kl") is not None:
            self.kl_ctrl.update(record["actor/kl"], self.plan.rows_per_step)
        return record

    def _dock(self, what: str, fn, *args, context: str = "", **kwargs):
        """A dock call from the driver: bounded and interruptible (`dock_calls.py`); a silent dock ends
        the run naming the call, the step and the stages that were running."""
        try:
            return self.dock_calls.call(what, fn, *args, context=context, **kwargs)
        except DockSilent as e:
            raise TrainingError(str(e)) from None

    # ------------------------------------------------------------------ weights
    @property
    def policy_version(self) -> int:
        return self._versions.get("actor", 0)

    def _sync_weights(self) -> dict:
        """Publish each trained model's weights to its readers, a bucket at a time; with
        `weight_sync.verify`, compare the checksums of what was sent, received and is served."""
        out = {}
        for model in self.plan.trained:
            version = self._versions.get(model, 0)
            results = self.collect([w.sync_weights.remote(model, version) for w in self._sync_members[model]],
                                   f"weight sync of '{model}'")
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

    # ------------------------------------------------------------------ start-up and shutdown
    def describe(self) -> str:
        from ..dataflow import describe
        memory = "\n".join(self.plan.memory.lines()) if self.plan.memory is not None else ""
        return ("dataflow graph\n" + describe(self.plan.graph) + "\n\nplacement plan\n" + format_plan(self.plan)
                + ("\n\n" + memory if memory else ""))

    def _start(self) -> None:
        from ..algorithms import make_kl_controller
        from ..models import load_tokenizer
        from .reward_modeling import Evaluation, make_loader
        from .validation import Validation

        cfg, plan = self.cfg, self.plan
        self.dock_calls = DockCalls(timeout_s=max(10.0, cfg.trainer.stage_timeout_s))
        sampling = DynamicSampling(cfg)  # rl_config.dynamic_sampling (a no-op when off)
        self.docks = open_docks(cfg, plan, sampling)
        from ..parallel import create_group_placement_groups, create_placement_groups, placement_group_nodes
        if plan.placement is not None:
            try:
                self.placement_groups = create_placement_groups(plan.placement, cfg.placement.cpus_per_device,
                                                                timeout_s=STARTUP_TIMEOUT_S)
                self.device_nodes = placement_group_nodes(self.placement_groups)
            except (ValueError, TimeoutError) as e:
                raise TrainingError(f"placement.mfcs: {e}") from None
        try:   # the groups outside a mesh: reserved all at once per group, or not at all
            bundles, member_of = group_bundles(plan)
            reserved = create_group_placement_groups(bundles, STARTUP_TIMEOUT_S)
            self.group_placement_groups = {g: reserved[r] for g, r in member_of.items() if r in reserved}
        except TimeoutError as e:
            raise TrainingError(f"placement.groups: {e}") from None
        try:
            launched = launch_workers(cfg, plan, self.docks, self.placement_groups, self.group_placement_groups,
                                      {"MINDSPEED_RL_CACHE": _cache_env()}, self.collect)
        except LaunchError as e:
            raise TrainingError(str(e)) from None
        self.workers, self.worker_nodes = launched.workers, launched.worker_nodes
        self.worker_info, self._sync_members = launched.worker_info, launched.sync_members
        self.run_id = launched.run_id
        write_plan_json(plan, cfg.trainer.output_dir, landed_dict(self.worker_info, self.device_nodes))
        self._versions = {m: 0 for m in plan.trained}
        a = cfg.actor_config
        self.kl_ctrl = make_kl_controller(a.kl_ctrl, kl_coef=a.kl_loss_coef, target_kl=a.kl_target,
                                          horizon=a.kl_horizon)
        tokenizer = load_tokenizer(plan.model_paths[plan.tokenizer_model])
        # prompts, or preference pairs with a held-out part when the graph trains a reward model
        loader, held = make_loader(cfg, plan, tokenizer)
        watch = StageWatch(plan, self.workers, self.worker_info, cfg.trainer.stage_timeout_s, self._dock,
                           self._check_signal)
        self.pipeline = StepPipeline.of(cfg, plan, self.docks, loader, sampling, watch, self._dock)
        self.evaluate = Evaluation(self, held, tokenizer)
        self.validation = Validation(self, tokenizer)
        truncation = loader.truncation_warning()  # once, at start: the count over the whole dataset
        if truncation:
            print(truncation, file=sys.stderr, flush=True)

    def collect(self, refs, what: str) -> list:
        """The results of calls to workers outside a step (set-up, checkpoints, exports, evaluation),
        bounded and interruptible (`stage_watch.collect`); `what` names the calls in an error."""
        return collect(refs, what, self._check_signal, STARTUP_TIMEOUT_S)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> None:
        directory = checkpoint_dir(self.cfg.trainer.output_dir, step)
        parts: dict[str, list[dict]] = {}
        for group in self._training_groups():   # every rank: a sharded engine writes its shards
            written = self.collect([w.save_checkpoint.remote(str(directory), self.run_id)
                                    for w in self.workers[group]], "saving a checkpoint")
            for rank, records in enumerate(written):
                parts[f"{group}/{rank}"] = records
        try:  # the loader's position first: the steps in flight are let finish below (pipeline.state_dict)
            save_driver_state(directory, {"step": step, "loader": self.pipeline.loader.state_dict(),
                                          "kl_coef": float(self.kl_ctrl.value), "versions": dict(self._versions),
                                          "config": self.cfg, "layouts": layouts(self.plan),
                                          **self.pipeline.state_dict(step)})
            write_manifest(directory, self.run_id, step, parts)   # last: the checkpoint is complete
            mark_latest(self.cfg.trainer.output_dir, directory, step)
        except CheckpointFileError as e:
            raise TrainingError(f"saving the checkpoint of step {step}: {e}") from None
        prune_checkpoints(self.cfg.trainer.output_dir, self.cfg.trainer.keep_checkpoints)  # only once complete

    def _training_groups(self) -> list[str]:
        """The worker groups that train a model, each once: a worker saves and loads all its trained models'
        state in one call (a colocated group trains the actor and the critic)."""
        return list(dict.fromkeys(self.plan.group_of(m) for m in self.plan.trained.values()))

    def save_hf(self, step: int) -> Path | None:
        """The policy as a Hugging Face checkpoint in <output_dir>/hf/step_N (trainer.save_hf), and `hf/final`
        pointing at it: the actor's group exports its weights (every rank, the gathers being collective), its
        rank 0 writes them a bucket at a time (models/hf_export.py). None when the graph trains no policy."""
        from ..models.hf_export import link_final
        train_mfc = self.plan.trained.get("actor")
        if train_mfc is None:
            return None
        directory = Path(self.cfg.trainer.output_dir) / "hf" / checkpoint_dir(self.cfg.trainer.output_dir, step).name
        written = self.collect([w.save_hf.remote("actor", str(directory))
                                for w in self.workers[self.plan.group_of(train_mfc)]],
                               f"saving the policy as a Hugging Face checkpoint in {directory}")
        if not any(written):   # the engines hold no model to write
            return None
        link_final(directory.parent, directory)
        self._hf_step = step
        return directory

    def _maybe_resume(self) -> int:
        """Load the checkpoint `preflight` chose and checked into the workers, the loader and the docks."""
        if self._resume is None:
            return 0
        directory, state = self._resume.directory, self._resume.state
        for group in self._training_groups():
            self.collect([w.load_checkpoint.remote(str(directory), str(state["run_id"]))
                          for w in self.workers[group]], "loading a checkpoint")
        self.pipeline.loader.load_state_dict(state["loader"])
        self.kl_ctrl.value = state["kl_coef"]
        self._versions = dict(state["versions"])
        step = int(state["step"])
        self.pipeline.load_state_dict(state, step)
        return step

    def _progress(self, start: int):
        if not self.cfg.trainer.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.cfg.trainer.total_steps, initial=start, desc="steps", dynamic_ncols=True,
                    file=sys.stderr)

    def shutdown(self) -> None:
        """Stop the workers, free the docks, end Ray: after a finished run, an error or a signal alike."""
        stop_workers(self.workers, self.plan, self.worker_info, self.placement_groups, started_after=self._t_start,
                     group_placement_groups=self.group_placement_groups)
        self.workers, self.placement_groups, self.group_placement_groups = {}, {}, {}
        close_docks(self.docks)
        self.docks = []
        if self.validation is not None:
            self.validation.close()
        if self.dock_calls is not None:
            self.dock_calls.close()
            self.dock_calls = None
        self.ray.stop()


def _cache_env() -> str:
    from ..models import cache_dir
    return str(cache_dir())
