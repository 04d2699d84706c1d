"""Config loading, validation and planning: the default config works, and every bad input fails
before anything starts with a message that names the key, the value and a fix."""
from __future__ import annotations

import dataclasses
import sys

import pytest
from omegaconf import OmegaConf

from mindspeed_rl.config import Config, ConfigError, config_from_dict, config_to_dict, check_config
from mindspeed_rl.planning import check_cluster, format_plan, make_plan

from .helpers import DEFAULT_YAML, REPO, error_of, run_stage, with_overrides

GRPO_MFCS = ["actor_rollout", "rule_reward", "actor_log_prob", "compute_advantage", "actor_train"]  # no KL: no ref
KL = {"actor_config.kl_loss_coef": 0.001}  # a KL term in the loss: the reference stage is in the graph


# ---------------------------------------------------------------------------------------------- the default


def test_default_yaml_loads_validates_and_plans():
    cfg = config_from_dict(with_overrides({}))
    check_config(cfg)
    plan = make_plan(cfg, check_files=True)
    assert plan.rows_per_step == 16 * 8
    assert [m.name for m in plan.order] == GRPO_MFCS
    assert set(plan.groups) == {"integrated", "rule"}
    assert "integrated" in format_plan(plan)


def test_default_yaml_through_omegaconf_like_hydra():
    """Hydra hands over a DictConfig that still has `defaults` and `hydra`; both are ignored."""
    raw = OmegaConf.load(DEFAULT_YAML)
    assert "defaults" in raw and "hydra" in raw
    cfg = config_from_dict(raw)
    assert cfg.trainer.total_steps == 300 and cfg.actor_config.lr == pytest.approx(4e-4)
    assert isinstance(cfg.trainer.stage_timeout_s, float)  # `120` in the YAML, a float in the schema


def test_empty_config_is_the_schema_defaults():
    cfg = config_from_dict({})
    assert config_to_dict(cfg) == dataclasses.asdict(Config())
    make_plan(cfg, check_files=True)


def test_hydra_overrides_compose_as_documented():
    """docs/configs.md: grpo_tiny.yaml lists every key, so each is overridden plainly; a new
    placement group (a mapping key the YAML does not list) needs `+`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        raw = compose("grpo_tiny", overrides=["rl_config.n_samples_per_prompt=4", "trainer.logger=[console]",
                                              "actor_config.ppo_mini_batch_size=null", "actor_config.kl_ctrl=adaptive",
                                              "+placement.groups.integrated.dp=2"])
        cfg = config_from_dict(raw)
        assert cfg.rl_config.n_samples_per_prompt == 4 and cfg.trainer.logger == ["console"]
        assert cfg.actor_config.ppo_mini_batch_size is None and cfg.actor_config.kl_ctrl == "adaptive"
        assert cfg.placement.groups["integrated"].dp == 2
        make_plan(cfg, check_files=True)
        with pytest.raises(ConfigCompositionException, match=r"\+trainer\.total_step=3"):
            compose("grpo_tiny", overrides=["trainer.total_step=3"])


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("*.yaml")))
def test_a_configs_vllm_section_lists_every_vllm_key(name):
    """docs/engines.md's `generate_config.vllm.serve=true` (and every other vllm key) is a plain Hydra override
    on every config with a vllm section: Hydra refuses a key the YAML does not list unless it is given with `+`."""
    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config.schema import VLLMConfig

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        section = OmegaConf.to_container(compose(name)).get("generate_config", {}).get("vllm")
    if section is None:
        pytest.skip("no vllm section")
    assert [f.name for f in dataclasses.fields(VLLMConfig) if f.name not in section] == []


def test_ints_widen_to_floats_and_whole_floats_narrow_to_ints():
    cfg = config_from_dict(with_overrides({"actor_config.lr": 1, "trainer.total_steps": 3.0,
                                           "placement.groups.integrated.num_cpus": 2}))
    assert cfg.actor_config.lr == 1.0 and isinstance(cfg.actor_config.lr, float)
    assert cfg.trainer.total_steps == 3 and isinstance(cfg.trainer.total_steps, int)
    assert cfg.placement.groups["integrated"].num_cpus == 2.0


# ------------------------------------------------------------------------------ placement modes (documented)


def _groups(overrides):
    plan = make_plan(config_from_dict(with_overrides(overrides)), check_files=False)
    return {g: [m.name for m in p.mfcs] for g, p in plan.groups.items()}


def test_colocated_mode_groups():
    assert _groups(KL) == {"integrated": ["actor_rollout", "ref_log_prob", "actor_log_prob", "actor_train"],
                           "rule": ["rule_reward", "compute_advantage"]}
    assert _groups({}) == {"integrated": ["actor_rollout", "actor_log_prob", "actor_train"],
                           "rule": ["rule_reward", "compute_advantage"]}


def test_disaggregated_mode_groups():
    assert _groups({"placement.mode": "disaggregated"}) == {  # no KL term: no ref group
        "rollout": ["actor_rollout"], "rule": ["rule_reward", "compute_advantage"],
        "actor": ["actor_log_prob", "actor_train"]}
    assert _groups({**KL, "placement.mode": "disaggregated"}) == {
        "rollout": ["actor_rollout"], "rule": ["rule_reward", "compute_advantage"],
        "ref": ["ref_log_prob"], "actor": ["actor_log_prob", "actor_train"]}


def test_custom_mode_groups_and_resources():
    groups = {"gen": {"mfcs": ["actor_rollout"], "num_gpus": 1, "device": "cuda"},
              "train": {"mfcs": ["ref_log_prob", "actor_log_prob", "actor_train"], "dp": 2},
              "cpu": {"mfcs": ["rule_reward", "compute_advantage"]}}
    plan = make_plan(config_from_dict(with_overrides({**KL, "placement.mode": "custom", "placement.groups": groups})),
                     check_files=False)
    assert {g: [m.name for m in p.mfcs] for g, p in plan.groups.items()} == {
        "gen": ["actor_rollout"], "cpu": ["rule_reward", "compute_advantage"],
        "train": ["ref_log_prob", "actor_log_prob", "actor_train"]}
    assert plan.resource_totals() == {"CPU": 2.0, "GPU": 1.0, "NPU": 0.0}


def test_group_entry_moves_an_mfc_in_a_preset_mode():
    assert _groups({**KL, "placement.groups.gen.mfcs": ["actor_rollout"]}) == {
        "gen": ["actor_rollout"], "rule": ["rule_reward", "compute_advantage"],
        "integrated": ["ref_log_prob", "actor_log_prob", "actor_train"]}


def test_dry_run_plan_does_not_open_model_or_dataset():
    plan = make_plan(config_from_dict(with_overrides({"actor_config.model_path": "/nonexistent/model",
                                                      "data.dataset": "/nonexistent/data.jsonl"})),
                     check_files=False)
    assert any("not opened" in n for n in plan.notes)


# ------------------------------------------------------------------------------------------ error paths
# (overrides, stage, substrings the message must contain: the key, the value, and the fix)

LOAD_ERRORS = {
    "unknown section": ({"trainr": {"total_steps": 3}},
                        ["trainr", "unknown config section", "did you mean 'trainer'", "sections are ["]),
    "unknown key": ({"trainer.total_step": 3},
                    ["trainer.total_step", "unknown key", "did you mean 'total_steps'", "keys of trainer are ["]),
    "unknown key, no close match": ({"rl_config.zzz": 3},
                                    ["rl_config.zzz", "unknown key", "keys of rl_config are [", "'blocking'"]),
    "unknown group key": ({"placement.groups.integrated.num_cpu": 1},
                          ["placement.groups.integrated.num_cpu", "did you mean 'num_cpus'"]),
    "int given a word": ({"trainer.total_steps": "ten"}, ["trainer.total_steps='ten'", "expected an integer"]),
    "int given a fraction": ({"trainer.total_steps": 2.5}, ["trainer.total_steps=2.5", "expected an integer"]),
    "int given null": ({"trainer.total_steps": None}, ["trainer.total_steps=None", "expected an integer"]),
    "group int": ({"placement.groups.integrated.dp": "two"},
                  ["placement.groups.integrated.dp='two'", "expected an integer"]),
    "float given a word": ({"actor_config.lr": "fast"}, ["actor_config.lr='fast'", "expected a number"]),
    "float given a bool": ({"actor_config.lr": True}, ["actor_config.lr=True", "expected a number"]),
    "bool given a word": ({"rl_config.blocking": "yes"}, ["rl_config.blocking='yes'", "expected true or false"]),
    "bool given an int": ({"rl_config.guarantee_order": 1},
                          ["rl_config.guarantee_order=1", "expected true or false"]),
    "str given an int": ({"actor_config.loss_agg_mode": 3}, ["actor_config.loss_agg_mode=3", "expected a string"]),
    "optional str given an int": ({"ref_config.model_path": 3}, ["ref_config.model_path=3", "expected a string"]),
    "list given a str": ({"trainer.logger": "console"},
                         ["trainer.logger='console'", "expected a list, e.g. [a, b]"]),
    "mapping given a list": ({"placement.groups": [1]}, ["placement.groups=[1]", "expected a mapping"]),
    "section not a mapping": ({"trainer": 3}, ["trainer=3", "expected a mapping of keys for section 'trainer'"]),
    "group not a mapping": ({"placement.groups.integrated": 3},
                            ["placement.groups.integrated=3", "expected a mapping"]),
}

VALIDATE_ERRORS = {
    "mini does not divide the step's prompts": ({"actor_config.ppo_mini_batch_size": 6},
                                                ["actor_config.ppo_mini_batch_size=6 prompts",
                                                 "does not divide rl_config.prompts_per_step=16",
                                                 "set it to one of [1, 2, 4, 8, 16]", "or null"]),
    "group of zero": ({"rl_config.n_samples_per_prompt": 0},
                      ["rl_config.n_samples_per_prompt=0", "must be >= 1", "set it to 2 or more"]),
    "critic mini does not divide the step's prompts": ({"critic_config.ppo_mini_batch_size": 6},
                                                       ["critic_config.ppo_mini_batch_size=6 prompts",
                                                        "does not divide rl_config.prompts_per_step=16"]),
    "gae lambda out of range": ({"rl_config.lam": 1.5}, ["rl_config.lam=1.5", "must be in [0, 1]"]),
    "negative steps": ({"trainer.total_steps": -1}, ["trainer.total_steps=-1: must be >= 0"]),
    "negative save interval": ({"trainer.save_interval": -5},
                               ["trainer.save_interval=-5: must be >= 0", "0 turns periodic checkpoints off"]),
    "zero timeout": ({"trainer.stage_timeout_s": 0}, ["trainer.stage_timeout_s=0.0: must be > 0"]),
    "vllm context below prompt + response": ({"generate_config.backend": "vllm", "generate_config.vllm.max_model_len": 10},
                                             ["generate_config.vllm.max_model_len=10", "16 + 3 = 19",
                                              "raise it to at least 19"]),
    "zero prompts": ({"rl_config.prompts_per_step": 0}, ["rl_config.prompts_per_step=0: must be > 0"]),
    "zero mini": ({"actor_config.ppo_mini_batch_size": 0},
                  ["actor_config.ppo_mini_batch_size=0: must be > 0", "or null for one update per step"]),
    "negative mini": ({"actor_config.ppo_mini_batch_size": -4}, ["actor_config.ppo_mini_batch_size=-4: must be > 0"]),
    "zero micro": ({"actor_config.ppo_micro_batch_size_per_device": 0},
                   ["actor_config.ppo_micro_batch_size_per_device=0: must be > 0"]),
    "zero log-prob micro": ({"actor_config.log_prob_micro_batch_size_per_device": 0},
                            ["actor_config.log_prob_micro_batch_size_per_device=0: must be > 0"]),
    "zero ref micro": ({"ref_config.log_prob_micro_batch_size_per_device": 0},
                       ["ref_config.log_prob_micro_batch_size_per_device=0: must be > 0"]),
    "zero generate micro": ({"generate_config.micro_batch_size_per_device": 0},
                            ["generate_config.micro_batch_size_per_device=0: must be > 0"]),
    "zero dock micro": ({"rl_config.dock_micro_batch_size": 0}, ["rl_config.dock_micro_batch_size=0: must be > 0"]),
    "staleness with blocking": ({"rl_config.max_weight_staleness": 1, "rl_config.blocking": True},
                                ["rl_config.max_weight_staleness=1 with rl_config.blocking=true",
                                 "no step can run ahead of another", "set rl_config.blocking=false"]),
    "negative staleness": ({"rl_config.max_weight_staleness": -1}, ["rl_config.max_weight_staleness=-1: must be >= 0"]),
    "partial rollout on-policy": ({"rl_config.partial_rollout": True},
                                  ["rl_config.partial_rollout=true with rl_config.max_weight_staleness=0",
                                   "set rl_config.max_weight_staleness >= 1 and rl_config.guarantee_order=false"]),
    "partial rollout in order": ({"rl_config.partial_rollout": True, "rl_config.max_weight_staleness": 1},
                                 ["rl_config.partial_rollout=true with rl_config.guarantee_order=true",
                                  "(or partial_rollout=false)"]),
    "tis cap below 1": ({"actor_config.tis_cap": 0.5}, ["actor_config.tis_cap=0.5: must be >= 1"]),
    "negative lr": ({"actor_config.lr": -1e-3}, ["actor_config.lr=-0.001: must be > 0"]),
    "zero grad clip": ({"actor_config.grad_clip": 0}, ["actor_config.grad_clip=0.0: must be > 0"]),
    "negative kl coef": ({"actor_config.kl_loss_coef": -0.1}, ["actor_config.kl_loss_coef=-0.1: must be >= 0"]),
    "zero new tokens": ({"generate_config.max_new_tokens": 0}, ["generate_config.max_new_tokens=0: must be > 0"]),
    "negative temperature": ({"generate_config.temperature": -1},
                             ["generate_config.temperature=-1.0: must be >= 0", "0 means greedy"]),
    "top_p zero": ({"generate_config.top_p": 0}, ["generate_config.top_p=0.0: must be in (0, 1]"]),
    "top_p above one": ({"generate_config.top_p": 1.5}, ["generate_config.top_p=1.5: must be in (0, 1]"]),
    "negative top_k": ({"generate_config.top_k": -1}, ["generate_config.top_k=-1: must be >= 0", "0 turns it off"]),
    "zero prompt length": ({"data.max_prompt_length": 0}, ["data.max_prompt_length=0: must be > 0"]),
    "zero digits": ({"data.num_digits": 0}, ["data.num_digits=0: must be > 0"]),
    "zero dataset size": ({"data.size": 0}, ["data.size=0: must be > 0"]),
    "zero dp": ({"placement.groups.integrated.dp": 0}, ["placement.groups.integrated.dp=0: must be > 0"]),
    "negative cpus": ({"placement.groups.rule.num_cpus": -1}, ["placement.groups.rule.num_cpus=-1.0: must be >= 0"]),
    "negative gpus": ({"placement.groups.rule.num_gpus": -1}, ["placement.groups.rule.num_gpus=-1.0: must be >= 0"]),
    "negative npus": ({"placement.groups.rule.num_npus": -1}, ["placement.groups.rule.num_npus=-1.0: must be >= 0"]),
    "zero threads": ({"placement.groups.rule.torch_threads": 0},
                     ["placement.groups.rule.torch_threads=0: must be > 0"]),
    "a negative core": ({"placement.groups.rule.cpu_affinity": [-1]},
                        ["placement.groups.rule.cpu_affinity=[-1]", "a non-empty list of core ids such as [0]"]),
    "a core not here": ({"placement.groups.rule.cpu_affinity": [0, 4096]},
                        ["placement.groups.rule.cpu_affinity=[0, 4096]", "cores [4096] are not among this machine's"]),
    "dual clip bound": ({"actor_config.clip_ratio_c": 1.0},
                        ["actor_config.clip_ratio_c=1.0", "must be > 1", "3.0 is usual"]),
    "one beta": ({"actor_config.betas": [0.9]}, ["actor_config.betas=[0.9]", "two betas", "[0.9, 0.999]"]),
    "bad loss_agg_mode": ({"actor_config.loss_agg_mode": "mean"},
                          ["actor_config.loss_agg_mode='mean'",
                           "must be one of ['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum']"]),
    "bad kl_loss_type": ({"actor_config.kl_loss_type": "k4"},
                         ["actor_config.kl_loss_type='k4'", "must be one of [", "'k3'", "'low_var_kl'"]),
    "bad kl_ctrl": ({"actor_config.kl_ctrl": "pid"},
                    ["actor_config.kl_ctrl='pid'", "must be one of ['fixed', 'adaptive']"]),
    "bad dtype": ({"actor_config.dtype": "int8"},
                  ["actor_config.dtype='int8'", "must be one of ['float32', 'bfloat16', 'float16']"]),
    "bad placement mode": ({"placement.mode": "spread"},
                           ["placement.mode='spread'", "must be one of ['colocated', 'disaggregated', 'custom', 'mesh']"]),
    "zero bucket": ({"weight_sync.bucket_mb": 0}, ["weight_sync.bucket_mb=0", "must be > 0"]),
    "vllm memory share": ({"generate_config.vllm.gpu_memory_utilization": 1.5},
                          ["generate_config.vllm.gpu_memory_utilization=1.5", "must be in (0, 1]"]),
    "vllm sleep level": ({"generate_config.vllm.sleep_level": 3},
                         ["generate_config.vllm.sleep_level=3", "must be one of [1, 2]"]),
    "vllm sleep level 2 with staleness": ({"generate_config.backend": "vllm", "generate_config.vllm.enable_sleep_mode": True,
                                           "generate_config.vllm.sleep_level": 2, "rl_config.blocking": False,
                                           "rl_config.max_weight_staleness": 1},
                                          ["generate_config.vllm.sleep_level=2 with rl_config.max_weight_staleness=1",
                                           "use sleep_level=1"]),
    "bad logger": ({"trainer.logger": ["console", "neptune"]},
                   ["trainer.logger='neptune'", "must be one of ['console', 'jsonl', 'tensorboard', 'wandb', 'mlflow']"]),
    "dashboard port out of range": ({"trainer.dashboard_port": 70000},
                                    ["trainer.dashboard_port=70000", "a TCP port in [0, 65535]",
                                     "0 picks a free one"]),
    "bad device": ({"placement.groups.integrated.device": "tpu"},
                   ["placement.groups.integrated.device='tpu'", "must be one of ['cpu', 'cuda', 'npu', 'auto']"]),
}

PLAN_ERRORS = {
    "two NCCL ranks may share a GPU": ({"placement.groups.integrated.device": "cuda",
                                        "placement.groups.integrated.num_gpus": 0.5,
                                        "placement.groups.integrated.dp": 2},
                                       ["placement.groups.integrated.num_gpus=0.5 with 2 ranks in one process group",
                                        "which NCCL/HCCL refuse", "num_gpus: 1"]),
    "bad train backend": ({"actor_config.backend": "deepspeed"},
                          ["actor_config.backend='deepspeed'", "must be one of ['torch', 'fsdp', 'megatron']"]),
    "megatron on cpu": ({"actor_config.backend": "megatron"},
                        ["actor_config.backend=megatron: runs on ['cuda', 'npu']", "worker group 'integrated'",
                         "has device='cpu'"]),
    "bad rollout backend": ({"generate_config.backend": "sglang"},
                            ["generate_config.backend='sglang'", "must be one of ['hf', 'vllm']"]),
    "vllm beside a trainer": ({"generate_config.backend": "vllm", "placement.mode": "custom",
                               "placement.groups": {"all": {"mfcs": ["actor_rollout", "rule_reward", "actor_log_prob",
                                                                     "compute_advantage", "actor_train"]}}},
                              ["generate_config.backend=vllm: worker group 'all' hosts ['actor_rollout']",
                               "must have its process to itself"]),
    "partial rollout on vllm": ({"generate_config.backend": "vllm", "placement.mode": "disaggregated",
                                 "rl_config.max_weight_staleness": 1, "rl_config.guarantee_order": False,
                                 "rl_config.partial_rollout": True},
                                ["rl_config.partial_rollout=true: worker group 'rollout' generates on the vllm backend",
                                 "cannot take new weights while it generates", "or generate_config.vllm.serve=true",
                                 "one of ['hf']"]),
    "unknown algorithm": ({"rl_config.algorithm": "dpo"},
                          ["rl_config.algorithm='dpo'", "unknown algorithm", "known algorithms: grpo, ppo, remax"]),
    "grpo group of one": ({"rl_config.n_samples_per_prompt": 1, "rl_config.prompts_per_step": 128},
                          ["rl_config.n_samples_per_prompt=1", "grpo compares the responses within a prompt's group",
                           "MFCs ['compute_advantage']", "set it to 2 or more"]),
    "unknown reward": ({"rl_config.reward_fn": "nope"},
                       ["rl_config.reward_fn", "'nope'", "built-in rewards are [", "'digits'",
                        "dotted path", "my_pkg.my_module:my_fn"]),
    "reward module missing": ({"rl_config.reward_fn": "no_such_pkg_xyz.rewards:fn"},
                              ["rl_config.reward_fn", "'no_such_pkg_xyz.rewards:fn'",
                               "cannot import module 'no_such_pkg_xyz.rewards'"]),
    "model dir missing": ({"actor_config.model_path": "/nonexistent/model_dir"},
                          ["actor_config.model_path='/nonexistent/model_dir'", "no config.json",
                           "give a local checkpoint directory or 'builtin:tiny-qwen2'"]),
    "ref model dir missing": ({**KL, "ref_config.model_path": "/nonexistent/ref_dir"},
                              ["ref_config.model_path='/nonexistent/ref_dir'", "no config.json",
                               "'builtin:tiny-qwen2'"]),
    "unknown built-in model": ({"actor_config.model_path": "builtin:huge"},
                               ["actor_config.model_path='builtin:huge'", "unknown built-in model 'huge'",
                                "built-in models are ['builtin:tiny-qwen2', 'builtin:tiny-qwen2-4l', 'builtin:tiny-qwen2-tool', 'builtin:tiny-qwen2-lookup', 'builtin:smollm2-135m-instruct']"]),
    "empty model path": ({"actor_config.model_path": ""},
                         ["actor_config.model_path is empty", "'builtin:tiny-qwen2'"]),
    "unknown built-in dataset": ({"data.dataset": "builtin:multiply"},
                                 ["data.dataset='builtin:multiply'", "unknown built-in task",
                                  "['builtin:copy', 'builtin:reverse', 'builtin:sort', 'builtin:add', 'builtin:sum', 'builtin:lookup', 'builtin:arith']"]),
    "dataset file missing": ({"data.dataset": "/nonexistent/train.jsonl"},
                             ["data.dataset='/nonexistent/train.jsonl'", "no such file",
                              ".jsonl/.json/.parquet path", "builtin:copy"]),
    "group names an unknown MFC": ({"placement.groups.integrated.mfcs": ["actor_rolout"]},
                                   ["placement.groups.integrated.mfcs", "unknown MFC 'actor_rolout'",
                                    "the grpo graph has [", "'actor_rollout'"]),
    "custom mode leaves MFCs out": ({"placement.mode": "custom",
                                     "placement.groups": {"gen": {"mfcs": ["actor_rollout"]}}},
                                    ["placement: MFCs [", "'actor_train'", "are in no worker group",
                                     "placement.mode=custom", "placement.groups.<name>.mfcs"]),
    "custom mode with no groups": ({"placement.mode": "custom"},
                                   ["'actor_rollout'", "are in no worker group", "placement.groups.<name>.mfcs"]),
    "group the mode does not create": ({"placement.groups.actor.dp": 2},
                                       ["placement.groups.actor", "no such worker group in placement.mode="
                                        "'colocated'", "['integrated', 'rule']", "give it mfcs: [...]"]),
    "dp does not split the mini-batch": ({"placement.groups.integrated.dp": 3},
                                         ["placement.groups.integrated.dp=3",
                                          "actor_config.ppo_mini_batch_size=4 prompts x n_samples_per_prompt=8 = 32 "
                                          "rows", "3 equal shares", "set the dp to one of [1, 2, 4, 8, 16, 32]"]),
    "odd group, dp 2": ({"rl_config.n_samples_per_prompt": 3, "actor_config.ppo_mini_batch_size": 1,
                         "placement.groups.integrated.dp": 2},
                        ["placement.groups.integrated.dp=2", "actor_config.ppo_mini_batch_size=1 prompts x "
                         "n_samples_per_prompt=3 = 3 rows", "2 equal shares",
                         "set actor_config.ppo_mini_batch_size to one of [2, 4, 8, 16]"]),
    "dp of the trainer group, disaggregated": ({"placement.mode": "disaggregated",
                                                "placement.groups.actor.dp": 5},
                                               ["placement.groups.actor.dp=5", "5 equal shares"]),
}


def _check(msg: str, expected: list[str]) -> None:
    for part in expected:
        assert part in msg, f"{part!r} not in the message:\n{msg}"


@pytest.mark.parametrize("case", list(LOAD_ERRORS), ids=list(LOAD_ERRORS))
def test_load_errors(case):
    overrides, expected = LOAD_ERRORS[case]
    _check(error_of(overrides, "load"), expected)


@pytest.mark.parametrize("case", list(VALIDATE_ERRORS), ids=list(VALIDATE_ERRORS))
def test_validate_errors(case):
    overrides, expected = VALIDATE_ERRORS[case]
    run_stage(overrides, "load")  # the type is right: it is the value that is wrong
    msg = error_of(overrides, "validate")
    assert msg.startswith("invalid config:\n  - ")
    _check(msg, expected)


@pytest.mark.parametrize("case", list(PLAN_ERRORS), ids=list(PLAN_ERRORS))
def test_plan_errors(case):
    overrides, expected = PLAN_ERRORS[case]
    run_stage(overrides, "validate")  # each value is fine on its own: only the plan can tell
    _check(error_of(overrides, "plan"), expected)


def test_model_dir_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    msg = error_of({"actor_config.model_path": str(tmp_path)}, "plan")
    _check(msg, [f"actor_config.model_path={str(tmp_path)!r}", "no config.json", "'builtin:tiny-qwen2'"])


def test_dataset_that_is_a_directory(tmp_path):
    msg = error_of({"data.dataset": str(tmp_path)}, "plan")
    _check(msg, [f"data.dataset={str(tmp_path)!r}", "no such file"])


def test_existing_files_and_a_dotted_reward_pass_the_plan(tmp_path, monkeypatch):
    from mindspeed_rl.models import build_char_tokenizer
    (tmp_path / "config.json").write_text("{}")
    build_char_tokenizer().save_pretrained(str(tmp_path))   # the plan reads the policy's tokenizer
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "cfg_test_reward_mod.py").write_text("def score(response, answer, prompt):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_stage({"actor_config.model_path": str(tmp_path), "ref_config.model_path": str(tmp_path),
               "data.dataset": str(data), "rl_config.reward_fn": "cfg_test_reward_mod:score"}, "plan")


def test_the_tokenizer_is_checked_before_any_worker_starts():
    """A stop token the tokenizer does not have, and a chat template it does not have, are refused by the plan."""
    _check(error_of({"generate_config.stop_tokens": ["<|im_end|>"]}, "plan"),
           ["generate_config.stop_tokens: '<|im_end|>' is not a token of the tokenizer",
            "its end-of-sequence token is '<eos>'", "actor_config.model_path='builtin:tiny-qwen2'"])
    _check(error_of({"data.chat_template": True}, "plan"),
           ["data.chat_template=true, actor_config.model_path='builtin:tiny-qwen2'", "has no chat template"])


def test_tensorboard_logger_without_the_package(monkeypatch):
    """`import tensorboard` fails as it would without the package: the config names the fix."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    _check(error_of({"trainer.logger": ["console", "tensorboard"]}, "validate"),
           ["trainer.logger=[..., tensorboard]", "the tensorboard package is not installed",
            "`pip install tensorboard`", "drop tensorboard from trainer.logger"])
    monkeypatch.undo()
    run_stage({"trainer.logger": ["console", "tensorboard"]}, "validate")  # installed here: accepted


def test_several_problems_in_one_error():
    msg = error_of({"rl_config.n_samples_per_prompt": 0, "actor_config.lr": -1.0,
                    "actor_config.loss_agg_mode": "x", "generate_config.top_p": 2.0,
                    "placement.groups.integrated.device": "tpu"}, "validate")
    lines = msg.splitlines()
    assert lines[0] == "invalid config:" and all(line.startswith("  - ") for line in lines[1:])
    for key in ("rl_config.n_samples_per_prompt=0", "actor_config.lr=-1.0", "actor_config.loss_agg_mode='x'",
                "generate_config.top_p=2.0", "placement.groups.integrated.device='tpu'"):
        assert sum(key in line for line in lines) == 1, (key, msg)


def test_validation_runs_before_the_plan_checks():
    """make_plan reports value problems first, so a bad algorithm name does not hide them."""
    msg = error_of({"rl_config.n_samples_per_prompt": 0, "rl_config.algorithm": "dpo"}, "plan")
    assert "rl_config.n_samples_per_prompt=0" in msg


# -------------------------------------------------------------------------------------------- the cluster


def _plan(overrides):
    return make_plan(config_from_dict(with_overrides(overrides)), check_files=False)


def test_cluster_too_small_for_cpus():
    plan = _plan({"placement.groups.integrated.num_cpus": 1.5})  # 1.5 + 0.5 (rule) = 2 CPUs
    assert plan.resource_totals()["CPU"] == 2.0
    with pytest.raises(ConfigError) as e:
        check_cluster(plan, {"CPU": 1.0})
    _check(str(e.value), ["placement needs 2 CPU", "integrated: 1.5 x dp 1", "rule: 0.5 x dp 1",
                          "the Ray cluster has 1", "lower placement.groups.<name>.num_cpus"])
    check_cluster(plan, {"CPU": 2.0})  # fits exactly


def test_cluster_counts_dp_and_gpus():
    plan = _plan({"placement.groups.integrated.num_gpus": 1, "placement.groups.integrated.dp": 2,
                  "placement.groups.integrated.device": "cuda"})
    with pytest.raises(ConfigError) as e:
        check_cluster(plan, {"CPU": 8.0, "GPU": 1.0})
    _check(str(e.value), ["placement needs 2 GPU", "integrated: 1.0 x dp 2", "the Ray cluster has 1",
                          "num_gpus"])
    check_cluster(plan, {"CPU": 8.0, "GPU": 2.0})


def test_cluster_without_npus():
    plan = _plan({"placement.groups.integrated.num_npus": 1, "placement.groups.integrated.device": "npu"})
    with pytest.raises(ConfigError, match=r"placement needs 1 NPU .* but the Ray cluster has 0.*num_npus"):
        check_cluster(plan, {"CPU": 8.0})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------- sizes that survive a change of n


@pytest.mark.parametrize("n", range(2, 9))
def test_tiny_default_with_only_n_changed_validates_and_plans(n):
    """`python cli/train_grpo.py rl_config.n_samples_per_prompt=N` needs no other key: the mini-batch
    counts prompts, the row sizes are rounded to what they must divide, and the plan says so."""
    plan = make_plan(config_from_dict(with_overrides({"rl_config.n_samples_per_prompt": n})), check_files=True)
    assert plan.rows_per_step == 16 * n
    from mindspeed_rl.config.sizes import group_rows, train_sizes
    sizes = train_sizes(4, 32, 16, n, 1)
    assert sizes.mini_rows_per_device == 4 * n and (4 * n) % sizes.micro_rows == 0 and sizes.micro_rows <= 32
    assert group_rows(64, n) % n == 0 and group_rows(32, n) % n == 0
    rounded = "\n".join(plan.size_notes)
    assert ("actor_config.ppo_micro_batch_size_per_device=32 ->" in rounded) == (n != 8)
    assert ("generate_config.micro_batch_size_per_device=64 ->" in rounded) == (64 % n != 0)


def test_sizes_round_to_what_they_must_divide():
    from mindspeed_rl.config.sizes import group_rows, largest_divisor_at_most, train_sizes
    assert largest_divisor_at_most(28, 32) == 28 and largest_divisor_at_most(28, 10) == 7
    assert largest_divisor_at_most(13, 4) == 1
    assert group_rows(64, 3) == 63 and group_rows(2, 3) == 3 and group_rows(32, 8) == 32
    s = train_sizes(None, 32, 16, 3, 2)  # whole step (48 rows) over 2 ranks
    assert (s.rows_per_device, s.mini_rows_per_device, s.micro_rows) == (24, 24, 24)
    s = train_sizes(2, 5, 16, 7, 1)
    assert (s.mini_rows_per_device, s.micro_rows) == (14, 2)


def test_dp_two_splits_a_mini_batch_of_odd_groups_when_the_prompts_are_even():
    """n=3 (an odd group) on dp 2: a mini-batch of 4 prompts (12 rows) splits into 2 equal shares of
    6 rows (two whole groups each), the step's 48 rows into 2 x 24; the micro-batch is rounded to
    divide the 6 rows and the plan says so. A mini-batch of 1 prompt (3 rows) cannot split in two and
    is refused naming the dp key, the mini-batch key and the sizes that fit."""
    from mindspeed_rl.config.sizes import train_sizes
    cfg = config_from_dict(with_overrides({"rl_config.n_samples_per_prompt": 3, "placement.groups.integrated.dp": 2}))
    assert (cfg.rl_config.prompts_per_step, cfg.actor_config.ppo_mini_batch_size) == (16, 4)  # even prompts
    plan = make_plan(cfg, check_files=False)  # no ConfigError: 12 rows split over 2 ranks
    group = plan.groups[plan.group_of("actor_train")]
    assert group.resources.dp == 2
    assert plan.rows_per_step == 48
    s = train_sizes(cfg.actor_config.ppo_mini_batch_size, cfg.actor_config.ppo_micro_batch_size_per_device,
                    cfg.rl_config.prompts_per_step, 3, group.resources.dp)
    assert (s.rows_per_device, s.mini_rows_per_device, s.micro_rows) == (24, 6, 6)
    # equal shares: both ranks together take the whole step and the whole mini-batch, nothing left over
    assert s.rows_per_device * 2 == plan.rows_per_step and s.mini_rows_per_device * 2 == 4 * 3
    assert s.mini_rows_per_device % 3 == 0  # each rank's share is whole prompt groups
    assert ("actor_config.ppo_micro_batch_size_per_device=32 -> 6 rows: the largest that divides the 6 rows of an "
            "optimizer step per device (actor_config.ppo_mini_batch_size=4 prompts x n_samples_per_prompt=3 / dp=2)"
            ) in plan.size_notes

    odd = config_from_dict(with_overrides({"rl_config.n_samples_per_prompt": 3, "placement.groups.integrated.dp": 2,
                                           "actor_config.ppo_mini_batch_size": 1}))
    with pytest.raises(ConfigError) as e:
        make_plan(odd, check_files=False)
    _check(str(e.value), ["placement.groups.integrated.dp=2",
                          "actor_config.ppo_mini_batch_size=1 prompts x n_samples_per_prompt=3 = 3 rows",
                          "must split into 2 equal shares",
                          "set actor_config.ppo_mini_batch_size to one of [2, 4, 8, 16] (prompts), or the dp to one "
                          "of [1, 3]"])


RENAMED = {
    "actor_config.mini_batch_size": (32, "actor_config.ppo_mini_batch_size, counted in prompts",
                                     "set actor_config.ppo_mini_batch_size=4 (32 rows / rl_config.n_samples_per_prompt=8)"),
    "actor_config.micro_batch_size": (16, "actor_config.ppo_micro_batch_size_per_device",
                                      "set actor_config.ppo_micro_batch_size_per_device=16"),
    "actor_config.log_prob_micro_batch_size": (64, "actor_config.log_prob_micro_batch_size_per_device",
                                               "set actor_config.log_prob_micro_batch_size_per_device=64"),
    "ref_config.micro_batch_size": (64, "ref_config.log_prob_micro_batch_size_per_device",
                                    "set ref_config.log_prob_micro_batch_size_per_device=64"),
    "critic_config.mini_batch_size": (None, "critic_config.ppo_mini_batch_size, counted in prompts",
                                      "set critic_config.ppo_mini_batch_size=null"),
    "critic_config.micro_batch_size": (8, "critic_config.ppo_micro_batch_size_per_device", "=8"),
    "critic_config.infer_micro_batch_size": (8, "critic_config.forward_micro_batch_size_per_device", "=8"),
    "generate_config.micro_batch_size": (64, "generate_config.micro_batch_size_per_device",
                                         "rounded down to whole prompt groups"),
}


@pytest.mark.parametrize("old", list(RENAMED))
def test_old_size_keys_are_refused_with_what_they_became(old):
    value, *expected = RENAMED[old]
    msg = error_of({old: value}, "load")
    _check(msg, [f"{old}={'null' if value is None else value}: renamed: it is now", *expected])


def test_old_mini_batch_key_converts_for_the_configs_n():
    msg = error_of({"actor_config.mini_batch_size": 24, "rl_config.n_samples_per_prompt": 3}, "load")
    _check(msg, ["set actor_config.ppo_mini_batch_size=8 (24 rows / rl_config.n_samples_per_prompt=3)"])
    msg = error_of({"actor_config.mini_batch_size": 20}, "load")
    _check(msg, ["20 rows are not whole groups of 8"])


def test_old_key_through_hydra_with_plus_gets_the_rename_message():
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        raw = compose("grpo_tiny", overrides=["+actor_config.mini_batch_size=32"])
    with pytest.raises(ConfigError, match="renamed: it is now actor_config.ppo_mini_batch_size"):
        config_from_dict(raw)


def test_sections_of_models_not_in_the_graph_are_not_validated():
    """GRPO has no critic, and with no KL term no reference: their sections are not checked (nor needed)."""
    bad_critic = {"critic_config.ppo_mini_batch_size": 5, "critic_config.lr": -1.0}
    make_plan(config_from_dict(with_overrides({**bad_critic, "rl_config.prompts_per_step": 12})), check_files=False)
    make_plan(config_from_dict(with_overrides({"ref_config.log_prob_micro_batch_size_per_device": 0})),
              check_files=False)
    _check(error_of({**KL, "ref_config.log_prob_micro_batch_size_per_device": 0}, "plan"),
           ["ref_config.log_prob_micro_batch_size_per_device=0: must be > 0"])
    _check(error_of({**bad_critic, "rl_config.algorithm": "ppo"}, "plan"),
           ["critic_config.ppo_mini_batch_size=5 prompts", "critic_config.lr=-1.0: must be > 0"])
    # a reference path that does not exist is not opened when no reference is loaded
    make_plan(config_from_dict(with_overrides({"ref_config.model_path": "/nonexistent/ref_dir"})), check_files=True)


# --------------------------------------------------------------------------------- no wasted stage


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "remax"])
def test_no_kl_term_no_reference_stage_nor_model(algorithm):
    base = {"rl_config.algorithm": algorithm}
    if algorithm == "ppo":
        base.update({"rl_config.n_samples_per_prompt": 1, "rl_config.prompts_per_step": 128})
    for overrides in ({"actor_config.kl_loss_coef": 0.0}, {"actor_config.use_kl_loss": False, **KL}):
        plan = make_plan(config_from_dict(with_overrides({**base, **overrides})), check_files=False)
        assert "ref" not in {m.model_name for m in plan.order} and "ref" not in plan.model_paths
        assert "ref_log_prob" not in plan.columns and "ref_log_prob" not in plan.consumers
        train = next(m for m in plan.order if m.name == "actor_train")
        assert "ref_log_prob" not in train.input_keys
        assert all(m.model_name != "ref" for g in plan.groups.values() for m in g.mfcs)
    plan = make_plan(config_from_dict(with_overrides({**base, **KL, "placement.mode": "disaggregated"})),
                     check_files=False)
    assert [m.name for m in plan.groups["ref"].mfcs] == ["ref_log_prob"] and "ref" in plan.model_paths
    assert "ref_log_prob" in next(m for m in plan.order if m.name == "actor_train").input_keys


def test_the_one_gpu_config_switches_to_hf_rollout_with_one_override():
    """grpo_qwen25_0p5b_1gpu gives vLLM a rollout group of its own (0.4 of the GPU); with
    generate_config.backend=hf that group does not exist, and its share goes to the group that
    generates instead, so the user needs no second and third override."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        raw = compose("grpo_qwen25_0p5b_1gpu", overrides=["generate_config.backend=hf"])
    plan = make_plan(config_from_dict(raw), check_files=False)
    assert "rollout" not in plan.groups
    integrated = plan.groups["integrated"]
    assert "actor_rollout" in [m.name for m in integrated.mfcs]
    assert integrated.resources.num_gpus == pytest.approx(1.0) and integrated.resources.num_cpus == 4
    assert any("placement.groups.rollout is for a rollout backend with a process of its own" in n for n in plan.notes)
    assert plan.resource_totals()["GPU"] == pytest.approx(1.0)


def test_a_group_no_backend_implies_is_still_refused():
    with pytest.raises(ConfigError, match=r"placement.groups.nosuch: no such worker group"):
        make_plan(config_from_dict(with_overrides({"placement.groups.nosuch": {"num_cpus": 1}})), check_files=False)


def test_an_options_check_runs_only_where_its_backend_reads_the_section():
    """generate_config.vllm.max_model_len below prompt + response is refused where the rollout backend reads
    generate_config.vllm (the engine registry's Backend.section), and ignored where it does not."""
    short = {"generate_config.vllm.max_model_len": 10}
    assert "raise it to at least 19" in error_of({**short, "generate_config.backend": "vllm"}, "plan",
                                                 check_files=False)
    run_stage({**short, "generate_config.backend": "hf"}, "plan", check_files=False)
    cfg = config_from_dict(with_overrides(short))
    check_config(cfg, option_sections={"generate_config.backend_options"})
    with pytest.raises(ConfigError, match="raise it to at least 19"):
        check_config(cfg, option_sections={"generate_config.vllm"})
