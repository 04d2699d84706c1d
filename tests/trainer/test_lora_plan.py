"""LoRA in the plan: which engine the reference is (the policy's own with its adapters off, or a model of its
own), and what is refused before any worker starts (a backend without LoRA, target modules that match
nothing)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.planning import make_plan
from mindspeed_rl.trainer.worker_specs import engine_decls
from mindspeed_rl.workers.engine_set import INFER_ROLE, TRAIN_ROLE

ROOT = Path(__file__).resolve().parents[2]
LORA = {"rank": 8}
KL = {"use_kl_loss": True, "kl_loss_coef": 0.01}


def plan_of(actor: dict, ref: dict | None = None, placement: dict | None = None):
    cfg = config_from_dict({"actor_config": {**KL, **actor}, "ref_config": ref or {},
                            "placement": placement or {}})
    return cfg, make_plan(cfg, check_files=True)


def decls_by_group(cfg, plan) -> dict[str, dict]:
    return {g: {(d.model, d.role): d for d in engine_decls(cfg, plan, gp)} for g, gp in plan.groups.items()}


def trainer_decls(cfg, plan) -> dict:
    """The engine declarations of the worker group that trains the actor."""
    (decls,) = [d for d in decls_by_group(cfg, plan).values() if ("actor", TRAIN_ROLE) in d]
    return decls


def test_reference_beside_a_lora_policy_is_its_base():
    cfg, plan = plan_of({"lora": LORA})
    decls = trainer_decls(cfg, plan)
    ref, actor = decls[("ref", INFER_ROLE)], decls[("actor", TRAIN_ROLE)]
    assert ref.base_of == "actor" and not ref.features and actor.features["lora"]["rank"] == 8


@pytest.mark.parametrize("actor, ref", [({}, None), ({"lora": LORA}, {"model_path": "builtin:tiny-qwen2"})])
def test_reference_loads_a_model_of_its_own(actor, ref):
    """No LoRA, or a reference named by path (not the initial policy): the reference loads its weights."""
    cfg, plan = plan_of(actor, ref)
    decls = trainer_decls(cfg, plan)
    assert decls[("ref", INFER_ROLE)].base_of == ""


def test_reference_in_another_worker_group_loads_the_base():
    groups = {"gen": {"mfcs": ["actor_rollout"]}, "train": {"mfcs": ["actor_log_prob", "actor_train"]},
              "ref": {"mfcs": ["ref_log_prob"]}, "rule": {"mfcs": ["rule_reward", "compute_advantage"]}}
    cfg, plan = plan_of({"lora": LORA}, placement={"mode": "custom", "groups": groups})
    by_group = decls_by_group(cfg, plan)
    ref = by_group["ref"][("ref", INFER_ROLE)]
    assert ref.base_of == "" and ref.model_path == plan.model_paths["actor"]
    assert by_group["train"][("actor", TRAIN_ROLE)].features["lora"]


def test_lora_on_a_backend_without_it_is_refused():
    """A split worker group runs the mesh backend, which has no LoRA: refused naming the key and the backends."""
    cfg = config_from_dict({"actor_config": {"lora": LORA, "kl_loss_coef": 0.0},
                            "placement": {"mode": "mesh", "n_devices_per_node": 2, "mfcs": {
                                "actor_rollout": {"mesh": "all"}, "actor_train": {"mesh": "all", "tp": 2},
                                "actor_log_prob": {"mesh": "all", "tp": 2}}}})
    with pytest.raises(ConfigError, match=r"actor_config.lora.rank=8: the mesh train backend does not implement "
                                          r"lora .*backends that do: \['torch', 'fsdp'\]"):
        make_plan(cfg, check_files=False)


@pytest.mark.slow   # a CLI process: ~10 s of imports on this CPU
def test_target_modules_matching_nothing_exit_2_before_any_worker_starts():
    out = subprocess.run([sys.executable, "cli/train_grpo.py", "actor_config.lora.rank=8",
                          "actor_config.lora.target_modules=[q_proj,qkv]", "trainer.dry_run=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert ("actor_config.lora.target_modules=['q_proj', 'qkv']: ['qkv'] match no linear layer of the model"
            in out.stdout + out.stderr)
    assert "'k_proj'" in out.stdout + out.stderr   # what to write instead


def test_modules_to_save_matching_nothing_is_refused_by_the_plan():
    """Checked on the meta-device model before any worker starts, as target_modules is."""
    from mindspeed_rl.planning.features import check_lora_targets
    cfg = config_from_dict({"actor_config": {"lora": {**LORA, "modules_to_save": ["normal"]}}})
    with pytest.raises(ConfigError, match=r"modules_to_save=\['normal'\]: \['normal'\] match no module of the model.*"
                                          r"'input_layernorm'"):
        check_lora_targets(cfg.actor_config, cfg.trainer, {}, {"actor"})
