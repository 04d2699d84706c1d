"""One step's record: the stages' metric sums turned into the numbers metrics.jsonl, the console and the
dashboard show (reward/mean, actor/pg_loss, timing/<stage>, ...). Which metric a stage's sums make is
data (`dataflow/metrics.py`); the keys that follow the graph (a reward part, a trained model, a stage, a
synced model) come from metric families, each a function of the step's `StepInputs` registered with
`register_family` as a metric is with `register_metric`, in the order the record lists them.

Sums are kept per stage, because several stages run the same function (ReMax scores greedy and sampled
responses with one reward function); the column a stage produces says what its sums mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..algorithms.metrics import merge_metrics, metric_mean
from ..dataflow.metrics import COUNTED, REPORTED, StepMetric, stage_metrics


@dataclass(frozen=True)
class StepInputs:
    """What a step's record is made of: the plan's graph, the stages' reports and the driver's own figures."""
    plan: Any                           # planning/plan.py Plan (its order and trained models)
    step: int
    by_stage: dict[str, list[dict]]     # stage -> its ranks' reports
    producer: dict[str, str]            # dock column -> the stage that writes it
    step_s: float
    stages_s: float
    sync: dict                          # model -> its weight sync's seconds, checksum, readers, bytes
    kl_coef: float
    policy_version: int

    def sums(self, stage: str | None) -> dict[str, float]:
        """A stage's metric sums over its ranks and updates: _max maxed, _min minned, the rest summed."""
        out: dict[str, float] = {}
        for r in self.by_stage.get(stage, []):
            merge_metrics(out, r["metrics"])
        return out

    def of_column(self, column: str) -> dict[str, float]:
        """The sums of the stage that writes `column`."""
        return self.sums(self.producer.get(column))


Family = Callable[[StepInputs], dict[str, Any]]
METRIC_FAMILIES: dict[str, Family] = {}


def register_family(name: str) -> Callable[[Family], Family]:
    """Add (or replace) a family of step-record keys made by the decorated function of `StepInputs`; a
    replaced one keeps its place in the record."""
    def register(fn: Family) -> Family:
        METRIC_FAMILIES[name] = fn
        return fn
    return register


def step_record(plan, step: int, reports: list[dict], *, step_s: float, stages_s: float, sync: dict, kl_coef: float,
                policy_version: int) -> dict:
    """One record per step: the registered stage metrics (dataflow/metrics.py), then the registered families."""
    by_stage: dict[str, list[dict]] = {}
    for r in reports:
        by_stage.setdefault(r["stage"], []).append(r)
    inputs = StepInputs(plan, step, by_stage, {c: m.name for m in plan.order for c in m.output_keys}, step_s,
                        stages_s, sync, kl_coef, policy_version)
    rec: dict[str, Any] = {"step": step}
    for m in stage_metrics():
        value = metric_value(m, inputs.of_column(m.column), step)
        if value is not None:
            rec[m.key] = value
    for family in METRIC_FAMILIES.values():
        rec.update(family(inputs))
    return rec


def metric_value(m: StepMetric, sums: dict[str, float], step: int) -> float | None:
    """`m` from its stage's sums: the total over the count (an extreme as it is), None when `m.when` leaves it
    out of this record."""
    if m.when == REPORTED and m.total not in sums:
        return None
    count = sums.get(m.count, 0.0) if m.count else 1.0
    if m.when == COUNTED and not count > 0:
        return None
    per = count if m.when == COUNTED else max(count, 1.0)   # a count that may be 0 reads as 1
    value = metric_mean(m.total, sums.get(m.total, 0.0), per)
    return step - value if m.behind else value


@register_family("other_rewards")
def other_rewards(x: StepInputs) -> dict[str, float]:
    """reward/<column>_mean of every other stage that reports a reward (ReMax's greedy baseline); a rule score
    the combined reward sums is left out (its mean is reward/rule_mean)."""
    out = {}
    reward_stage = x.producer.get("rm_scores")
    for m in x.plan.order:
        if not m.output_keys or m.output_keys[0].endswith("rule_scores") or m.name == reward_stage:
            continue
        s_ = x.sums(m.name)
        if "reward_sum" in s_:
            out[f"reward/{m.output_keys[0]}_mean"] = s_["reward_sum"] / max(s_.get("reward_rows", 0.0), 1.0)
    return out


@register_family("reward_parts")
def reward_parts(x: StepInputs) -> dict[str, float]:
    """reward/<part>_mean of each part of a reward function with `parts`."""
    reward = x.of_column("rm_scores")
    rows = max(reward.get("reward_rows", 0.0), 1.0)
    return {f"reward/{k[len('reward_part_'):-len('_sum')]}_mean": v / rows for k, v in reward.items()
            if k.startswith("reward_part_") and k.endswith("_sum")}


@register_family("tool_calls")
def tool_calls(x: StepInputs) -> dict[str, float]:
    """The agent rollout's tool calls per row, and the count of each error status (malformed, raised, timeout)."""
    gen = x.of_column("responses")
    if "agent_turns_sum" not in gen:
        return {}
    statuses = {k[len("agent_calls_"):]: v for k, v in gen.items() if k.startswith("agent_calls_")}
    out = {"agent/calls_per_row": sum(statuses.values()) / max(gen.get("rows", 0.0), 1.0)}
    out.update({f"agent/calls_{status}": v for status, v in statuses.items() if status != "ok"})
    return out


@register_family("trained_models")
def trained_models(x: StepInputs) -> dict[str, float]:
    """<model>/<metric> of each trained model's train stage (actor/pg_loss, critic/vf_loss, ...): means over its
    micro-batches, the gradient norm over its updates."""
    out = {}
    for model, train_mfc in x.plan.trained.items():
        s_ = x.sums(train_mfc)
        mb = max(s_.get("micro_batches", 0.0), 1.0)
        for k, v in s_.items():
            if k not in ("micro_batches", "updates", "grad_norm", "version"):
                out[f"{model}/{k}"] = metric_mean(k, v, mb)
        if "updates" in s_:
            out[f"{model}/grad_norm"] = s_.get("grad_norm", 0.0) / s_["updates"]
            out[f"{model}/updates"] = s_["updates"]
    return out


@register_family("driver")
def driver_figures(x: StepInputs) -> dict[str, float]:
    """The driver's own: the KL coefficient in use, the policy's weight version, the step's and the stages' time."""
    return {"actor/kl_coef": x.kl_coef, "weight_version": x.policy_version, "timing/step": x.step_s,
            "timing/stages": x.stages_s}


@register_family("stage_times")
def stage_times(x: StepInputs) -> dict[str, float]:
    """timing/<stage> (first start to last end over its workers), busy/<stage> (their summed compute) and
    memory/peak_rss_gb/<stage> (the largest peak resident memory of the worker processes that ran it) and
    memory/rss_gb/<stage> (the largest resident memory of those processes after it, freed memory released)."""
    out = {}
    for stage, rs in x.by_stage.items():
        out[f"timing/{stage}"] = max(r["t_end"] for r in rs) - min(r["t_start"] for r in rs)
        out[f"busy/{stage}"] = sum(r["compute_s"] for r in rs)
        if any(r.get("peak_rss_bytes") for r in rs):
            out[f"memory/peak_rss_gb/{stage}"] = max(r.get("peak_rss_bytes", 0) for r in rs) / 2**30
        if any(r.get("rss_bytes") for r in rs):
            out[f"memory/rss_gb/{stage}"] = max(r.get("rss_bytes", 0) for r in rs) / 2**30
    return out


@register_family("weight_syncs")
def weight_syncs(x: StepInputs) -> dict[str, Any]:
    """timing/weight_sync and, per synced model, its checksum, readers and megabytes."""
    out: dict[str, Any] = {"timing/weight_sync": sum(s["seconds"] for s in x.sync.values())}
    for model, s in x.sync.items():
        if s["checksum"] is not None:
            out[f"weight_sync/{model}_checksum"] = s["checksum"]
        out[f"weight_sync/{model}_readers"] = s["readers"]
        if s["bytes"]:
            out[f"weight_sync/{model}_mb"] = s["bytes"] / 2**20
    return out


@register_family("throughput")
def throughput(x: StepInputs) -> dict[str, float]:
    """Prompt and response tokens of the step's rollout per second of the step."""
    gen = x.of_column("responses")
    tokens = gen.get("prompt_length_sum", 0.0) + gen.get("response_length_sum", 0.0)
    return {"throughput/tokens_per_s": tokens / x.step_s if x.step_s > 0 else 0.0}
