"""Mesh (TP/PP) train engine: real multi-process runs over gloo on the CPU (parallelize_module,
torch.distributed.pipelining, DCP; no mocks) against a single-process `TorchTrainEngine` on the same
model, batch and micro-batches. Every multi-process run is bounded by `run_procs`' timeout."""

import pytest
import torch

from mindspeed_rl.engines.base import OptimConfig
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
from mindspeed_rl.engines.sync.weight_sync import free_port

from . import _mesh_ranks as M
from . import _mp_workers as W
from ._common import PAD, random_rows, save_tiny4

pytestmark = pytest.mark.slow

TIMEOUT_S = 120
# eps large next to tiny gradients keeps Adam's first step a smooth function of the gradient
OPTIM = OptimConfig(lr=1e-2, eps=1e-4, grad_clip=1.0)
# micro-batch sizes of one train_step: on one replica [2, 3, 1] (pp rounds of 2: a 1F1B round and a
# GPipe one); split over two DP replicas of 3 rows each
ONE_REPLICA = [[2, 3, 1]]
TWO_REPLICAS = [[2, 1], [1, 2]]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    """The 4-layer tiny Qwen2 (4 heads, 2 KV heads: TP=2 splits whole heads) as an HF checkpoint."""
    return save_tiny4(tmp_path_factory.mktemp("tiny4") / "model", seed=7)


def data():
    return random_rows(6, [3, 5, 2, 4, 6, 3], seed=21), random_rows(6, [5, 2, 4, 3, 6, 1], seed=22)


def replicas(layout):
    """(prompts, responses, sizes) of each DP replica: consecutive rows of `data()`."""
    prompts, responses = data()
    out, start = [], 0
    for sizes in layout:
        n = sum(sizes)
        out.append((prompts[start:start + n], responses[start:start + n], sizes))
        start += n
    return out


def second(reps):
    """The checkpoint test's second step: each replica's rows and sizes reversed."""
    return [(list(reversed(p)), list(reversed(r)), list(reversed(s))) for p, r, s in reps]


def union_step(engine, reps):
    """The single-process equivalent of one DP step: every replica's micro-batches, each scaled by
    its rows over all rows (DP averages the replicas' equal-sized mean gradients)."""
    total = sum(sum(s) for _, _, s in reps)
    mbs = [mb for p, r, s in reps for mb in M.micro_batches(p, r, s, total)]
    return engine.train_step(iter(mbs), M.nll_loss)


def reference(path: str, layout):
    """Single process: log-probs of each replica's rows, one step, export, log-probs after, then the
    second step of the checkpoint test."""
    from mindspeed_rl.models import load_causal_lm

    reps = replicas(layout)
    eng = TorchTrainEngine(load_causal_lm(path), PAD, OPTIM)
    lp_before = [eng.log_probs(p, r, micro_batch_size=2) for p, r, _ in reps]
    stats = union_step(eng, reps)
    weights = M.exported(eng)
    lp_after = [eng.log_probs(p, r, micro_batch_size=3) for p, r, _ in reps]
    stats2 = union_step(eng, second(reps))
    return {"lp_before": lp_before, "stats": stats, "weights": weights, "lp_after": lp_after,
            "stats2": stats2, "weights2": M.exported(eng)}


def launch(path, options: dict, layout, tmp_path, critic: bool = False) -> list[dict]:
    world = options.get("dp", 1) * options.get("tp", 1) * options.get("pp", 1)
    port = free_port()
    ckpt = str(tmp_path / "ckpt")
    jobs = [(M.run, (r, world, port, path, options, replicas(layout), OPTIM, ckpt, critic)) for r in range(world)]
    return W.run_procs(jobs, tmp_path, TIMEOUT_S)


def assert_same_named(got, want, atol: float):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, a), (_, b) in zip(got, want):
        assert a.shape == b.shape, n
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m: f"{n}: {m}")


def assert_rows_close(got, want, atol: float):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def check_run(results, ref, n_stages: int):
    """What every mesh configuration must show against the single-process reference."""
    replica_loss: dict[int, float] = {}
    for r in results:
        pp_idx, dp_idx, _ = r["coord"]
        # one step: the replica's metrics on every rank of the replica; summed over the replicas
        # they are the single process's (the grad norm is global)
        assert r["stats"]["micro_batches"] == len(ref["layout"][dp_idx])
        replica_loss.setdefault(dp_idx, r["stats"]["loss"])
        assert r["stats"]["loss"] == replica_loss[dp_idx]
        assert abs(r["stats"]["grad_norm"] - ref["stats"]["grad_norm"]) <= 1e-4
        # every rank yields every HF name once, full shapes, the same values as the single process
        names = [n for n, _ in r["weights"]]
        assert len(names) == len(set(names)) and "lm_head.weight" in names
        assert_same_named(r["weights"], ref["weights"], atol=1e-5)
        assert [n for bk in r["buckets"] for n, _ in bk] == names
        assert all(len(bk) == 1 or sum(torch.Size(s).numel() * 4 for _, s in bk) <= 4096 for bk in r["buckets"])
        # checkpoint round trip: the loaded engine holds what was saved and takes the identical step
        assert_same_named(r["loaded"], r["weights"], atol=0)
        assert_same_named(r["b"], r["a"], atol=0)
        assert r["stats_a"] == r["stats_b"]
        assert r["versions"] == (2, 2)
        assert_same_named(r["a"], ref["weights2"], atol=1e-5)
        # log-probs: on the last stage's ranks, the replica's rows; None on earlier stages
        if pp_idx == n_stages - 1:
            assert_rows_close(r["lp_before"], ref["lp_before"][dp_idx], atol=1e-5)
            assert_rows_close(r["lp_after"], ref["lp_after"][dp_idx], atol=1e-5)
            n = len(ref["lp_after"][dp_idx]) - dp_idx
            assert_rows_close(r["lp_uneven"], ref["lp_after"][dp_idx][:n], atol=1e-5)
        else:
            assert r["lp_before"] is None and r["lp_after"] is None and r["lp_uneven"] is None
    assert abs(sum(replica_loss.values()) - ref["stats"]["loss"]) <= 1e-4


@pytest.fixture(scope="module")
def ref_one(path):
    return {**reference(path, ONE_REPLICA), "layout": ONE_REPLICA}


@pytest.fixture(scope="module")
def ref_two(path):
    return {**reference(path, TWO_REPLICAS), "layout": TWO_REPLICAS}


def test_tp2_matches_single_process(path, ref_one, tmp_path):
    results = launch(path, {"tp": 2}, ONE_REPLICA, tmp_path)
    assert [r["coord"] for r in results] == [(0, 0, 0), (0, 0, 1)]
    assert [r["reader"] for r in results] == [True, False]
    # really sharded: q_proj's output rows and o_proj's input columns halved, norms replicated
    sh = results[0]["shards"]
    assert sh["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert sh["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
    assert sh["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert sh["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert sh["model.norm.weight"] == (64,)
    check_run(results, ref_one, n_stages=1)


def critic_reference(path: str):
    """A single-process critic: values, one step of the value loss, values after."""
    from mindspeed_rl.engines.base import TrainSpec

    prompts, responses, sizes = replicas(ONE_REPLICA)[0]
    c = TorchTrainEngine.build(TrainSpec(model_path=path, model_kind="value", pad_token_id=PAD, optim=OPTIM, seed=0))
    before = c.values(prompts, responses, micro_batch_size=2)
    stats = c.train_step(iter(M.micro_batches(prompts, responses, sizes)), M.value_loss)
    return before, c.values(prompts, responses, micro_batch_size=4), stats


def test_pp2_matches_single_process(path, ref_one, tmp_path):
    results = launch(path, {"pp": 2, "pp_microbatches": 2}, ONE_REPLICA, tmp_path, critic=True)
    assert [r["coord"] for r in results] == [(0, 0, 0), (1, 0, 0)]
    # stage 0: embedding and layers 0-1; stage 1: layers 2-3 (global names), norm and lm_head
    s0, s1 = (set(r["shards"]) for r in results)
    assert "model.embed_tokens.weight" in s0 and "lm_head.weight" not in s0
    assert {n.split(".")[2] for n in s0 if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in s1 if n.startswith("model.layers.")} == {"2", "3"}
    assert "lm_head.weight" in s1 and "model.norm.weight" in s1 and "model.embed_tokens.weight" not in s1
    check_run(results, ref_one, n_stages=2)
    # a critic through the same pipeline: values (last stage), a value-loss step, values after
    before, after, stats = critic_reference(path)
    assert results[0]["values"][:2] == [None, None]
    got_before, got_after, got_stats = results[1]["values"]
    assert_rows_close(got_before, before, atol=1e-5)
    assert_rows_close(got_after, after, atol=1e-5)
    assert abs(got_stats["vf_loss"] - stats["vf_loss"]) <= 1e-4
    assert results[0]["values"][2] == got_stats   # the replica's metrics on every stage


@pytest.mark.parametrize("options,layout", [
    ({"pp": 2, "tp": 2, "pp_microbatches": 2}, ONE_REPLICA),
    ({"dp": 2, "tp": 2}, TWO_REPLICAS),
    ({"dp": 2, "pp": 2, "pp_microbatches": 1}, TWO_REPLICAS),   # two pipeline rounds per step
], ids=["pp2tp2", "dp2tp2", "dp2pp2"])
def test_four_ranks(path, ref_one, ref_two, tmp_path, options, layout):
    results = launch(path, options, layout, tmp_path)
    check_run(results, ref_one if layout is ONE_REPLICA else ref_two, n_stages=options.get("pp", 1))


def test_pp2_bf16_keeps_fp32_masters_and_computes_in_bf16(path, tmp_path):
    """dtype bfloat16 on the CPU: the trained mesh engine holds fp32 parameters, gradients and AdamW
    state and exports bf16; an inference engine holds bf16. Log-probs match the torch backend with
    the same dtype (autocast over fp32 masters; bf16 parameters for inference) within bf16 noise."""
    from mindspeed_rl.engines.base import TrainSpec

    prompts, responses = data()
    prompts, responses = prompts[:4], responses[:4]
    port = free_port()
    results = W.run_procs([(M.run_bf16, (r, 2, port, path, {"pp": 2, "pp_microbatches": 2}, (prompts, responses),
                                         OPTIM)) for r in range(2)], tmp_path, TIMEOUT_S)
    for r in results:
        assert r["params"] == r["grads"] == r["optim"] == ["torch.float32"]
        assert r["export"] == ["torch.bfloat16"] and r["infer_params"] == ["torch.bfloat16"]
    last = results[1]
    spec = dict(model_path=path, pad_token_id=PAD, seed=0, dtype="bfloat16")
    trained, infer = TorchTrainEngine.build(TrainSpec(**spec, optim=OPTIM)), TorchTrainEngine.build(TrainSpec(**spec))
    fp32 = TorchTrainEngine.build(TrainSpec(**{**spec, "dtype": "float32"}))
    want = trained.log_probs(prompts, responses, 2)
    assert_rows_close(last["lp_before"], want, atol=2e-2)
    assert torch.cat(want).sub(torch.cat(fp32.log_probs(prompts, responses, 2))).abs().max() > 1e-4  # bf16 ran
    trained.train_step(iter(M.micro_batches(prompts, responses, [2, 2])), M.nll_loss)
    assert_rows_close(last["lp_after"], trained.log_probs(prompts, responses, 2), atol=2e-2)
    assert_rows_close(last["infer_lp"], infer.log_probs(prompts, responses, 2), atol=2e-2)
