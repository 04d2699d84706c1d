"""Mesh rollout engine (generation with TP/PP on the mesh backend's stages): real multi-process runs
over gloo on the CPU against the single-process HF rollout engine on the same model, prompts and
per-row seeds. Equal tokens and log-probs within float rounding are what make a split generation a
drop-in for the unsplit one (guarantee_order runs stay comparable)."""

import pytest
import torch

from mindspeed_rl.engines.base import SamplingParams
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
from mindspeed_rl.engines.sync.weight_sync import free_port

from . import _mesh_rollout_ranks as R
from . import _mp_workers as W
from ._common import EOS, PAD, random_rows, save_tiny4

pytestmark = pytest.mark.slow

TIMEOUT_S = 120
SAMPLED = SamplingParams(max_new_tokens=5, temperature=0.8, stop_token_ids=(EOS,))
GREEDY = SamplingParams(max_new_tokens=4, greedy=True)
# the seeds' offset: with it a row of each replica's sampled call hits EOS (the coverage guard in
# the test); which seeds do depends on how seeds map to draws (sampling.row_uniforms)
SEED_OFFSET = 2


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    """The 4-layer tiny Qwen2 (4 heads, 2 KV heads), logits sharp enough that EOS sometimes wins."""
    return save_tiny4(tmp_path_factory.mktemp("tiny4gen") / "model", seed=11, initializer_range=0.2)


def calls(n_replicas: int) -> list:
    """Each replica's generate calls; replica 1 makes one call fewer, with fewer rows (replicas run
    independently)."""
    out = []
    for d in range(n_replicas):
        mine = []
        for c in range(2 - d):
            k = 5 - 2 * d - c
            prompts = random_rows(k, [2 + (i * 3) % 5 for i in range(k)], seed=100 * d + c, low=3)
            seeds = [1000 * d + 10 * c + i + SEED_OFFSET for i in range(k)]
            mine.append((prompts, SAMPLED if c == 0 else GREEDY, seeds))
        out.append(mine)
    return out


def perturbed(path: str) -> list:
    from mindspeed_rl.models import load_causal_lm
    model = load_causal_lm(path)
    g = torch.Generator().manual_seed(5)
    return [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g))
            for n, p in model.named_parameters(remove_duplicate=False)]


def reference(path: str, replica_calls: list, update: list) -> dict:
    from mindspeed_rl.models import load_causal_lm
    hf = HFRolloutEngine(load_causal_lm(path), PAD)
    outs = [[hf.generate(*c) for c in mine] for mine in replica_calls]
    hf.update_weights(update, 1)
    after = [hf.generate(*mine[0]) for mine in replica_calls]
    return {"outs": outs, "after": after}


def launch(path, options: dict, tmp_path, update) -> tuple[list, list]:
    world = options.get("dp", 1) * options.get("tp", 1) * options.get("pp", 1)
    port = free_port()
    replica_calls = calls(options.get("dp", 1))
    jobs = [(R.run, (r, world, port, path, options, replica_calls, update)) for r in range(world)]
    return W.run_procs(jobs, tmp_path, TIMEOUT_S), replica_calls


def assert_same_rollout(got, want):
    responses, log_probs = got
    assert [r.tolist() for r in responses] == [r.tolist() for r in want.responses]
    for a, b in zip(log_probs, want.log_probs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("options", [{"pp": 2}, {"tp": 2}, {"dp": 2, "pp": 2}], ids=["pp2", "tp2", "dp2pp2"])
def test_split_generation_equals_the_hf_engine(path, tmp_path, options):
    update = perturbed(path)
    results, replica_calls = launch(path, options, tmp_path, update)
    ref = reference(path, replica_calls, update)
    stopped = sum(int(r.numel()) < SAMPLED.max_new_tokens for o in ref["outs"] for r in o[0].responses)
    assert stopped, "no row hit the stop token: the test would not cover finishing rows"
    for r in results:
        pp_idx, dp_idx, tp_idx = r["coord"]
        assert len(r["outs"]) == len(replica_calls[dp_idx])
        for got, want in zip(r["outs"], ref["outs"][dp_idx]):  # every rank returns the replica's rollout
            assert_same_rollout(got, want)
        assert_same_rollout(r["after"], ref["after"][dp_idx])   # the updated weights reached every stage
        assert r["version"] == 1
        assert r["reader"] == (pp_idx == 0 and tp_idx == 0)
        assert r["writer"] == (pp_idx == options.get("pp", 1) - 1 and tp_idx == 0)
    # the update changed what is generated (else the check above proves nothing)
    assert any(a.tolist() != b.tolist() for d in range(len(replica_calls))
               for a, b in zip(ref["after"][d].responses, ref["outs"][d][0].responses))
