"""What of an algorithm's graph a config switches on: the algorithm stays data, its MFC list a
function of these options.

verl decides the same way whether a reference policy exists (`use_reference_policy` = KL in the
loss or KL in the reward): a stage whose output nothing uses is not run, and its model is not
loaded. This project has no KL-in-reward, so the reference is needed exactly when the actor's
loss has a KL term with a coefficient above 0 (an adaptive controller scales its coefficient by a
factor, so one that starts at 0 stays 0).

The reward is decided the same way (`reward_mfcs`): a rule reward alone writes `rm_scores`; with a reward
model (`reward_model.enable`) its inference MFC and the rule (when `rl_config.reward_fn` names one) each
write their own score and a compute MFC combines them by `rl_config.reward_weights` into `rm_scores`, so
the advantage stages read the same column either way.
"""
from __future__ import annotations

from dataclasses import dataclass

from .mfc import MFCDef


@dataclass(frozen=True)
class AlgorithmOptions:
    use_reference: bool = True   # a frozen reference model gives ref_log_prob to the KL term of the loss
    off_policy_correction: bool = False  # the actor's loss reads rollout_log_prob (the behaviour policy)
    reward_model: bool = False   # a reward model scores the responses (reward_model.enable)
    rule_reward: bool = True     # a rule reward scores them (rl_config.reward_fn is set)
    agent: bool = False          # the rollout is the agent loop (generate_config.agent.enable): writes loss_mask
    loss_mask: bool = False      # a loss_mask column (agent rollout, or overlong_buffer.drop_truncated)
    dynamic_sampling: bool = False  # stages after the reward wait for the driver's gate column (rollout_options.py)
    recompute_log_prob: bool = True  # the actor's log-probs before the update (old_log_prob) by a forward of its own


FULL = AlgorithmOptions()


def reference_mfcs(options: AlgorithmOptions) -> list[MFCDef]:
    """The reference log-prob stage, or nothing when no KL term reads it."""
    if not options.use_reference:
        return []
    return [MFCDef("ref_log_prob", "ref", "inference", ("prompts", "responses"), ("ref_log_prob",),
                   output_key_remap={"log_prob": "ref_log_prob"})]


def old_log_prob_mfcs(options: AlgorithmOptions) -> list[MFCDef]:
    """The actor's log-probs before the update, or nothing when the update is on-policy: then the old
    log-probs equal the update's own at its start, and the loss takes those, detached (TRL's way), saving a
    forward over every row."""
    if not options.recompute_log_prob:
        return []
    return [MFCDef("actor_log_prob", "actor", "inference", ("prompts", "responses", "rollout_log_prob"),
                   ("old_log_prob",), output_key_remap={"log_prob": "old_log_prob"})]


def reward_mfcs(options: AlgorithmOptions, responses: str = "responses", out: str = "rm_scores",
                prefix: str = "") -> list[MFCDef]:
    """The MFCs that score `responses` into the column `out` (ReMax scores its greedy responses too: `prefix`
    "greedy_" names their stages and columns apart).

    A rule reward alone: `rule_reward` writes `out`. With a reward model: `reward_model` (model `reward`,
    inference) writes `model_scores`, `rule_reward` (when there is a rule) writes `rule_scores`, and
    `combine_reward` writes their weighted sum to `out`. The rule runs whatever its weight, so its mean is
    logged beside the model's (`reward/rule_mean`, `reward/model_mean`)."""
    rule, model, combine = ((f"{prefix}reward", f"{prefix}reward_model", f"combine_{prefix}reward") if prefix else
                            ("rule_reward", "reward_model", "combine_reward"))
    remap_in = {responses: "responses"} if responses != "responses" else {}
    if not options.reward_model:
        return [MFCDef(rule, "reward", "compute", ("prompts", responses, "labels"), (out,), fn="rule_reward",
                       input_key_remap=remap_in, output_key_remap={"rm_scores": out} if out != "rm_scores" else {})]
    model_col, rule_col = f"{prefix}model_scores", f"{prefix}rule_scores"
    mfcs = [MFCDef(model, "reward", "inference", ("prompts", responses), (model_col,), fn="reward_model_score",
                   input_key_remap=remap_in,
                   output_key_remap={"model_scores": model_col} if model_col != "model_scores" else {})]
    if options.rule_reward:
        mfcs.append(MFCDef(rule, "reward", "compute", ("prompts", responses, "labels"), (rule_col,), fn="rule_reward",
                           input_key_remap=remap_in, output_key_remap={"rm_scores": rule_col}))
    inputs = (model_col, rule_col) if options.rule_reward else (model_col,)
    mfcs.append(MFCDef(combine, "reward", "compute", inputs, (out,), fn="combine_reward",
                       input_key_remap={c: c[len(prefix):] for c in inputs if prefix},
                       output_key_remap={"rm_scores": out} if out != "rm_scores" else {}))
    return mfcs


def train_inputs(options: AlgorithmOptions, *keys: str) -> tuple[str, ...]:
    """A train MFC's input keys, without ref_log_prob when there is no reference stage to write it, without
    old_log_prob when no stage recomputes it, and without rollout_log_prob when the loss makes no off-policy
    correction (the train stage would wait for a column it does not read)."""
    return tuple(k for k in keys if (options.use_reference or k != "ref_log_prob")
                 and (options.recompute_log_prob or k != "old_log_prob")
                 and (options.off_policy_correction or k != "rollout_log_prob"))


def on_policy_update(cfg) -> bool:
    """Does each step's rows feed exactly one optimizer step of the weights that generated them? Then the
    log-probs before the update equal the update's own (duck-typed over a `Config`)."""
    a, rl = cfg.actor_config, cfg.rl_config
    one_step = not a.ppo_mini_batch_size or a.ppo_mini_batch_size >= rl.prompts_per_step
    return (one_step and rl.max_weight_staleness == 0 and not getattr(rl, "dynamic_sampling", False)
            and off_policy_correction(cfg) == "none")


def off_policy_correction(cfg) -> str:
    """`actor_config.off_policy_correction`, with null meaning: tis when rl_config.partial_rollout is on (a row's
    tokens then come from two versions, so neither is its behaviour policy: each token's own log-prob is), else
    none."""
    chosen = getattr(cfg.actor_config, "off_policy_correction", None)
    if chosen is not None:
        return chosen
    return "tis" if getattr(getattr(cfg, "rl_config", None), "partial_rollout", False) else "none"


def recomputes_log_prob(cfg) -> bool:
    """`actor_config.recompute_log_prob`, with null meaning: only when the update is not on-policy."""
    chosen = getattr(cfg.actor_config, "recompute_log_prob", None)
    return (not on_policy_update(cfg)) if chosen is None else bool(chosen)


def uses_kl_loss(use_kl_loss: bool, kl_loss_coef: float) -> bool:
    """Does the actor's loss have a KL term? (A coefficient of 0 adds nothing, so it has none.)"""
    return bool(use_kl_loss) and kl_loss_coef > 0


def options_from_config(cfg) -> AlgorithmOptions:
    """The options a `Config` implies (duck-typed: anything with `actor_config.use_kl_loss/kl_loss_coef`)."""
    a = cfg.actor_config
    rm = getattr(cfg, "reward_model", None)
    rl = getattr(cfg, "rl_config", None)
    return AlgorithmOptions(use_reference=uses_kl_loss(a.use_kl_loss, a.kl_loss_coef),
                            off_policy_correction=off_policy_correction(cfg) != "none",
                            reward_model=bool(getattr(rm, "enable", False)),
                            rule_reward=bool(getattr(rl, "reward_fn", "digits")),
                            agent=bool(getattr(getattr(getattr(cfg, "generate_config", None), "agent", None), "enable",
                                               False)),
                            loss_mask=bool(getattr(getattr(getattr(cfg, "generate_config", None), "agent", None),
                                                   "enable", False)
                                           or getattr(getattr(rl, "overlong_buffer", None), "drop_truncated", False)),
                            dynamic_sampling=bool(getattr(rl, "dynamic_sampling", False)),
                            recompute_log_prob=recomputes_log_prob(cfg) if rl is not None else True)
