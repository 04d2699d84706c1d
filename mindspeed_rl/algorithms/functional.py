"""Small tensor helpers shared by the RL losses: masked reductions and per-token quantities from logits.

Conventions (same as verl's ``verl/utils/torch_functional.py``):

* A *mask* has the shape of the values it selects; 1 (or True) marks a real response token, 0 marks
  padding. Masks may be bool, int or float.
* Reductions add ``1e-8`` to the count instead of clamping it, so an all-zero mask gives ``0.0``,
  never NaN. The price is that a "mean" is ``sum / (count + 1e-8)``: off by a relative 1e-8/count,
  far below float32 resolution for any real count.
* Positions outside the mask are replaced by 0 *before* summing, so a NaN or inf sitting in a
  padding slot (a garbage log-prob past EOS, say) cannot leak into the result: plain
  ``values * mask`` would turn ``inf * 0`` into NaN.
"""
from __future__ import annotations

from typing import Optional

import torch

# The additive guard verl puts in masked means' denominators.
MASKED_MEAN_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values`` over the positions ``mask`` selects (over everything, or along ``dim``).

    Masked-out positions are zeroed with ``torch.where`` first, so NaN/inf there never reach the sum
    (and receive zero gradient). A fractional mask weights the kept values, as ``values * mask`` would.
    """
    mask = mask.to(values.dtype)
    kept = torch.where(mask != 0, values, torch.zeros_like(values)) * mask
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over the selected positions: ``masked_sum / (mask.sum() + 1e-8)``.

    This is the per-token average the PPO/GRPO papers write as E_t over real tokens. The ``+1e-8``
    is verl's: with nothing selected the result is 0 rather than 0/0 = NaN, so a micro-batch that
    happens to hold only padding contributes nothing instead of poisoning the step.

        masked_mean([[1., 2., 100.]], [[1, 1, 0]]) = (1 + 2) / 2 = 1.5   (the padded 100 never counts)
    """
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + MASKED_MEAN_EPS)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position: ``[..., vocab] -> [...]``.

    H = -sum_i p_i log p_i, and since log p_i = z_i - logsumexp(z) this equals
    ``logsumexp(z) - sum_i p_i z_i``. That form (verl's) never takes the log of a probability that
    underflowed to 0, and logsumexp subtracts the max internally, so large logits do not overflow.

    Precision note: the two terms are each about max(z), so their difference loses about
    ``|max(z)| * machine_eps`` absolutely (~6e-6 for |z| = 100 in float32). Negligible for LM logits;
    it is verl's formula and costs no extra vocab-sized buffer.

    Logits of ``-inf`` (a vocabulary masked out by top-k, say) give ``0 * -inf = NaN``, as in verl.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of its logits: ``[..., V], [...] -> [...]``.

    This is what engines compute for ``old_log_prob`` / ``ref_log_prob`` / ``log_prob``: the
    log-softmax over the vocabulary, then the entry of the token that was actually sampled.
    ``log_softmax`` is used (not ``log(softmax)``) so tiny probabilities stay finite.

    Note the usual causal shift is the caller's job: the logits at position t predict token t+1.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)
