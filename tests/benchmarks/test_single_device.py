"""benchmarks/single_device.py at its smallest sizes on the CPU: the built-in tiny model, every part (the
rollout engine's eager and static paths against HF generate and a plain sampling loop, the fsdp and torch
train steps against the plain loop, log-prob passes, in-process weight syncs) and one step of the real
trainer through Ray.

It checks what the benchmark reports, not how fast anything is: the JSON's ratios and end-to-end
figures exist and are finite and positive, and the token counts add up to the sizes asked for."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# one run of the benchmark serves the module (its first test pays it): ~40 s of CPU time, which on a
# loaded 2-core machine was over 5 minutes of wall time
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "single_device.py"

ROWS, NEW, PROMPTS, SAMPLES, E2E_NEW = 2, 4, 1, 2, 4
ARGS = ["--device", "cpu", "--model", "tiny", "--repeats", "1", "--rows", str(ROWS), "--new-tokens", str(NEW),
        "--prompt-len", "4", "--train-rows", "2", "--train-prompt-len", "4", "--train-response-len", "4",
        "--micro-batch", "1", "--logprob-micro-batch", "2", "--e2e-prompts", str(PROMPTS),
        "--e2e-samples", str(SAMPLES), "--e2e-new-tokens", str(E2E_NEW), "--e2e-steps", "1",
        "--e2e-timeout", "500",
        "--peak-tflops", "1",   # a stated peak, so the MFU arithmetic runs on the CPU too
        "--memory"]             # and the memory plan's terms beside the measured bytes


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_device") / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, str(SCRIPT), *ARGS, "--json", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1100)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    assert "ratios (project / plain baseline" in p.stdout and "end to end" in p.stdout
    return json.loads(out.read_text())


def test_ratios_are_finite_and_positive(result):
    ratios = result["ratios"]
    for key in ("rollout_over_hf_generate", "rollout_over_sampling_loop", "static_rollout_over_hf_generate",
                "static_rollout_over_sampling_loop", "train_over_plain_autocast", "log_prob_over_plain",
                "sync_over_load_state_dict"):
        assert positive(ratios[key]), (key, ratios[key])
    # the static+compiled HF generate is skipped on the CPU (no --static-generate): no ratio against it
    assert ratios["static_rollout_over_hf_static_generate"] is None
    assert "hf_generate_static" not in result["rollout"] and result["rollout"]["skipped"]["hf_generate_static"]
    # each ratio is the quotient of the two throughputs it names, measured in this run
    ro, tr = result["rollout"], result["train"]
    assert ratios["rollout_over_hf_generate"] == pytest.approx(
        ro["engine"]["tokens_per_s"] / ro["hf_generate"]["tokens_per_s"])
    assert ratios["static_rollout_over_hf_generate"] == pytest.approx(
        ro["engine_static"]["tokens_per_s"] / ro["hf_generate"]["tokens_per_s"])
    assert ratios["train_over_plain_autocast"] == pytest.approx(
        tr["fsdp"]["train"]["tokens_per_s"] / tr["plain"]["train"]["tokens_per_s"])


def test_every_part_measured(result):
    ro, tr = result["rollout"], result["train"]
    assert ro["default_engine"] == "engine"       # the CPU's default path: the eager decode
    for k in ("engine", "engine_static", "hf_generate", "sampling_loop"):
        assert positive(ro[k]["tokens_per_s"]) and len(ro[k]["all_s"]) == 1
        assert ro[k]["tokens_per_s"] * ro[k]["s"] == pytest.approx(ROWS * NEW)
    assert positive(ro["peak_mem_gb"])
    assert tr["tokens"] == 2 * (4 + 4) and tr["response_tokens"] == 2 * 4
    # MFU divides the needed FLOPs: the backbone on every token, the head on response tokens only
    m = result["model"]
    assert tr["flops"]["train"] == 6 * (m["backbone_params"] * 16 + m["hidden"] * m["vocab"] * 8)
    assert tr["flops"]["log_prob"] * 3 == tr["flops"]["train"]
    assert tr["plain"]["train"]["mfu"] == pytest.approx(tr["flops"]["train"] / tr["plain"]["train"]["s"] / 1e12)
    for k in ("fsdp", "torch", "plain"):
        for part in ("train", "log_prob"):
            assert positive(tr[k][part]["tokens_per_s"]) and positive(tr[k][part]["mfu"]), (k, part, tr[k][part])
        assert positive(tr[k]["sync"]["gb_per_s"]) and tr[k]["sync"]["bytes"] == tr["fsdp"]["sync"]["bytes"]
        assert positive(tr[k]["peak_mem_gb"])
    assert result["model"]["params"] > 0 and positive(result["ru_maxrss_gb"])


def test_e2e_throughput_split_and_mfu(result):
    e2e = result["e2e"]
    assert "error" not in e2e and e2e["rc"] == 0
    for key in ("tokens_per_s", "response_tokens_per_s", "train_mfu", "step_s", "peak_mem_gb"):
        assert positive(e2e[key]), (key, e2e[key])
    for stage, s in e2e["split_s"].items():      # rollout, reference, train, sync, step
        assert positive(s), (stage, s)
    # one prompt per step is one optimizer step on the rows just generated: on-policy, so the loss takes the
    # update's own log-probs and the graph has no actor_log_prob stage
    assert set(e2e["split_s"]) == {"actor_rollout", "ref_log_prob", "actor_train", "weight_sync", "step"}
    assert set(e2e["busy_s"]) == {"actor_rollout", "ref_log_prob", "actor_train"}
    for stage, s in e2e["busy_s"].items():
        assert positive(s), (stage, s)
    # no stop token: every row runs to max_new_tokens
    assert e2e["response_tokens_per_step"] == pytest.approx(PROMPTS * SAMPLES * E2E_NEW)
    assert e2e["tokens_per_step"] > e2e["response_tokens_per_step"]
    # one step: the driver's own throughput/tokens_per_s (prompt + response) is the benchmark's figure
    assert e2e["tokens_per_s"] == pytest.approx(e2e["driver_tokens_per_s"][0])


def test_memory_parts_measured_and_estimated(result):
    parts = result["memory"]["parts"]
    assert set(parts) == {"train weights", "optimizer state", "activations", "train step peak", "log-prob peak",
                          "rollout weights", "rollout generate peak"}
    for name, row in parts.items():
        assert positive(row["estimate_gb"]), (name, row)
        assert math.isfinite(row["measured_gb"]), (name, row)
