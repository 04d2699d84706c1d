"""Validation: held-out prompts through the run's own rollout and reward stages, at a pinned weight
version, into `val/*` metrics (`data.val_dataset`, `trainer.val_interval`, `trainer.val_before_train`,
`generate_config.val`); `cli/evaluate.py` runs the same with no training step.

Where it sits. After step N's weight sync (the weights of version N + 1, the policy after N + 1 trained
steps) and before step N + 1 starts anything, when (N + 1) is a multiple of `val_interval` or N is the
last step; with `val_before_train` also once on the starting weights. Nothing else runs then: a step of
`max_weight_staleness` k > 0 still in flight (its rollout started early, which only happens with
`guarantee_order: false`) is let finish first, so the weights cannot move while validation samples and
no collective call of a step interleaves with validation's. The rollout engine's version is checked in the
worker against the pinned one and logged as `val/weight_version`.

How. Validation's MFCs are the producer of `rm_scores` and the MFCs it reads from (`dataflow/validation.py`:
the rollout and the reward stages), on the workers that run them for training. Their rows live in a dock
of their own (the validation set's prompts x `generate_config.val.n`), whose consumers are those MFCs and
the driver's reader, which takes each row's reward once all stages are done. The MFCs' arguments are
training's with `generate_config.val`'s sampling over them.

It never changes training's numbers. Its prompts come from a loader of their own; its sampling seeds are
the per-row counters of the rollout (`compute.rollout_seed`) under a seed of validation's own, at step 0 for
every validation (so validations differ only by their weights, and evaluating the same weights again gives
the same responses); its rows are in another dock; no weight and no optimizer state is touched. A run with
validation has the training metrics of one without (`tests/trainer/test_validation.py`).

The record. A validation after step N goes into step N's record (`val/weight_version` N + 1); the one before
training into the first step's record, unless that step has its own (`val_interval` 1, or a one-step run):
then it is only printed. Every validation is printed as one line and kept in `Validation.results`.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..algorithms.pass_at_k import PASS_THRESHOLD, mean_pass_at_k
from ..config import Config, ConfigError
from ..dataflow import dock_columns, dock_consumers, topological_order
from ..dataflow.validation import READ_COLUMNS, READER, REWARD_COLUMN, validation_graph
from .errors import TrainingError
from .step_metrics import step_record

VAL_SEED_TAG = 0x76616C69   # validation's sampling seed: SeedSequence([trainer.seed, VAL_SEED_TAG])


def validation_on(cfg: Config) -> bool:
    has_set = cfg.data.val_dataset is not None or bool(cfg.data.val_fraction)
    return has_set and (cfg.trainer.val_interval > 0 or cfg.trainer.val_before_train)


def val_config(cfg: Config) -> Config:
    """`cfg` with generate_config's sampling replaced by generate_config.val's (null keeps training's) and
    n_samples_per_prompt = generate_config.val.n: what validation's MFC arguments are made from."""
    g, v = cfg.generate_config, cfg.generate_config.val
    keep = {k: getattr(v, k) if getattr(v, k) is not None else getattr(g, k)
            for k in ("temperature", "top_p", "top_k", "max_new_tokens")}
    return dataclasses.replace(cfg, generate_config=dataclasses.replace(g, **keep),
                               rl_config=dataclasses.replace(cfg.rl_config, n_samples_per_prompt=v.n))


def val_seed(seed: int) -> int:
    return int(np.random.SeedSequence([seed, VAL_SEED_TAG]).generate_state(1, dtype=np.uint64)[0] >> 1)


def load_val_dataset(cfg: Config):
    """data.val_dataset, or data.dataset's held-out share (data.val_fraction)."""
    from ..data.prompts import load_prompt_dataset
    d = cfg.data
    spec = d.val_dataset if d.val_dataset is not None else d.dataset
    return load_prompt_dataset(spec, prompt_key=d.prompt_key, answer_key=d.answer_key, num_digits=d.num_digits,
                               size=d.val_size, seed=cfg.trainer.seed, split="val", val_fraction=d.val_fraction)


def load_train_dataset(cfg: Config):
    from ..data.prompts import load_prompt_dataset
    d = cfg.data
    return load_prompt_dataset(d.dataset, prompt_key=d.prompt_key, answer_key=d.answer_key, num_digits=d.num_digits,
                               size=d.size, seed=cfg.trainer.seed, val_fraction=d.val_fraction)


def check_validation(cfg: Config, graph, check_files: bool) -> None:
    """Before Ray starts: the graph has stages to validate with, and the validation set exists, is not empty and
    has the keys (every row read, as the training set's check does). Raises ConfigError naming data.val_dataset."""
    if not validation_on(cfg):
        return
    try:
        validation_graph(graph)
    except ValueError as e:
        raise ConfigError(f"trainer.val_interval / val_before_train with rl_config.algorithm="
                          f"{cfg.rl_config.algorithm!r}: {e}") from None
    if not check_files:
        return
    from pathlib import Path

    from ..data.prompts import BUILTIN_PREFIX, SUFFIXES, check_prompt_file
    spec, d = cfg.data.val_dataset, cfg.data
    if spec is None:   # data.val_fraction: data.dataset's held-out share, whose file the plan checks
        try:
            load_val_dataset(cfg)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"data.dataset={d.dataset!r}: {e}") from None
        return
    try:
        if spec.startswith(BUILTIN_PREFIX):
            load_val_dataset(cfg)  # an unknown kind, or a task with no held-out prompt
        else:
            path = Path(spec).expanduser()
            if not path.is_file():
                raise ValueError(f"no such file; give a {'/'.join(SUFFIXES)} path or builtin:<kind> (a built-in "
                                 "task's held-out split)")
            if path.suffix.lower() not in SUFFIXES:
                raise ValueError(f"unsupported file type {path.suffix or '(none)'!r}; give a {'/'.join(SUFFIXES)} "
                                 "file")
            check_prompt_file(path, d.prompt_key, d.answer_key, setting_prefix="data.")
    except (ValueError, ImportError) as e:
        raise ConfigError(f"data.val_dataset={spec!r}: {e}") from None
    warning = overlap_warning(cfg)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def overlap_warning(cfg: Config) -> str | None:
    """A warning when data.val_dataset shares prompts with data.dataset, with the count: validation on
    prompts the policy trains on measures what it remembers, not what it learned. Built-in tasks' splits
    are disjoint by construction and not read for it."""
    from ..data.hash_split import overlap
    from ..data.prompts import BUILTIN_PREFIX
    d = cfg.data
    if d.val_dataset is None or (d.val_dataset.startswith(BUILTIN_PREFIX) and d.dataset.startswith(BUILTIN_PREFIX)):
        return None
    try:
        held, training = load_val_dataset(cfg), load_train_dataset(cfg)
    except (ValueError, ImportError):
        return None   # the training set's own check names its problem
    shared, distinct = overlap(training, held)
    if not shared:
        return None
    return (f"warning: data.val_dataset={d.val_dataset!r}: {shared} of its {distinct} distinct prompts are also "
            f"training prompts (data.dataset={d.dataset!r}); validation on them measures what the policy remembers, "
            "not what it learned: give held-out prompts, or data.val_dataset=null with data.val_fraction (a share "
            "of data.dataset held out by a hash of each prompt)")


def pass_threshold(cfg: Config) -> float | None:
    """The reward at which a validation response passes: generate_config.val.pass_threshold, else the rule
    rewards' full score (PASS_THRESHOLD) when the rule alone scores. A reward model's raw scores have no
    full score: without a stated threshold, None (no pass@k reported)."""
    stated = cfg.generate_config.val.pass_threshold
    if stated is not None:
        return float(stated)
    learned = cfg.reward_model.enable and cfg.rl_config.reward_weights.get("model", 0.0) != 0.0
    return None if learned else PASS_THRESHOLD


def val_metrics(record: dict, scores_by_prompt: list[list[float]], n: int,
                threshold: float | None = PASS_THRESHOLD) -> dict[str, float]:
    """`val/*` from a step record of validation's stages (`step_record`: reward/<x>_mean ->
    val/<x>_mean, response_length/mean -> val/response_length_mean) and each prompt's n rewards
    (val/pass@1 and val/pass@<n>, a response passing at reward >= `threshold`; none when it is None)."""
    out = {"val/reward_mean": record["reward/mean"], "val/response_length_mean": record["response_length/mean"]}
    for k, v in record.items():
        if k.startswith("reward/") and k.endswith("_mean"):
            out[f"val/{k[len('reward/'):]}"] = v
    if "response/truncated_fraction" in record:
        out["val/truncated_fraction"] = record["response/truncated_fraction"]
    if threshold is None:
        return out
    out["val/pass@1"] = mean_pass_at_k(scores_by_prompt, 1, threshold)
    if n > 1:
        out[f"val/pass@{n}"] = mean_pass_at_k(scores_by_prompt, n, threshold)
    return out


def format_val_line(metrics: dict[str, Any], prompts: int, n: int) -> str:
    keys = dict.fromkeys(("val/reward_mean", "val/pass@1", f"val/pass@{n}"))   # n = 1: pass@1 once
    shown = [f"{k} {metrics[k]:.3f}" for k in keys if k in metrics]
    return (f"validation (weight version {int(metrics['val/weight_version'])}, {prompts} prompts x {n}, "
            f"{metrics['timing/val']:.1f} s): " + " | ".join(shown))


class Validation:
    """The driver's side: the validation dock, its MFCs on the run's workers, when to run, the metrics."""

    def __init__(self, trainer, tokenizer):
        self.tr = trainer
        cfg = trainer.cfg
        t = cfg.trainer
        self.on = validation_on(cfg)
        self.interval, self.before, self.total = t.val_interval, t.val_before_train, t.total_steps
        self.results: list[dict[str, float]] = []
        self._first: tuple[int, dict] | None = None   # (the run's first step, the validation before it)
        self.dock = None
        if not self.on:
            return
        from ..data.loader import PromptLoader
        from ..transfer_dock.client import create_transfer_dock
        from ..workers.impls import PlanInfo, mfc_args
        plan = trainer.plan
        self.graph = validation_graph(plan.graph)
        self.order = topological_order(self.graph)
        self.n = cfg.generate_config.val.n
        self.threshold = pass_threshold(cfg)
        dataset = load_val_dataset(cfg)
        self.prompts = len(dataset)
        self.rows = self.prompts * self.n
        loader = PromptLoader(dataset, tokenizer, self.prompts, seed=t.seed, shuffle=False,
                              max_prompt_length=cfg.data.max_prompt_length, apply_chat_template=cfg.data.chat_template)
        batch = loader.next_batch()
        self.columns = {k: batch[k] for k in plan.dataset_keys}
        self.dock = create_transfer_dock(dock_columns(self.graph), dock_consumers(self.graph) + [READER], self.prompts,
                                         self.n, guarantee_order=True, default_timeout=t.stage_timeout_s)
        self.dock.worker = "driver"
        vcfg, seed = val_config(cfg), val_seed(t.seed)
        self.groups: dict[str, list[str]] = {}
        for m in self.order:
            self.groups.setdefault(plan.group_of(m.name), []).append(m.name)
        for group, names in self.groups.items():
            info = PlanInfo(trained_models=dict(plan.trained), dp=plan.groups[group].resources.dp,
                            rows_per_step=self.rows)
            args = {m.name: mfc_args(vcfg, m, info) for m in self.order if m.name in names}
            for a in args.values():
                if "seed" in a:
                    a["seed"] = seed
            trainer.collect([w.attach_validation.remote(self.dock, args, self.rows) for w in trainer.workers[group]],
                            f"attaching validation to worker group '{group}'")

    # ------------------------------------------------------------------ when
    def due_after(self, step: int) -> bool:
        return self.on and self.interval > 0 and ((step + 1) % self.interval == 0 or step + 1 == self.total)

    def before_train(self, start_step: int) -> None:
        """The validation of the starting weights (val_before_train), printed now, kept for the first record."""
        if not (self.on and self.before):
            return
        self._first = (start_step, self.run())
        if "console" in self.tr.cfg.trainer.logger:
            print(format_val_line(self._first[1], self.prompts, self.n), flush=True)

    def after_step(self, step: int) -> dict[str, float]:
        """What step `step`'s record gets: the validation after it when due, else the one before training
        when this is the run's first step."""
        out: dict[str, float] = {}
        if self._first is not None and self._first[0] == step:
            out.update(self._first[1])
            self._first = None
        if self.due_after(step):
            out.update(self.run())
        return out

    # ------------------------------------------------------------------ one validation
    def run(self) -> dict[str, float]:
        """Validate the weights the rollout engines hold now (the trainer's published version): the prompts
        into the validation dock, its stages started and waited for by the step pipeline's StageWatch (the
        same bounds and explanations as a training step's), the rewards read back."""
        import torch
        tr, watch = self.tr, self.tr.pipeline.watch
        version = tr.policy_version
        t0 = time.perf_counter()
        tr.pipeline.drain()   # steps run ahead: let them finish first
        context = f"validation at weight version {version}"
        rows = {k: [torch.from_numpy(v) for v in vals for _ in range(self.n)] for k, vals in self.columns.items()}
        watch.dock_call("put_experience() of the validation prompts", self.dock.put_experience, rows,
                        list(range(self.rows)), producer="dataset", context=context)
        reports = watch.wait(context, watch.start(0, self.order, version, 0.0, validation=True), self.dock)
        got, idx = watch.dock_call("get_experience() of the validation rewards", self.dock.get_experience, READER,
                                   list(READ_COLUMNS), self.rows, blocking=True,
                                   timeout=tr.cfg.trainer.stage_timeout_s, context=context)
        if sorted(idx) != list(range(self.rows)):
            raise TrainingError(f"{context}: the reader got {len(idx)} of {self.rows} rows of {list(READ_COLUMNS)}")
        watch.dock_call("clear()", self.dock.clear, context=context)
        score = {i: float(torch.as_tensor(s).reshape(-1)[0]) for i, s in zip(idx, got[REWARD_COLUMN])}
        by_prompt = [[score[p * self.n + j] for j in range(self.n)] for p in range(self.prompts)]
        record = step_record(SimpleNamespace(order=self.order, trained={}), 0, reports, step_s=0.0, stages_s=0.0,
                             sync={}, kl_coef=0.0, policy_version=version)
        versions = {int(r["metrics"]["weight_version_min"]) for r in reports if "weight_version_min" in r["metrics"]}
        if versions != {version}:
            raise TrainingError(f"{context}: the responses came from weight versions {sorted(versions)}")
        tr.samples.validation(tr.steps_done, version, reports)
        out = val_metrics(record, by_prompt, self.n, self.threshold)
        out.update({"val/weight_version": float(version), "val/prompts": float(self.prompts),
                    "timing/val": time.perf_counter() - t0})
        self.results.append(out)
        return out

    def close(self) -> None:
        """Free the validation dock (its shared memory outlives the actor otherwise)."""
        if self.dock is None:
            return
        import ray
        try:
            self.dock.close()
            ray.kill(self.dock.actor)
        except Exception as e:  # never hide the run's own error
            print(f"warning: closing the validation dock failed: {type(e).__name__}: {e}", file=sys.stderr)
        self.dock = None
