"""LoRA with data parallelism: two gloo ranks train DDP (torch) and FSDP2 (fsdp, fully_shard over the
peft-wrapped decoder layers) engines on their halves of a batch; both equal one process on the union. One
spawned run serves every check."""
import pytest
import torch

from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
from mindspeed_rl.engines.sync.weight_sync import free_port
from mindspeed_rl.models import load_causal_lm, resolve_model_path

from . import _lora_ranks as L
from . import _mp_workers as W
from ._common import PAD, nll_loss_fn, random_rows

pytestmark = pytest.mark.slow
WORLD, PER_RANK = 2, 3
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"], "dropout": 0.0, "lr": 0.01,
        "modules_to_save": ["norm"], "modules_to_save_lr": 0.02}   # the RMSNorms trained whole too
OPTIM = OptimConfig(lr=1e-4, eps=1e-4)   # eps large next to tiny gradients: Adam's steps stay smooth


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = str(resolve_model_path("builtin:tiny-qwen2"))
    n = WORLD * PER_RANK
    # equal response lengths: the mean of the ranks' token-means is the token-mean of the union
    prompts, responses = random_rows(n, [3, 5, 2, 4, 6, 3], seed=21), random_rows(n, 4, seed=22)
    port = free_port()
    tmp = tmp_path_factory.mktemp("lora_dp")
    jobs = [(L.train, (r, WORLD, port, path, (prompts[r * PER_RANK:(r + 1) * PER_RANK],
                                               responses[r * PER_RANK:(r + 1) * PER_RANK]),
                       LORA, OPTIM, str(tmp / "ckpt"))) for r in range(WORLD)]
    results = W.run_procs(jobs, tmp, timeout_s=120)
    single = TorchTrainEngine.build(TrainSpec(model_path=path, pad_token_id=PAD, optim=OPTIM, seed=0, lora=LORA))
    norms = [single.train_step(iter([MicroBatch({"prompts": prompts, "responses": responses}, 1.0, True)]),
                               nll_loss_fn)["grad_norm"] for _ in range(L.STEPS)]
    want = {n: t.clone() for b in single.export_weights(16 << 10) for n, t in b}
    plain = TorchTrainEngine(load_causal_lm(path), PAD)
    return results, want, norms, plain.state_checksum(), single


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_two_ranks_train_the_adapters_as_one_process_on_the_union(run, backend):
    results, want, norms, base, _ = run
    for r in results:
        got = r[backend]
        assert got["norms"] == pytest.approx(norms, rel=1e-4)
        assert list(got["weights"]) == list(want)
        for n in want:
            torch.testing.assert_close(got["weights"][n], want[n], rtol=0, atol=2e-6, msg=lambda m: f"{n}: {m}")
        assert got["base_before"] == got["base_after"] == base     # only adapters trained
    assert results[0][backend]["weights"].keys() == results[1][backend]["weights"].keys()
    if backend == "torch":
        assert results[0]["torch"]["merged"] == results[1]["torch"]["merged"]
        reduced = results[0]["torch"]["reduced"]
        assert reduced and all(".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n for n in reduced)


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_the_reference_is_the_base_on_every_rank(run, backend):
    """The adapters-off pass of each rank's engine equals the untouched checkpoint's log-probs; the trained
    policy's differ from them."""
    results, _, _, _, _ = run
    plain = TorchTrainEngine(load_causal_lm(str(resolve_model_path("builtin:tiny-qwen2"))), PAD)
    for r, rank in enumerate(results):
        prompts = random_rows(WORLD * PER_RANK, [3, 5, 2, 4, 6, 3], seed=21)[r * PER_RANK:(r + 1) * PER_RANK]
        responses = random_rows(WORLD * PER_RANK, 4, seed=22)[r * PER_RANK:(r + 1) * PER_RANK]
        want = plain.log_probs(prompts, responses, 2)
        got = rank[backend]
        assert max(float((a - b).abs().max()) for a, b in zip(got["ref_log_probs"], want)) < 1e-6
        assert max(float((a - b).abs().max()) for a, b in zip(got["log_probs"], want)) > 1e-3


def test_fsdp_resume_from_adapter_checkpoint_is_bit_exact(run):
    results, _, _, _, _ = run
    for r in results:
        got = r["fsdp"]
        keys = got["checkpoint_keys"]   # the checkpoint holds the adapters and norm copies, not the base
        assert keys and all(".lora_A." in k or ".lora_B." in k or ".modules_to_save." in k for k in keys)
        assert got["resumed_norms"] == got["norms"][1:]
        assert all(torch.equal(got["resumed_weights"][n], got["weights"][n]) for n in got["weights"])
