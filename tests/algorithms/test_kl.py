"""kl_penalty estimators and the KL coefficient controllers, against hand-computed numbers."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.algorithms import (
    KL_CONTROLLER_KINDS,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    make_kl_controller,
)

# log_prob - ref_log_prob = d = [1, 0, -2]
LOGP = [0.0, -1.0, -2.0]
REF = [-1.0, -1.0, 0.0]

KL_VALUES = [
    ("k1", [1.0, 0.0, -2.0]),  # d
    ("kl", [1.0, 0.0, -2.0]),
    ("abs", [1.0, 0.0, 2.0]),  # |d|
    ("k2", [0.5, 0.0, 2.0]),  # 0.5 * d^2 = 0.5 * [1, 0, 4]
    ("mse", [0.5, 0.0, 2.0]),
    # k3: kl = ref - logp = [-1, 0, 2]; exp(kl) - kl - 1:
    #   e^-1 + 1 - 1 = 0.3678794;  1 - 0 - 1 = 0;  e^2 - 2 - 1 = 7.3890561 - 3 = 4.3890561
    ("k3", [0.3678794, 0.0, 4.3890561]),
    ("low_var_kl", [0.3678794, 0.0, 4.3890561]),
]


@pytest.mark.parametrize("kind, expected", KL_VALUES)
def test_kl_penalty_values(kind, expected):
    out = kl_penalty(torch.tensor(LOGP), torch.tensor(REF), kind)
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-6, rtol=0)


def test_every_kl_name_is_an_estimator_with_a_value_above():
    """KL_KINDS (config/vocab.py) is what the config accepts: each name selects an estimator, and the
    table above checks each one's numbers."""
    assert sorted(kind for kind, _ in KL_VALUES) == sorted(KL_KINDS)
    for kind in KL_KINDS:
        assert kl_penalty(torch.tensor(LOGP), torch.tensor(REF), kind).shape == (3,)


def test_kl_penalty_is_elementwise_on_2d():
    # [batch, len] in, [batch, len] out (the caller masks and aggregates).
    logp = torch.tensor([LOGP, REF])
    ref = torch.tensor([REF, REF])
    out = kl_penalty(logp, ref, "k2")
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.0, 2.0], [0.0, 0.0, 0.0]]))


def test_k3_clamped_at_10():
    # kl = ref - logp = 3: e^3 - 3 - 1 = 20.0855 - 4 = 16.0855 -> 10.
    # kl = -20: e^-20 + 20 - 1 = 19.0000000 -> 10.
    # kl = 50: first clamped to 20 (e^20 - 21 = 4.85e8, no overflow), then to 10.
    # kl = 2.3: e^2.3 - 3.3 = 9.9741825 - 3.3 = 6.6741825, below the clamp.
    ref = torch.tensor([3.0, -20.0, 50.0, 2.3])
    out = kl_penalty(torch.zeros(4), ref, "k3")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, 10.0, 6.6741825]), atol=1e-5, rtol=0)


def test_k3_gradient_hand_computed():
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp):
    #   kl = -1: 1 - 0.3678794 = 0.6321206;  kl = 0: 0;  kl = 2: 1 - 7.3890561 = -6.3890561
    #   kl = 3 (clamped at 10): 0
    logp = torch.tensor([0.0, -1.0, -2.0, 0.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, 0.0, 3.0])
    kl_penalty(logp, ref, "k3").sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.6321206, 0.0, -6.3890561, 0.0]), atol=1e-6, rtol=0)


def test_k2_gradient_hand_computed():
    # d/dlogp 0.5 * (logp - ref)^2 = logp - ref = [1, 0, -2]
    logp = torch.tensor(LOGP, requires_grad=True)
    kl_penalty(logp, torch.tensor(REF), "k2").sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([1.0, 0.0, -2.0]))


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match=r"'full'.*'k1'.*'low_var_kl'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "full")
    assert "full" not in KL_KINDS


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=10_000)
    assert ctl.value == 0.05


def test_adaptive_controller_hand_computed():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    # KL 9 vs target 6: error = 9/6 - 1 = 0.5 -> clipped to 0.2; mult = 1 + 0.2 * 1000/10000 = 1.02
    ctl.update(current_kl=9.0, n_steps=1000)
    assert ctl.value == pytest.approx(0.102, abs=1e-12)
    # KL 5.4: error = 0.9 - 1 = -0.1 (inside the clip); mult = 1 - 0.1 * 500/10000 = 0.995
    # 0.102 * 0.995 = 0.10149
    ctl.update(current_kl=5.4, n_steps=500)
    assert ctl.value == pytest.approx(0.10149, abs=1e-12)
    # KL 0: error = -1 -> clipped to -0.2; mult = 1 - 0.2 * 10000/10000 = 0.8; 0.10149 * 0.8 = 0.081192
    ctl.update(current_kl=0.0, n_steps=10_000)
    assert ctl.value == pytest.approx(0.081192, abs=1e-12)
    # KL on target: error 0, no change.
    ctl.update(current_kl=6.0, n_steps=10_000)
    assert ctl.value == pytest.approx(0.081192, abs=1e-12)
    assert type(ctl.value) is float


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"horizon must be > 0, got 0"):
        AdaptiveKLController(0.1, 6.0, 0)
    with pytest.raises(ValueError, match=r"target_kl must be > 0"):
        AdaptiveKLController(0.1, 0.0, 100)


def test_make_kl_controller():
    fixed = make_kl_controller("fixed", kl_coef=0.001)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.001
    # A whole config can be splatted in; fixed ignores target_kl / horizon.
    cfg = {"kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000}
    assert isinstance(make_kl_controller("fixed", **cfg), FixedKLController)
    adaptive = make_kl_controller("adaptive", **cfg)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.001, 0.1, 10000)


def test_every_controller_kind_builds():
    """KL_CONTROLLER_KINDS (config/vocab.py) is what the config accepts: each one builds a controller."""
    cfg = {"kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000}
    assert [type(make_kl_controller(k, **cfg)) for k in KL_CONTROLLER_KINDS] == [FixedKLController,
                                                                                 AdaptiveKLController]


def test_make_kl_controller_errors():
    with pytest.raises(ValueError, match=r"'pid'.*'fixed'.*'adaptive'"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match=r"needs target_kl and horizon"):
        make_kl_controller("adaptive", kl_coef=0.1, horizon=100)
    with pytest.raises(ValueError, match=r"horizon must be > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=-1)
