"""KL penalty between the policy and the frozen reference model, and controllers for its coefficient.

The penalty keeps the RL policy close to the reference (usually the SFT model) so it does not
drift into reward hacking. GRPO adds ``beta * kl`` to the loss (``use_kl_loss``); classic PPO
subtracts it from the token rewards instead. Either way the per-token estimate comes from
``kl_penalty`` and ``beta`` from a controller. Follows verl's ``core_algos.py``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..config.vocab import KL_CONTROLLER_KINDS, KL_KINDS  # KL_KINDS: grouped by the estimator each selects


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens (elementwise).

    With d = log_prob - ref_log_prob (tokens sampled from pi):

    * ``k1`` / ``kl``: ``d``. Unbiased, but high variance and can be negative per token.
    * ``abs``: ``|d|`` (verl also accepts it).
    * ``k2`` / ``mse``: ``0.5 * d**2``. Always >= 0, low variance, biased.
    * ``k3`` / ``low_var_kl``: ``exp(-d) + d - 1`` (written with kl = ref - logp as
      ``exp(kl) - kl - 1``). Unbiased *and* always >= 0, GRPO's choice. ``kl`` is clamped to
      [-20, 20] before ``exp`` and the result to [-10, 10] (in practice [0, 10], since
      exp(x) - x - 1 >= 0): one token where the policy and the reference disagree wildly would
      otherwise dominate the loss, or overflow. A clamped token gets zero gradient.

    Raises:
        ValueError: ``kind`` is not one of ``KL_KINDS``.
    """
    if kind in ("k1", "kl"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("k3", "low_var_kl"):
        kl = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
        ratio = torch.exp(kl)
        kld = ratio - kl - 1
        return torch.clamp(kld, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL penalty kind {kind!r}; expected one of {list(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient: ``value`` never changes (the usual GRPO setting)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so trainers can call ``update`` whatever the controller."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), as in verl.

    Nudges ``value`` so the measured KL tracks ``target_kl``: too much KL raises the coefficient,
    too little lowers it. Per update:

        error = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + error * n_steps / horizon

    The clip bounds how fast it reacts to one noisy measurement; ``horizon`` is how many samples
    it takes to move by about e^(+-0.2). verl calls ``update`` once per step with ``n_steps`` =
    the number of samples in the batch.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0 (it is divided by), got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale ``value`` by ``1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


KLController = Union[FixedKLController, AdaptiveKLController]


def make_kl_controller(
    kind: str,
    *,
    kl_coef: float,
    target_kl: Optional[float] = None,
    horizon: Optional[float] = None,
) -> KLController:
    """Build a KL controller from config fields (verl's ``kl_ctrl.type`` / ``kl_coef`` / ...).

    ``make_kl_controller("fixed", kl_coef=0.001)`` or
    ``make_kl_controller("adaptive", kl_coef=0.001, target_kl=0.1, horizon=10000)``; a whole config
    dict can be splatted in (``target_kl``/``horizon`` are ignored by ``fixed``).

    Raises:
        ValueError: unknown ``kind``, or ``adaptive`` without ``target_kl``/``horizon`` (or with
            non-positive ones).
    """
    if kind == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"adaptive KL controller needs target_kl and horizon, got target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; expected one of {list(KL_CONTROLLER_KINDS)}")
