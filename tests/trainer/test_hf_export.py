"""The trained policy as a Hugging Face checkpoint (models/hf_export.py, trainer/export.py, cli/export_hf.py).

Engine level: real engines take an optimizer step, their export is written as the trainer's worker writes
it (`Worker.save_hf`: the buckets of `export_weights`, rank 0 writing) and saved as their checkpoint is;
`from_pretrained` of the export must give the engine's own forward (fp32, <= 1e-5), and
`cli/export_hf.py` on the checkpoint must give the same tensors. The torch backend and the bad inputs run
in this process (fast); FSDP at dp 2 and the mesh at tp 2 and pp 2 run in rank processes (slow). The
whole trainer run, vLLM and the loggers are in test_outputs_e2e.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as read_safetensors

from mindspeed_rl.config import Config
from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
from mindspeed_rl.models import resolve_model_path
from mindspeed_rl.models.hf_export import INDEX_NAME, ExportError, link_final, write_hf_checkpoint
from mindspeed_rl.trainer.checkpoint import save_driver_state

from ..engines._common import PAD, nll_loss_fn, random_rows, save_tiny4

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cli"))
import export_hf  # noqa: E402  (cli/export_hf.py)

TINY = "builtin:tiny-qwen2"
ROWS = (random_rows(8, [3, 5, 2, 4, 6, 1, 3, 2], seed=0), random_rows(8, 4, seed=1))


def trained(kind: str = "causal_lm", dtype: str = "float32") -> TorchTrainEngine:
    """The torch engine of the built-in tiny model after one optimizer step (weights away from the base)."""
    e = TorchTrainEngine.build(TrainSpec(model_path=str(resolve_model_path(TINY)), model_kind=kind, dtype=dtype,
                                         pad_token_id=PAD, optim=OptimConfig(lr=1e-2), seed=0))
    mb = MicroBatch({"prompts": ROWS[0], "responses": ROWS[1]}, loss_scale=1.0, last=True)
    if kind == "value":
        e.train_step(iter([mb]), lambda out, m: (((out.values - 1.0) ** 2 * out.response_mask).sum(), {}))
    else:
        e.train_step(iter([mb]), nll_loss_fn)
    return e


def checkpoint_of(root: Path, layouts: dict, step: int = 1, **actor) -> Path:
    """A checkpoint directory as the driver writes it: the driver state (config, layouts) beside the models'."""
    directory = root / "checkpoints" / f"step_{step:06d}"
    directory.mkdir(parents=True, exist_ok=True)
    cfg = Config()
    for k, v in actor.items():
        setattr(cfg.actor_config, k, v)
    save_driver_state(directory, {"step": step, "config": cfg, "layouts": layouts})
    return directory


def torch_layout() -> dict:
    return {"backend": "torch", "dp": 1, "tp": 1, "pp": 1}


def hf_log_probs(model_dir: str | Path, prompts, responses) -> list[torch.Tensor]:
    """Per-token log-probs of each response under `from_pretrained(model_dir)`, one unpadded row at a time."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = m(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0])
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory, whatever its sharding."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(read_safetensors(str(f)))
    return out


def same_export(a: Path, b: Path) -> None:
    """Two exports hold the same files and bit-identical tensors."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def export_cli(capsys, *argv) -> tuple[int, str]:
    """`cli/export_hf.py argv` in this process: its exit code and what it printed to stderr."""
    capsys.readouterr()
    code = export_hf.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


# ------------------------------------------------------------------------------------------- the torch backend
def test_torch_export_loads_and_gives_the_trainers_forward(tmp_path, capsys):
    e = trained()
    out = write_hf_checkpoint(e.export_weights(16 << 10), tmp_path / "hf" / "step_000001", TINY, dtype="float32")
    files = sorted(os.listdir(out))
    # 16 KiB buckets: several shards and the index from_pretrained reads them by
    assert INDEX_NAME in files and sum(f.endswith(".safetensors") for f in files) > 3
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert f in files
    index = json.loads((out / INDEX_NAME).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as save_pretrained writes it
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.cat([torch.cat([p, r]) for p, r in zip(*ROWS)])[None]
    with torch.no_grad():
        assert float((model(ids).logits - e.module(ids).logits).abs().max()) <= 1e-5
    assert max_diff(hf_log_probs(out, *ROWS), e.log_probs(*ROWS, micro_batch_size=8)) <= 1e-5
    from mindspeed_rl.models import load_tokenizer
    assert load_tokenizer(str(out)).get_vocab() == load_tokenizer(TINY).get_vocab()

    # the checkpoint of the same weights, exported offline by the CLI: the same files, the same tensors
    ckpt = checkpoint_of(tmp_path / "run", {"actor": torch_layout()})
    e.save_checkpoint(str(ckpt / "actor"))
    code, err = export_cli(capsys, ckpt, tmp_path / "offline")
    assert code == 0, err
    same = write_hf_checkpoint(e.export_weights(1 << 30), tmp_path / "one_shard", TINY, dtype="float32")
    same_export(same, tmp_path / "offline")
    # an output_dir stands for its latest checkpoint
    (tmp_path / "run" / "checkpoints" / "latest.json").write_text(json.dumps({"step": 1, "path": ckpt.name}))
    assert export_cli(capsys, tmp_path / "run", tmp_path / "latest")[0] == 0
    same_export(same, tmp_path / "latest")


def test_bf16_export_is_the_compute_dtype_and_offline_casts_the_masters_the_same(tmp_path, capsys):
    e = trained(dtype="bfloat16")
    out = write_hf_checkpoint(e.export_weights(1 << 30), tmp_path / "hf", TINY, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in tensors(out).values()} == {torch.bfloat16}
    ckpt = checkpoint_of(tmp_path / "run", {"actor": torch_layout()}, dtype="bfloat16")
    e.save_checkpoint(str(ckpt / "actor"))   # fp32 masters
    assert export_cli(capsys, ckpt, tmp_path / "offline")[0] == 0
    same_export(out, tmp_path / "offline")


def test_a_critic_exports_as_a_one_label_value_model(tmp_path, capsys):
    from transformers import AutoModelForTokenClassification
    c = trained(kind="value")
    ckpt = checkpoint_of(tmp_path / "run", {"actor": torch_layout(), "critic": torch_layout()})
    c.save_checkpoint(str(ckpt / "critic"))
    code, err = export_cli(capsys, ckpt, tmp_path / "critic", "--model", "critic")
    assert code == 0, err
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(str(tmp_path / "critic"))   # num_labels is written as a one-entry id2label
    assert config.architectures == ["Qwen2ForTokenClassification"] and config.num_labels == 1
    assert not (tmp_path / "critic" / "generation_config.json").exists()
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic")).eval()
    values = c.values(*ROWS, micro_batch_size=8)
    with torch.no_grad():
        mine = [model(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1, 0] for p, r in zip(*ROWS)]
    assert max_diff(mine, values) <= 1e-5


# ------------------------------------------------------------------------------------------- bad input
def test_an_export_that_does_not_fit_leaves_nothing_and_draws_every_bucket(tmp_path):
    e = trained()
    drawn = []

    def buckets():
        for b in e.export_weights(16 << 10):
            drawn.append(len(b))
            yield b
    total = sum(1 for _ in e.export_weights(16 << 10))
    target = tmp_path / "hf" / "step_000001"
    other = save_tiny4(tmp_path / "tiny4", seed=0)
    with pytest.raises(ExportError, match=r"has shape .* but Qwen2ForCausalLM as configured in .*tiny4/config.json"):
        write_hf_checkpoint(buckets(), target, other)
    assert len(drawn) == total   # a sharded engine's other ranks finish their gathers
    assert not target.exists() and os.listdir(tmp_path / "hf") == []

    with pytest.raises(ExportError, match=r"weight\(s\) of Qwen2ForCausalLM are missing"):
        write_hf_checkpoint([b for i, b in enumerate(e.export_weights(16 << 10)) if i], target, TINY)
    with pytest.raises(ExportError, match=r"'model.extra.weight' is not a weight of Qwen2ForCausalLM"):
        write_hf_checkpoint([[("model.extra.weight", torch.zeros(2))]], target, TINY)
    assert os.listdir(tmp_path / "hf") == []


def test_final_points_at_the_newest_export(tmp_path):
    (tmp_path / "step_000002").mkdir()
    (tmp_path / "step_000004").mkdir()
    link_final(tmp_path, tmp_path / "step_000002")
    link_final(tmp_path, tmp_path / "step_000004")
    assert os.readlink(tmp_path / "final") == "step_000004"
    assert sorted(os.listdir(tmp_path)) == ["final", "step_000002", "step_000004"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A torch-backend checkpoint of the tiny policy after one step."""
    root = tmp_path_factory.mktemp("saved")
    ckpt = checkpoint_of(root, {"actor": torch_layout()})
    trained().save_checkpoint(str(ckpt / "actor"))
    return ckpt


def dcp_checkpoint(root: Path, layout: dict) -> Path:
    """A `torch.distributed.checkpoint` of the tiny model's state as the fsdp and mesh backends save it
    ({"model": ..., "version": ...}), written by one process."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM
    ckpt = checkpoint_of(root, {"actor": layout})
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(TINY)))
    with warnings.catch_warnings():   # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "version": 1}, checkpoint_id=str(ckpt / "actor"), no_dist=True)
    return ckpt


@pytest.mark.parametrize("damage, words", [
    (lambda c: (c / "trainer_state.pt").unlink(), ["is not a checkpoint (no trainer_state.pt in it)"]),
    (lambda c: (c / "actor" / "engine.pt").unlink(), ["engine state", "actor/engine.pt is missing", "incomplete"]),
    (lambda c: shutil.rmtree(c / "actor"), ["has no actor/ directory", "incomplete"]),
    (lambda c: (c / "actor" / "engine.pt").write_bytes(b"torn"), ["actor/engine.pt is damaged"]),
], ids=["driver-state", "engine-file", "model-dir", "torn"])
def test_an_incomplete_checkpoint_exits_2_naming_the_file(saved, tmp_path, capsys, damage, words):
    ckpt = tmp_path / saved.name
    shutil.copytree(saved, ckpt)
    damage(ckpt)
    code, err = export_cli(capsys, ckpt, tmp_path / "out")
    assert code == 2
    assert err.startswith("export error: ") and err.count("\n") == 1 and "Traceback" not in err
    for w in words:
        assert w in err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_of_another_model_exits_2_naming_the_weight_and_the_fix(saved, tmp_path, capsys):
    other = save_tiny4(tmp_path / "tiny4", seed=0)
    code, err = export_cli(capsys, saved, tmp_path / "out", "--base-model", other)
    assert code == 2
    assert re.search(r"actor/engine.pt: 'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), but "
                     r"Qwen2ForCausalLM as configured in .*tiny4/config.json has \(32, 64\)", err)
    assert err.count("\n") == 1 and "--base-model" in err
    code, err = export_cli(capsys, saved, tmp_path / "out", "--base-model", tmp_path / "nowhere")
    assert code == 2 and "no config.json in" in err
    code, err = export_cli(capsys, saved, tmp_path / "out", "--model", "critic")
    assert code == 2 and "holds no 'critic' (it holds ['actor'])" in err
    code, err = export_cli(capsys, saved, tmp_path / "out", "--adapter-only")
    assert code == 2 and "trained no LoRA adapters" in err


def test_dcp_checkpoints_are_read_whole_and_a_missing_shard_is_named(tmp_path, capsys):
    ckpt = dcp_checkpoint(tmp_path / "run", {"backend": "fsdp", "dp": 1, "tp": 1, "pp": 1})
    assert export_cli(capsys, ckpt, tmp_path / "out")[0] == 0
    base = tensors(resolve_model_path(TINY))
    assert tensors(tmp_path / "out").keys() == base.keys()
    assert all(torch.equal(t, base[k]) for k, t in tensors(tmp_path / "out").items())
    (ckpt / "actor" / "__0_0.distcp").unlink()
    code, err = export_cli(capsys, ckpt, tmp_path / "out2")
    assert code == 2 and "actor/__0_0.distcp is missing (1 of the 1 shard files" in err
    (ckpt / "actor" / ".metadata").unlink()
    code, err = export_cli(capsys, ckpt, tmp_path / "out2")
    assert code == 2 and "actor/.metadata is missing" in err and "incomplete" in err


def test_megatron_checkpoints_are_refused_naming_the_runs_own_export(tmp_path, capsys):
    ckpt = checkpoint_of(tmp_path / "run", {"actor": {"backend": "megatron", "dp": 1, "tp": 2, "pp": 1}})
    (ckpt / "actor" / "megatron").mkdir(parents=True)
    code, err = export_cli(capsys, ckpt, tmp_path / "out")
    assert code == 2 and "written by the megatron backend" in err and "trainer.save_hf" in err


# ------------------------------------------------------------------------------------------- LoRA
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"], "dropout": 0.0, "lr": 0.05}


def lora_config():
    from mindspeed_rl.config.schema import LoraConfig
    return LoraConfig(**LORA)


@pytest.mark.slow   # peft's import, three steps and four model loads: about 5 s warm
def test_a_lora_policy_exports_merged_and_as_a_peft_adapter(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    e = TorchTrainEngine.build(TrainSpec(model_path=str(resolve_model_path(TINY)), pad_token_id=PAD,
                                         optim=OptimConfig(lr=1e-4), seed=0, lora=dict(LORA)))
    mb = MicroBatch({"prompts": ROWS[0], "responses": ROWS[1]}, loss_scale=1.0, last=True)
    for _ in range(3):   # B moves away from 0: the merged weights differ from the base
        e.train_step(iter([mb]), nll_loss_fn)
    engine_lp = e.log_probs(*ROWS, micro_batch_size=8)
    hf = write_hf_checkpoint(e.export_weights(1 << 30), tmp_path / "hf", TINY, dtype="float32")
    assert max_diff(hf_log_probs(hf, *ROWS), engine_lp) <= 1e-5
    assert max_diff(hf_log_probs(resolve_model_path(TINY), *ROWS), engine_lp) > 1e-3   # it did train

    ckpt = checkpoint_of(tmp_path / "run", {"actor": torch_layout()}, lora=lora_config())
    e.save_checkpoint(str(ckpt / "actor"))   # the adapters alone
    assert export_cli(capsys, ckpt, tmp_path / "merged")[0] == 0
    same_export(hf, tmp_path / "merged")
    code, err = export_cli(capsys, ckpt, tmp_path / "adapter", "--adapter-only")
    assert code == 0, err
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    base = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(TINY)))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        peft_lp = [torch.log_softmax(peft_model(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1], -1)
                   .gather(-1, r[:, None])[:, 0] for p, r in zip(*ROWS)]
    assert max_diff(peft_lp, engine_lp) <= 1e-5

    other = dict(LORA, rank=8)
    bad = checkpoint_of(tmp_path / "bad", {"actor": torch_layout()}, lora=lora_config().__class__(**other))
    e.save_checkpoint(str(bad / "actor"))
    code, err = export_cli(capsys, bad, tmp_path / "x")
    assert code == 2 and "actor/engine.pt: the checkpoint's adapter" in err and "rank differs" in err


# ------------------------------------------------------------------------------------------- sharded layouts
LAYOUTS = {"fsdp-dp2": ("fsdp", {}, {"backend": "fsdp", "dp": 2, "tp": 1, "pp": 1}),
           "fsdp-dp2-lora": ("fsdp", {"lora": LORA}, {"backend": "fsdp", "dp": 2, "tp": 1, "pp": 1}),
           "mesh-tp2": ("mesh", {"tp": 2}, {"backend": "mesh", "dp": 1, "tp": 2, "pp": 1}),
           "mesh-pp2": ("mesh", {"pp": 2}, {"backend": "mesh", "dp": 1, "tp": 1, "pp": 2})}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_engines_export_their_forward_and_the_cli_reads_their_checkpoint(tmp_path, capsys, layout):
    from mindspeed_rl.engines.sync.weight_sync import free_port

    from ..engines._mp_workers import run_procs
    from . import _hf_export_ranks as R
    backend, options, recorded = LAYOUTS[layout]
    path = save_tiny4(tmp_path / "tiny4", seed=7)   # 4 layers, 4 heads, 2 KV heads: whole heads and layers split
    lora = {"lora": lora_config()} if "lora" in options else {}
    ckpt = checkpoint_of(tmp_path / "run", {"actor": recorded}, model_path=path, **lora)
    hf = tmp_path / "hf"
    port = free_port()
    results = run_procs([(R.train_save_export, (rank, 2, port, backend, path, options, ROWS, str(ckpt / "actor"),
                                                str(hf), 64 << 10)) for rank in range(2)], tmp_path, timeout_s=180)
    engine_lp = next(r["log_probs"] for r in reversed(results) if r["log_probs"] is not None)
    diff = max_diff(hf_log_probs(hf, *ROWS), engine_lp)
    with capsys.disabled():
        print(f"\n{layout}: from_pretrained log-probs vs the engine's: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    assert (hf / INDEX_NAME).is_file()   # 64 KiB buckets: several shards
    code, err = export_cli(capsys, ckpt, tmp_path / "offline")
    assert code == 0, err
    # shards follow the buckets, which differ between an engine's export and the offline reader: compare tensors
    exported, offline = tensors(hf), tensors(tmp_path / "offline")
    assert exported.keys() == offline.keys()
    assert all(torch.equal(t, offline[k]) for k, t in exported.items())
    base = tensors(Path(path))   # the step moved the weights (with LoRA: its merged adapters), so the test can fail
    assert not torch.equal(exported["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
