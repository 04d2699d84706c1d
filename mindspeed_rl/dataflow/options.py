"""What of an algorithm's graph a config switches on: the algorithm stays data, its MFC list a
function of these options.

verl decides the same way whether a reference policy exists (`use_reference_policy` = KL in the
loss or KL in the reward): a stage whose output nothing uses is not run, and its model is not
loaded. This project has no KL-in-reward, so the reference is needed exactly when the actor's
loss has a KL term with a coefficient above 0 (an adaptive controller scales its coefficient by a
factor, so one that starts at 0 stays 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from .mfc import MFCDef


@dataclass(frozen=True)
class AlgorithmOptions:
    use_reference: bool = True   # a frozen reference model gives ref_log_prob to the KL term of the loss
    off_policy_correction: bool = False  # the actor's loss reads rollout_log_prob (the behaviour policy)


FULL = AlgorithmOptions()


def reference_mfcs(options: AlgorithmOptions) -> list[MFCDef]:
    """The reference log-prob stage, or nothing when no KL term reads it."""
    if not options.use_reference:
        return []
    return [MFCDef("ref_log_prob", "ref", "inference", ("prompts", "responses"), ("ref_log_prob",),
                   output_key_remap={"log_prob": "ref_log_prob"})]


def train_inputs(options: AlgorithmOptions, *keys: str) -> tuple[str, ...]:
    """A train MFC's input keys, without ref_log_prob when there is no reference stage to write it, and
    without rollout_log_prob when the loss makes no off-policy correction (the train stage would wait for
    a column it does not read)."""
    return tuple(k for k in keys if (options.use_reference or k != "ref_log_prob")
                 and (options.off_policy_correction or k != "rollout_log_prob"))


def uses_kl_loss(use_kl_loss: bool, kl_loss_coef: float) -> bool:
    """Does the actor's loss have a KL term? (A coefficient of 0 adds nothing, so it has none.)"""
    return bool(use_kl_loss) and kl_loss_coef > 0


def options_from_config(cfg) -> AlgorithmOptions:
    """The options a `Config` implies (duck-typed: anything with `actor_config.use_kl_loss/kl_loss_coef`)."""
    a = cfg.actor_config
    return AlgorithmOptions(use_reference=uses_kl_loss(a.use_kl_loss, a.kl_loss_coef),
                            off_policy_correction=getattr(a, "off_policy_correction", "none") != "none")
