"""The actor's train step: optimizer steps of the clipped policy loss (+ entropy bonus, + KL to the reference,
+ the off-policy correction of rows from older weights).

The declaration, the sizes and loss settings it takes from actor_config, the loss a train engine calls per
micro-batch and the masks and matrices that loss is taken over sit in this one module. `PolicyTrain` is the
base of the other train steps (value_train.py, reward_train.py), which change only their config section,
sizes and loss; `token_mask` is the mask every per-token loss term is taken over, the critic's included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...algorithms import agg_loss, broadcast_to_tokens, corrected_policy_loss, kl_penalty, policy_loss
from ...dataflow.options import off_policy_correction, uses_kl_loss
from ..compute import Output, as_scalars, compute_step, rows_to_matrix
from ..impls import OPTIMIZER_STEP, Impl, PlanInfo


@dataclass
class PolicyLossConfig:
    clip_low: float
    clip_high: float
    clip_c: float
    agg: str
    use_kl_loss: bool
    kl_type: str
    entropy_coeff: float
    off_policy_correction: str = "none"   # algorithms.OFF_POLICY_CORRECTIONS
    tis_cap: float = 2.0


def policy_loss_fn(loss_cfg: PolicyLossConfig, kl_coef: float) -> Callable:
    """The actor's loss on one micro-batch, as a train engine calls it: (model output, micro-batch) ->
    (loss, metrics). Clipped policy loss (+ entropy bonus, + KL to the reference when the KL
    coefficient is > 0)."""
    def loss_fn(out, mb) -> tuple[torch.Tensor, dict[str, float]]:
        batch, logp = mb.data, out.log_probs
        mask = token_mask(out.response_mask, batch)
        width = mask.shape[1]
        # no old_log_prob column: an on-policy update, whose log-probs at its start are the old ones
        old = ((rows_to_matrix(batch["old_log_prob"], width) * mask.cpu()).to(logp.device)
               if "old_log_prob" in batch else logp.detach() * mask)
        adv = advantage_matrix(batch["advantages"], mask)
        if loss_cfg.off_policy_correction != "none":  # rows from older weights: weigh by behaviour IS (docs/async.md)
            behaviour = (rows_to_matrix(batch["rollout_log_prob"], width) * mask.cpu()).to(logp.device)
            pg_loss, pg_metrics = corrected_policy_loss(
                logp, old, behaviour, adv, mask, mode=loss_cfg.off_policy_correction, cap=loss_cfg.tis_cap,
                clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high, clip_c=loss_cfg.clip_c, agg=loss_cfg.agg)
        else:
            pg_loss, pg_metrics = policy_loss(logp, old, adv, mask, clip_low=loss_cfg.clip_low,
                                              clip_high=loss_cfg.clip_high, clip_c=loss_cfg.clip_c, agg=loss_cfg.agg)
        loss = pg_loss
        ent = agg_loss(out.entropy, mask, loss_cfg.agg)
        if loss_cfg.entropy_coeff:
            loss = loss - loss_cfg.entropy_coeff * ent
        kl_metric = {}
        if needs_reference(loss_cfg, kl_coef):
            if "ref_log_prob" not in batch:
                raise ValueError(f"the actor loss has a KL term (actor_config.use_kl_loss=true, KL coefficient "
                                 f"{kl_coef}) but the train MFC gets no ref_log_prob; build the graph with "
                                 "options_from_config(cfg) so it has the reference stage")
            ref = rows_to_matrix(batch["ref_log_prob"], width).to(logp.device)
            kl = agg_loss(kl_penalty(logp, ref, loss_cfg.kl_type), mask, loss_cfg.agg)
            loss = loss + kl_coef * kl
            kl_metric = {"kl": float(kl.detach())}
        off_policy = {{"kl": "behaviour_kl"}.get(k.split("/", 1)[1], k.split("/", 1)[1]): float(v)
                      for k, v in pg_metrics.items() if k.startswith("off_policy/")}  # actor/is_weight_mean, ...
        return loss, {"pg_loss": float(pg_loss.detach()), **kl_metric, "entropy": float(ent.detach()),
                      "pg_clipfrac": pg_metrics["pg_clipfrac"], "ppo_kl": pg_metrics["ppo_kl"],
                      "pg_clipfrac_lower": pg_metrics["pg_clipfrac_lower"], **off_policy}
    return loss_fn


def token_mask(response_mask: torch.Tensor, batch: dict) -> torch.Tensor:
    """The [B, R] mask every per-token term of a loss is taken over: the engine's response mask (1 on
    real response tokens), times the rows' `loss_mask` column when the batch has one (verl's
    `response_mask` of multi-turn rollouts: 1 on the model's own tokens, 0 on a tool's output, and
    all 0 on a row dropped from the loss). So the policy loss, its clip fractions, the entropy, the
    KL term and the advantages all leave tool tokens out, and a trajectory's loss equals the loss
    over its model tokens alone."""
    rows = batch.get("loss_mask")
    if rows is None:
        return response_mask
    return response_mask * rows_to_matrix(rows, response_mask.shape[1]).to(response_mask.device,
                                                                           response_mask.dtype)


def needs_reference(loss_cfg: PolicyLossConfig, kl_coef: float) -> bool:
    """Does this micro-batch's loss have a KL term? Not when the coefficient is 0: then nothing reads
    ref_log_prob, and the graph has no reference stage to write it (dataflow/options.py)."""
    return uses_kl_loss(loss_cfg.use_kl_loss, kl_coef)


def advantage_matrix(rows: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """[B, R] advantages: a one-value row (GRPO's per-response advantage) is broadcast over its
    tokens, a longer row (GAE, ReMax: one per token) is laid out along them."""
    if all(int(r.numel()) == 1 for r in rows):
        return broadcast_to_tokens(as_scalars(rows).to(mask.device), mask)
    return rows_to_matrix(rows, mask.shape[1]).to(mask.device) * mask


@compute_step("policy_train", "train_step", ("prompts", "responses", "advantages"),
              optional=("old_log_prob", "ref_log_prob", "rollout_log_prob", "loss_mask"), engine="policy",
              doc="clipped policy loss (+ KL to the reference when the KL coefficient is > 0, + the off-policy "
                  "correction from rollout_log_prob)")
class PolicyTrain(Impl):
    """Optimizer steps of the clipped policy loss (+ KL, entropy, off-policy correction)."""
    kind = OPTIMIZER_STEP
    section = "actor_config"

    @classmethod
    def sizes(cls, cfg, info: PlanInfo) -> dict:
        from ...config.sizes import train_sizes
        o, rl = getattr(cfg, cls.section), cfg.rl_config
        s = train_sizes(o.ppo_mini_batch_size, o.ppo_micro_batch_size_per_device, rl.prompts_per_step,
                        rl.n_samples_per_prompt, info.dp)   # dp replicas: tp/pp ranks share their rows
        return {"rows_per_device": s.rows_per_device, "mini_rows_per_device": s.mini_rows_per_device,
                "count": s.micro_rows}

    @classmethod
    def args(cls, cfg, mfc, info):
        o = cfg.actor_config
        return {**cls.sizes(cfg, info), "loss": {
            "clip_low": o.clip_ratio_low, "clip_high": o.clip_ratio_high, "clip_c": o.clip_ratio_c,
            "agg": o.loss_agg_mode, "use_kl_loss": o.use_kl_loss, "kl_type": o.kl_loss_type,
            "entropy_coeff": o.entropy_coeff, "off_policy_correction": off_policy_correction(cfg), "tis_cap": o.tis_cap}}

    def loss_fn(self):
        return policy_loss_fn(PolicyLossConfig(**self.args["loss"]), self.ctx.kl_coef)

    def run(self, unit, rows):
        """One optimizer step over a mini-batch's micro-batches (None on a rank whose engine gets them from its
        replica's reader); the MFC's input remaps applied as they stream from the dock."""
        from ...engines import MicroBatch
        mfc = self.ctx.mfc
        if unit is not None:
            unit = (MicroBatch({mfc.arg_name(k): v for k, v in mb.data.items()}, mb.loss_scale, mb.last)
                    for mb in unit)
        metrics = self.ctx.engine().train_step(unit, self.loss_fn())
        return Output({}, {**metrics, "updates": 1.0})
