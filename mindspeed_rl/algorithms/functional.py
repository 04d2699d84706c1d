"""Small tensor helpers shared by the RL losses: masked reductions and whitening, per-token quantities
from logits, and outcome scores placed on the response's last token.

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


def float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the advantage math runs in: the inputs' promoted dtype when it is floating point
    (integer rewards are common), else torch's default float."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


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


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the selected positions (a scalar), verl's ``masked_var``.

    ``mean = masked_mean(values)``, then ``masked_mean((values - mean)**2)``; with ``unbiased`` that
    biased estimate is multiplied by ``count / (count - 1)`` (Bessel's correction, ``count`` = the
    mask's sum), as ``torch.var`` defaults to. Advantages are whitened with it, and the batch of
    tokens is a sample, hence the unbiased default.

    The centred values are zeroed outside the mask with ``torch.where`` *before* squaring: a NaN or
    inf in a padding slot then reaches neither the result nor, through ``(nan - mean)**2``'s
    backward, the gradient of the real positions.

        masked_var([[1., 2., nan], [3., 4., inf]], [[1, 1, 0], [1, 1, 0]])
          mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5 -> 5 / (4 - 1) = 1.6666667

    Raises:
        ValueError: ``unbiased`` and fewer than 2 selected positions (mask sum < 2): the correction
            ``count / (count - 1)`` divides by zero for one token and means nothing for none. verl
            raises here too; one real token has no spread to normalise by.
    """
    keep = mask != 0
    mean = masked_mean(values, mask)
    centred = torch.where(keep, values - mean, torch.zeros_like(values))
    variance = masked_mean(centred.square(), mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        if count.item() < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 masked positions, got a mask sum of "
                f"{count.item():g}: the unbiased variance multiplies by count / (count - 1), which is "
                "undefined for fewer than 2 values. Pass unbiased=False, or a batch with more real tokens."
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance over the mask, verl's ``masked_whiten``.

    ``(values - mean) * rsqrt(var + 1e-8)`` with the masked mean and the masked *unbiased* variance.
    PPO whitens its GAE advantages this way: their scale drifts with the reward scale and the
    critic's error, and a unit-scale advantage keeps the clipped policy loss (and so the useful
    learning rate) comparable from step to step. The ``1e-8`` keeps an all-equal batch at 0
    instead of 0/0. With ``shift_mean=False`` the mean is added back: only the scale is normalised.

    Positions outside the mask come back as exactly 0 (verl leaves them transformed): the mean and
    variance never see them, and zeroing them with ``torch.where`` means a NaN/inf in padding can
    neither stay in the output nor, through the backward of ``(nan - mean) * rstd``, reach the
    gradient of the real positions. Padding then pushes no gradient, as in ``broadcast_to_tokens``.

    Raises:
        ValueError: fewer than 2 selected positions (see ``masked_var``).
    """
    keep = mask != 0
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    centred = torch.where(keep, values - mean, torch.zeros_like(values))
    whitened = centred * torch.rsqrt(var + MASKED_MEAN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, torch.zeros_like(whitened))


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Turn one scalar score per response into token rewards: ``[batch], [batch, len] -> [batch, len]``.

    The score sits on the *last* real token of each row (the highest index the mask selects) and
    every other position gets 0; a row whose mask is all zero gets nothing.

    Why the last token: an outcome reward (a verifier's pass/fail, a reward model's score) judges
    the finished response, so it is earned by the action that completes it, the final token. Every
    earlier token is credited through the return: with no discount the reward-to-go of each real
    token is exactly the score (ReMax), and GAE carries it backwards through the critic's values
    (PPO). Per-token terms such as a KL penalty can be added on top. It is also where verl's reward
    managers write the score (``reward_tensor[i, valid_response_length - 1]``); taking the highest
    selected index rather than ``mask.sum() - 1`` gives the same place for right-padded rows and
    stays correct if the mask has gaps.

        outcome_token_rewards([1., -0.5], [[1, 1, 0], [1, 1, 1]]) = [[0, 1, 0], [0, 0, -0.5]]
    """
    if scores.dim() != 1 or mask.dim() != 2 or scores.shape[0] != mask.shape[0]:
        raise ValueError(
            f"expected scores [batch] (one scalar per response) and mask [batch, len] with equal batch, "
            f"got {tuple(scores.shape)} and {tuple(mask.shape)}"
        )
    if not scores.is_floating_point():
        scores = scores.float()
    if mask.shape[-1] == 0:  # empty responses: nothing to place the score on
        return torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    keep = mask != 0
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    last = torch.where(keep, positions, torch.full_like(positions, -1)).max(dim=-1).values
    is_last = positions == last.unsqueeze(-1)  # never true for an all-zero row (last = -1)
    return torch.where(is_last, scores.unsqueeze(-1), torch.zeros((), dtype=scores.dtype, device=scores.device))
