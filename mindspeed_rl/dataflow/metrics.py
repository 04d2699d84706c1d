"""The step metrics as data: each one's name, where its value comes from, its console label and its chart.

A stage reports metric sums (`reward_sum`, `rows`, `logprob_diff_max`, ...: combined by the naming rule of
`algorithms/metrics.py`); a `StepMetric` says which record key is made of them: the stage that produces the
dock column `column`, its sum `total`, divided by its count `count` (an extreme stays as it is). The step
record (`trainer/step_metrics.py`), the console line (`trainer/run_log.py`) and the dashboard's charts
(`dashboard/state.py` puts `chart_specs()` into the snapshot, `static/dashboard.js` draws them) read this
list and nothing else, so a new metric is the code that reports it plus one `register_metric` line.

A metric without a `column` is recorded elsewhere (a trained model's loss as `<model>/<name>`, the driver's
timings, validation's `val/*`); its entry only says how it is shown. A key may hold a placeholder: `{stage}`
stands for each stage of the graph (the dashboard colors such a chart by stage), any other `{name}` for
whatever the records hold in its place (`val/pass@{n}`). Pure Python: importing this imports nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

ALWAYS, REPORTED, COUNTED = "always", "reported", "counted"   # when a stage-made metric is in the record
WHEN = (ALWAYS, REPORTED, COUNTED)


@dataclass(frozen=True)
class StepMetric:
    """One key of the step record and how it is made and shown."""
    key: str                 # its name in the record (metrics.jsonl, every logger, the dashboard)
    column: str = ""         # the dock column whose producing stage reports it ("": recorded elsewhere)
    total: str = ""          # that stage's metric it is made of: a sum (`reward_sum`) or an extreme (`*_max`)
    count: str = ""          # the stage's metric a sum is divided by, read as 1 below 1 unless COUNTED ("": the
                             # total as it is)
    when: str = ALWAYS       # ALWAYS (0 when the stage reported nothing), REPORTED (the stage reported
                             # `total`), COUNTED (the stage's `count` is > 0)
    behind: bool = False     # the step minus the value (how far a weight version lags the step)
    label: str = ""          # its name on the console line ("": not on it)
    fmt: str = ".3f"         # its format on the console line
    chart: str = ""          # the title of the dashboard chart that draws it ("": none)
    curve: bool = False      # drawn in the run's curve.png (a panel of its own)

    def __post_init__(self):
        if not isinstance(self.key, str) or "/" not in self.key:
            raise ValueError(f"StepMetric key={self.key!r}: name it <group>/<name>, e.g. 'reward/mean'")
        if self.when not in WHEN:
            raise ValueError(f"StepMetric {self.key!r}: when={self.when!r}; use one of {list(WHEN)}")
        if bool(self.column) != bool(self.total):
            raise ValueError(f"StepMetric {self.key!r}: column={self.column!r}, total={self.total!r}: a metric a "
                             "stage reports names both (the column its stage produces, the sum it reports)")
        if self.when == COUNTED and not self.count:
            raise ValueError(f"StepMetric {self.key!r}: when={COUNTED!r} needs a count")


STEP_METRICS: dict[str, StepMetric] = {}


def register_metric(metric: StepMetric) -> StepMetric:
    """Add (or replace) a step metric; its place in the record, on the console line and among the charts is
    the order of registration (a replaced one keeps its place)."""
    if not isinstance(metric, StepMetric):
        raise TypeError(f"register_metric: {metric!r} is not a StepMetric")
    STEP_METRICS[metric.key] = metric
    return metric


def stage_metrics() -> list[StepMetric]:
    """The metrics a stage's sums make, in registration order."""
    return [m for m in STEP_METRICS.values() if m.column]


def console_metrics() -> list[tuple[str, str, str]]:
    """(key, label, format) of each metric on the console line, in order."""
    return [(m.key, m.label, m.fmt) for m in STEP_METRICS.values() if m.label]


def curve_metrics() -> list[str]:
    """The keys curve.png draws, one panel each, in registration order."""
    return [m.key for m in STEP_METRICS.values() if m.curve]


def chart_specs() -> list[dict]:
    """The dashboard's per-step charts: {title, keys, stageKeys} in the order their first metric was
    registered; `stageKeys` when the keys are per stage (drawn in the stages' colors)."""
    charts: dict[str, list[str]] = {}
    for m in STEP_METRICS.values():
        if m.chart:
            charts.setdefault(m.chart, []).append(m.key)
    return [{"title": title, "keys": keys, "stageKeys": any("{stage}" in k for k in keys)}
            for title, keys in charts.items()]


REWARD, RESPONSES = "rm_scores", "responses"
for _m in (
    # the reward that trains (its stage: the producer of rm_scores)
    StepMetric("reward/mean", REWARD, "reward_sum", "reward_rows", label="reward", chart="Reward", curve=True),
    StepMetric("reward/max_fraction", REWARD, "reward_max_count", "reward_rows", chart="Reward"),
    StepMetric("reward/rule_mean", REWARD, "rule_reward_sum", "reward_rows", REPORTED, label="rule"),
    StepMetric("reward/model_mean", REWARD, "model_reward_sum", "reward_rows", REPORTED, label="model", fmt="+.3f"),
    StepMetric("reward/overlong_penalty_mean", REWARD, "overlong_penalty_sum", "reward_rows", REPORTED),
    # a trained reward model (reward modeling) and its held-out pairs
    StepMetric("reward/loss", label="rm_loss", fmt=".4f"),
    StepMetric("reward/accuracy", label="rm_acc"),
    StepMetric("eval/accuracy", label="eval_acc"),
    # the actor's loss (recorded as actor/<name> from its train stage)
    StepMetric("actor/pg_loss", label="pg_loss", fmt="+.4f", chart="Policy loss"),
    StepMetric("actor/kl", label="kl", fmt=".4f", chart="KL to the reference"),
    StepMetric("actor/entropy", label="entropy", chart="Entropy"),
    StepMetric("actor/grad_norm", chart="Gradient norm"),
    # the rollout (its stage: the producer of responses)
    StepMetric("response_length/mean", RESPONSES, "response_length_sum", "rows", label="resp_len", fmt=".2f",
               chart="Response length"),
    StepMetric("response_length/max", RESPONSES, "response_length_max", "rows", chart="Response length"),
    StepMetric("response/truncated_fraction", RESPONSES, "truncated_count", "rows", REPORTED),
    StepMetric("agent/turns_mean", RESPONSES, "agent_turns_sum", "rows", REPORTED),
    StepMetric("agent/tool_tokens_mean", RESPONSES, "agent_tool_tokens_sum", "rows", REPORTED),
    StepMetric("async/staleness_max", RESPONSES, "weight_version_min", "rows", REPORTED, behind=True),
    StepMetric("async/staleness_mean", RESPONSES, "weight_version_sum", "rows", REPORTED, behind=True),
    # rl_config.partial_rollout: rows of the micro-batches whose weights moved while they were generated
    StepMetric("async/partial_fraction", RESPONSES, "partial_count", "rows", REPORTED),
    # the trainer's log-probs against the rollout's (verl's rollout_probs_diff): ~1e-6 on-policy proves the
    # sync arrived
    StepMetric("rollout/logprob_diff_max", "old_log_prob", "logprob_diff_max", "logprob_diff_tokens", COUNTED),
    StepMetric("rollout/logprob_diff_mean", "old_log_prob", "logprob_diff_sum", "logprob_diff_tokens", COUNTED),
    # a critic's values and GAE's returns
    StepMetric("critic/values_mean", "values", "values_sum", "values_tokens", COUNTED),
    StepMetric("critic/returns_mean", "returns", "returns_sum", "returns_tokens", COUNTED),
    # the driver's timings and throughput
    StepMetric("timing/step", label="step_s", fmt=".2f", chart="Step time (s)", curve=True),
    StepMetric("timing/stages", chart="Step time (s)"),
    StepMetric("timing/weight_sync", chart="Step time (s)"),
    StepMetric("throughput/tokens_per_s", label="tok/s", fmt=".0f", chart="Throughput (tokens/s)"),
    StepMetric("timing/{stage}", chart="Per-stage time (s)"),
    StepMetric("busy/{stage}", chart="Per-stage compute (s)"),
    StepMetric("memory/peak_rss_gb/{stage}", chart="Peak host memory of each stage's workers (GB)"),
    StepMetric("memory/rss_gb/{stage}", chart="Host memory of each stage's workers after it (GB)"),
    # validation on held-out prompts (trainer/validation.py)
    StepMetric("val/reward_mean", label="val_reward", chart="Validation (held-out prompts)"),
    StepMetric("val/pass@1", label="val_pass@1", chart="Validation (held-out prompts)"),
    StepMetric("val/pass@{n}", chart="Validation (held-out prompts)"),
):
    register_metric(_m)
