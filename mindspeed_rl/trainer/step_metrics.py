"""One step's record: the stages' metric sums turned into the numbers metrics.jsonl, the console and the
dashboard show (reward/mean, actor/pg_loss, timing/<stage>, ...).

Sums are kept per stage, because several stages run the same function (ReMax scores greedy and sampled
responses with one reward function); the column a stage produces says what its sums mean.
"""
from __future__ import annotations

from typing import Any

from ..algorithms.metrics import merge_metrics, metric_mean


def step_record(plan, step: int, reports: list[dict], *, step_s: float, stages_s: float, sync: dict, kl_coef: float,
                policy_version: int) -> dict:
    """One record per step. Metric sums are kept per stage, because several stages run the same
    function (ReMax scores greedy and sampled responses with one reward function)."""
    by_stage: dict[str, list[dict]] = {}
    for r in reports:
        by_stage.setdefault(r["stage"], []).append(r)

    def sums(stage: str | None) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in by_stage.get(stage, []):  # over ranks and updates: _max maxed, _min minned, the rest summed
            merge_metrics(out, r["metrics"])
        return out

    producer = {c: m.name for m in plan.order for c in m.output_keys}
    rec: dict[str, Any] = {"step": step}
    reward = sums(producer.get("rm_scores"))
    rows = max(reward.get("reward_rows", 0.0), 1.0)
    rec["reward/mean"] = reward.get("reward_sum", 0.0) / rows
    rec["reward/max_fraction"] = reward.get("reward_max_count", 0.0) / rows
    for source in ("model", "rule"):  # a learned reward: each source of rm_scores alone, whatever its weight
        if f"{source}_reward_sum" in reward:
            rec[f"reward/{source}_mean"] = reward[f"{source}_reward_sum"] / rows
    for m in plan.order:  # other reward columns (ReMax's greedy baseline): reward/<column>_mean
        if m.output_keys and m.output_keys[0].endswith("rule_scores"):
            continue  # a rule score the combined reward sums (its mean: reward/rule_mean, and the greedy one's sum)
        if m.name != producer.get("rm_scores") and "reward_sum" in sums(m.name):
            s_ = sums(m.name)
            rec[f"reward/{m.output_keys[0]}_mean"] = s_["reward_sum"] / max(s_.get("reward_rows", 0.0), 1.0)
    gen = sums(producer.get("responses"))
    gen_rows = max(gen.get("rows", 0.0), 1.0)
    rec["response_length/mean"] = gen.get("response_length_sum", 0.0) / gen_rows
    rec["response_length/max"] = gen.get("response_length_max", 0.0)
    if "truncated_count" in gen:  # rows cut by max_new_tokens (rl_config.overlong_buffer acts on them)
        rec["response/truncated_fraction"] = gen["truncated_count"] / gen_rows
    if "agent_turns_sum" in gen:  # the agent rollout (generate_config.agent): turns and tool calls per row
        rec["agent/turns_mean"] = gen["agent_turns_sum"] / gen_rows
        rec["agent/tool_tokens_mean"] = gen.get("agent_tool_tokens_sum", 0.0) / gen_rows
        statuses = {k[len("agent_calls_"):]: v for k, v in gen.items() if k.startswith("agent_calls_")}
        rec["agent/calls_per_row"] = sum(statuses.values()) / gen_rows
        for status, v in statuses.items():
            if status != "ok":  # malformed, raised, timeout: calls that got an error result
                rec[f"agent/calls_{status}"] = v
    for k, v in reward.items():  # a reward function's parts (its `parts`), the overlong penalty
        if k.startswith("reward_part_") and k.endswith("_sum"):
            rec[f"reward/{k[len('reward_part_'):-len('_sum')]}_mean"] = v / rows
    if "overlong_penalty_sum" in reward:
        rec["reward/overlong_penalty_mean"] = reward["overlong_penalty_sum"] / rows
    if "weight_version_min" in gen:  # how many versions behind the weights that generated the rows were
        rec["async/staleness_max"] = step - gen["weight_version_min"]
        rec["async/staleness_mean"] = step - gen["weight_version_sum"] / gen_rows
    old = sums(producer.get("old_log_prob"))  # the rollout's log-probs against the trainer's (verl's
    if old.get("logprob_diff_tokens"):       # rollout_probs_diff): ~1e-6 on-policy proves the sync arrived
        rec["rollout/logprob_diff_max"] = old["logprob_diff_max"]
        rec["rollout/logprob_diff_mean"] = old["logprob_diff_sum"] / old["logprob_diff_tokens"]
    for stage in ("values", "returns"):
        s_ = sums(producer.get(stage))
        if s_.get(f"{stage}_tokens"):
            rec[f"critic/{stage}_mean"] = s_[f"{stage}_sum"] / s_[f"{stage}_tokens"]
    for model, train_mfc in plan.trained.items():  # actor/pg_loss, critic/vf_loss, ...
        s_ = sums(train_mfc)
        mb = max(s_.get("micro_batches", 0.0), 1.0)
        for k, v in s_.items():
            if k not in ("micro_batches", "updates", "grad_norm", "version"):
                rec[f"{model}/{k}"] = metric_mean(k, v, mb)
        if "updates" in s_:
            rec[f"{model}/grad_norm"] = s_.get("grad_norm", 0.0) / s_["updates"]
            rec[f"{model}/updates"] = s_["updates"]
    rec["actor/kl_coef"] = kl_coef
    rec["weight_version"] = policy_version
    rec["timing/step"] = step_s
    rec["timing/stages"] = stages_s
    for stage, rs in by_stage.items():
        rec[f"timing/{stage}"] = max(r["t_end"] for r in rs) - min(r["t_start"] for r in rs)
        rec[f"busy/{stage}"] = sum(r["compute_s"] for r in rs)
    rec["timing/weight_sync"] = sum(s["seconds"] for s in sync.values())
    for model, s in sync.items():
        if s["checksum"] is not None:
            rec[f"weight_sync/{model}_checksum"] = s["checksum"]
        rec[f"weight_sync/{model}_readers"] = s["readers"]
        if s["bytes"]:
            rec[f"weight_sync/{model}_mb"] = s["bytes"] / 2**20
    tokens = gen.get("prompt_length_sum", 0.0) + gen.get("response_length_sum", 0.0)
    rec["throughput/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
    return rec
