"""`loss_mask` (1 on the model's tokens, 0 on a tool's output): a hand-made multi-turn trajectory's
loss, KL, entropy, clip fractions and gradient equal those of its model tokens alone."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.engines import MicroBatch
from mindspeed_rl.engines.base import ModelOutput
from mindspeed_rl.workers.steps.log_probs import logprob_diff
from mindspeed_rl.workers.steps.policy_train import PolicyLossConfig, policy_loss_fn
from mindspeed_rl.workers.steps.value_train import ValueLossConfig, value_loss_fn

# One trajectory of 7 tokens: model, model, tool, tool, tool, model, model (a call, its result, the answer)
# and a plain 3-token response. Tool positions hold log-probs the loss must never see (large, odd).
LOSS_MASK = [1, 1, 0, 0, 0, 1, 1]
LOGP = [-0.1, -0.2, -9.0, -7.5, -8.0, -0.3, -0.4]
OLD = [-0.15, -0.1, 0.0, 0.0, 0.0, -0.5, -0.3]
REF = [-0.2, -0.2, -1.0, -1.0, -1.0, -0.2, -0.6]
ENT = [1.0, 0.5, 3.0, 3.0, 3.0, 0.25, 0.75]
PLAIN = ([-0.5, -0.6, -0.7], [-0.4, -0.9, -0.7], [-0.5, -0.5, -0.5], [0.9, 0.8, 0.7])  # logp, old, ref, entropy


def _cfg(agg: str) -> PolicyLossConfig:
    return PolicyLossConfig(clip_low=0.2, clip_high=0.2, clip_c=3.0, agg=agg, use_kl_loss=True, kl_type="k3",
                              entropy_coeff=0.01)


def _run(rows_logp, rows_old, rows_ref, rows_ent, adv, loss_masks=None, agg="token-mean"):
    """The actor's loss on a micro-batch given per-row tensors, as the train engine calls it."""
    width = max(len(r) for r in rows_logp)
    mask = torch.zeros(len(rows_logp), width)
    logp = torch.zeros(len(rows_logp), width)
    ent = torch.zeros(len(rows_logp), width)
    for i, (lp, e) in enumerate(zip(rows_logp, rows_ent)):
        mask[i, :len(lp)] = 1
        logp[i, :len(lp)] = torch.tensor(lp)
        ent[i, :len(e)] = torch.tensor(e)
    logp.requires_grad_(True)
    data = {"old_log_prob": [torch.tensor(r) for r in rows_old], "ref_log_prob": [torch.tensor(r) for r in rows_ref],
            "advantages": [torch.tensor([a]) for a in adv]}
    if loss_masks is not None:
        data["loss_mask"] = [torch.tensor(m, dtype=torch.float32) for m in loss_masks]
    loss, metrics = policy_loss_fn(_cfg(agg), kl_coef=0.1)(ModelOutput(mask, logp, ent), MicroBatch(data, 1.0))
    loss.backward()
    return loss.detach(), metrics, logp.grad


def _model_only(xs):
    return [x for x, m in zip(xs, LOSS_MASK) if m]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_trajectorys_loss_equals_the_loss_over_its_model_tokens_alone(agg):
    adv = [1.5, -0.5]
    full = _run([LOGP, PLAIN[0]], [OLD, PLAIN[1]], [REF, PLAIN[2]], [ENT, PLAIN[3]], adv,
                loss_masks=[LOSS_MASK, [1, 1, 1]], agg=agg)
    alone = _run([_model_only(LOGP), PLAIN[0]], [_model_only(OLD), PLAIN[1]], [_model_only(REF), PLAIN[2]],
                 [_model_only(ENT), PLAIN[3]], adv, agg=agg)
    torch.testing.assert_close(full[0], alone[0], rtol=0, atol=1e-7)
    assert full[1].keys() == alone[1].keys()
    for k in full[1]:  # pg_loss, kl, entropy, clip fractions, ppo_kl
        assert full[1][k] == pytest.approx(alone[1][k], abs=1e-7), k
    grad = full[2][0]
    assert grad[[2, 3, 4]].abs().max() == 0, "no gradient reaches a tool token"
    torch.testing.assert_close(grad[[0, 1, 5, 6]], alone[2][0, :4], rtol=0, atol=1e-7)


def test_without_a_loss_mask_the_tool_tokens_would_count():
    adv = [1.5]
    masked = _run([LOGP], [OLD], [REF], [ENT], adv, loss_masks=[LOSS_MASK])[0]
    unmasked = _run([LOGP], [OLD], [REF], [ENT], adv)[0]
    assert abs(float(masked - unmasked)) > 0.1


def test_a_row_with_an_all_zero_loss_mask_is_left_out():
    # an overlong row dropped from the loss (overlong_buffer.drop_truncated): as if the batch did not hold it
    adv = [1.5, -0.5]
    dropped = _run([LOGP, PLAIN[0]], [OLD, PLAIN[1]], [REF, PLAIN[2]], [ENT, PLAIN[3]], adv,
                   loss_masks=[[0] * 7, [1, 1, 1]])
    alone = _run([PLAIN[0]], [PLAIN[1]], [PLAIN[2]], [PLAIN[3]], [adv[1]])
    torch.testing.assert_close(dropped[0], alone[0], rtol=0, atol=1e-7)
    assert dropped[2][0].abs().max() == 0


def test_value_loss_and_logprob_diff_respect_the_loss_mask():
    mask = torch.ones(1, 4)
    values = torch.tensor([[0.5, 9.0, 9.0, 0.25]], requires_grad=True)
    data = {"values": [torch.tensor([0.5, 0.0, 0.0, 0.25])], "returns": [torch.tensor([1.0, 0.0, 0.0, 1.0])],
            "loss_mask": [torch.tensor([1.0, 0.0, 0.0, 1.0])]}
    loss, _ = value_loss_fn(ValueLossConfig(clip_value=100.0, agg="token-mean"))(
        ModelOutput(mask, values=values), MicroBatch(data, 1.0))
    # 0.5 * mean((0.5 - 1)^2, (0.25 - 1)^2) = 0.5 * (0.25 + 0.5625) / 2 = 0.203125
    assert float(loss.detach()) == pytest.approx(0.203125)
    d = logprob_diff([torch.tensor([-0.1, -5.0, -0.3])], [torch.tensor([-0.2, 0.0, -0.3])],
                       [torch.tensor([1, 0, 1])])
    assert d["logprob_diff_tokens"] == 2 and d["logprob_diff_max"] == pytest.approx(0.1)
