"""Activation checkpointing and token-budget micro-batches on the multi-rank backends, real processes over
gloo (no mocks): FSDP2 at dp 2 and the mesh at tp 2 (and pp 2). Each spawn runs every combination of the
two switches (tests/engines/_feature_ranks.py) and each is compared with the plain path on the same rank:
log-probs (and a critic's values), the train step's loss metrics and gradients, in fp32 to 1e-6.

The DP ranks are given rows that split into different numbers of token-budget forwards, so a rank with
fewer runs dummy forwards (and takes them through the backward) for its gathers to pair up with the
other's: a mismatch would hang (bounded by run_procs' timeout) or fail."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.engines.sync.weight_sync import free_port

from . import _feature_ranks as F
from . import _mp_workers as W
from ._common import random_rows, save_tiny4

TOL = dict(rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    """The 4-layer tiny Qwen2 (4 heads, 2 KV heads: tp 2 splits whole heads)."""
    return save_tiny4(tmp_path_factory.mktemp("tiny4") / "model", seed=7)


def assert_same(got: dict, want: dict, keys=("before", "after")) -> None:
    for key in keys:
        assert want[key] is None or len(got[key]) == len(want[key])
        for g, w in zip(got[key] or [], want[key] or []):
            torch.testing.assert_close(g, w, **TOL)
    torch.testing.assert_close(got["grads"], want["grads"], **TOL)
    for name, value in want["stats"].items():
        if name != "micro_batches":
            assert got["stats"][name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


@pytest.mark.slow
def test_fsdp_dp2_checkpointing_and_token_budget_equal_the_plain_path(path, tmp_path):
    # rank 0: long, uneven rows (its micro-batches split into several forwards); rank 1: short ones (one each)
    rows = [(random_rows(6, [2, 7, 3, 1, 6, 2], seed=21), random_rows(6, [9, 1, 2, 8, 3, 1], seed=22)),
            (random_rows(4, [2, 3, 1, 2], seed=23), random_rows(4, [2, 1, 3, 2], seed=24))]
    sizes = [[3, 3], [2, 2]]
    port = free_port()
    results = W.run_procs([(F.fsdp, (r, 2, port, path, rows[r], sizes[r])) for r in range(2)], tmp_path,
                          timeout_s=180)
    for res in results:
        plain = res[(False, None)]
        for combo in F.COMBOS[1:]:
            for kind in ("causal_lm", "value"):
                assert_same(res[combo][kind], plain[kind])
        for budget in (None, 24):   # checkpointing recomputes every training forward of the layer once
            for kind in ("causal_lm", "value"):
                on, off = res[(True, budget)][kind]["layer_calls"], res[(False, budget)][kind]["layer_calls"]
                assert on == 2 * off, (budget, kind, on, off)
    # the budget split rank 0's micro-batches and inference into more forwards than rank 1's: rank 1 ran
    # dummy forwards, in the backward too
    r0, r1 = results[0][(False, 24)], results[1][(False, 24)]
    assert r0["splits"] == [2, 2] and r1["splits"] == [1, 1]
    assert r0["infer_groups"] > r1["infer_groups"]
    assert r1["causal_lm"]["layer_calls"] == sum(r0["splits"])


MESH_ROWS = (random_rows(6, [2, 7, 3, 1, 6, 2], seed=21), random_rows(6, [9, 1, 2, 8, 3, 1], seed=22))


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_mesh_checkpointing_and_token_budget_equal_the_plain_path(path, tmp_path, options):
    """tp 2: the token-budget forwards joined before the loss, as on one rank. pp 2: the groups are
    pipeline micro-batches, trained with the gradient of the joined micro-batch's loss (one
    forward-only pass first: 4 forwards of the stage's first layer plus 4 in training, 8 with the recompute)."""
    port = free_port()
    results = W.run_procs([(F.mesh, (r, 2, port, path, options, MESH_ROWS, [3, 3])) for r in range(2)], tmp_path,
                          timeout_s=180)
    for res in results:
        plain = res[(False, None)]
        for combo in F.COMBOS[1:]:
            assert_same(res[combo], plain)
        calls = {combo: res[combo]["layer_calls"] for combo in F.COMBOS}
        if "tp" in options:
            assert calls == {(False, None): 2, (True, None): 4, (False, 24): 4, (True, 24): 8}
        else:
            assert calls == {(False, None): 2, (True, None): 4, (False, 24): 8, (True, 24): 12}
