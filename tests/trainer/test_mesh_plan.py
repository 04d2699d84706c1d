"""placement.mode=mesh through the trainer's plan: the ReaLHF PPO allocation as a dry run, the
worker groups and device shares it implies, and the errors a bad placement gets before any start."""
from __future__ import annotations

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.planning import format_plan, make_plan

# ReaLHF's PPO example on 1 node x 8 GPUs (plus our actor_log_prob, which shares the trainer's mesh)
REALHF_PPO = {"actor_rollout": {"mesh": "all", "dp": 4, "pp": 2}, "critic_values": {"mesh": [0, 1]},
              "rule_reward": {"mesh": [2, 3]}, "ref_log_prob": {"mesh": "4-7"}, "critic_train": {"mesh": "4-7"},
              "actor_train": {"mesh": "0-3"}, "actor_log_prob": {"mesh": "0-3"}}


def plan_of(mfcs, check_files=False, **placement):
    cfg = config_from_dict({"rl_config": {"algorithm": "ppo", "n_samples_per_prompt": 1, "prompts_per_step": 128},
                            "placement": {"mode": "mesh", "n_nodes": 1, "n_devices_per_node": 8,
                                          "device_kind": "gpu", "cpus_per_device": 3, "mfcs": mfcs, **placement}})
    return make_plan(cfg, check_files=check_files)


def test_realhf_ppo_example_dry_run_table():
    plan = plan_of(REALHF_PPO)
    text = format_plan(plan)
    lines = text.splitlines()
    for row in (["actor_rollout", "actor", "all", "4/1/2", "0-7"], ["critic_values", "critic", "node0:0-1", "2/1/1"],
                ["rule_reward", "reward", "node0:2-3", "2/1/1"], ["ref_log_prob", "ref", "node0:4-7", "4/1/1"],
                ["critic_train", "critic", "node0:4-7", "4/1/1"], ["actor_train", "actor", "node0:0-3", "4/1/1"]):
        assert any(line.split()[:len(row)] == row for line in lines), (row, text)
    device_map = plan.placement.device_map()
    assert device_map[0] == ["actor_rollout", "actor_log_prob", "critic_values", "actor_train"]
    assert device_map[2] == ["actor_rollout", "rule_reward", "actor_log_prob", "actor_train"]
    assert device_map[4] == ["actor_rollout", "ref_log_prob", "critic_train"]
    assert "planned, not run" not in text  # every split here runs (generation pp 2 on the mesh backend)


def test_mesh_groups_share_a_model_copy_and_split_devices():
    plan = plan_of(REALHF_PPO)
    groups = {g: [m.name for m in p.mfcs] for g, p in plan.groups.items()}
    assert groups["actor@node0:0-3"] == ["actor_log_prob", "actor_train"]  # one copy of the trainer's weights
    assert groups["rule"] == ["compute_advantage"]  # no model, not placed: a light CPU group
    g = plan.groups["actor@node0:0-3"]
    assert g.devices == [0, 1, 2, 3] and g.resources.dp == 4 and g.resources.device == "cuda"
    # devices 0-3 carry 3 groups (generation, actor train, critic or reward): a third of a GPU each
    assert g.resources.num_gpus == 0.3333 and g.resources.num_cpus == 1.0
    assert plan.groups["critic@node0:4-7"].resources.num_gpus == 0.3333  # 4-7: generation, ref, critic train


def test_real_run_plans_split_generation_on_the_mesh_backend():
    plan = plan_of(REALHF_PPO, check_files=True)
    gen = plan.groups["actor@all/4/1/2"]
    assert gen.world == 8 and gen.rollout_backend == "mesh"  # 4 replicas x 2 stages, one actor per rank
    assert plan.groups["actor@node0:0-3"].rollout_backend != "mesh"


def test_a_split_the_rollout_backend_cannot_run_is_refused_and_shown_by_a_dry_run():
    vllm = {"generate_config": {"backend": "vllm"}}
    cfg = config_from_dict({"rl_config": {"algorithm": "ppo", "n_samples_per_prompt": 1, "prompts_per_step": 128},
                            **vllm, "placement": {"mode": "mesh", "n_nodes": 1, "n_devices_per_node": 8,
                                                  "device_kind": "gpu", "cpus_per_device": 3, "mfcs": REALHF_PPO}})
    with pytest.raises(ConfigError, match=r"actor_rollout: pp=2 with generate_config.backend='vllm'"):
        make_plan(cfg, check_files=True)
    assert "planned, not run: placement.mfcs.actor_rollout: pp=2" in format_plan(make_plan(cfg, check_files=False))


@pytest.mark.parametrize("mfcs, placement, words", [
    ({**REALHF_PPO, "nosuch": {"mesh": [0]}}, {}, ["placement.mfcs: unknown MFC(s) ['nosuch']"]),
    ({k: v for k, v in REALHF_PPO.items() if k != "ref_log_prob"}, {},
     ["MFC(s) ['ref_log_prob'] run a model but have no entry in placement.mfcs"]),
    ({**REALHF_PPO, "critic_values": {"mesh": [1, 2]}}, {}, ["critic_values", "not a multiple of the mesh size 2"]),
    ({**REALHF_PPO, "ref_log_prob": {"mesh": "4-7", "dp": 2}}, {}, ["ref_log_prob", "dp*tp*pp = 2*1*1 = 2"]),
    ({**REALHF_PPO, "actor_rollout": {"mesh": "0-15"}}, {}, ["actor_rollout"]),
])
def test_bad_placements_are_named(mfcs, placement, words):
    with pytest.raises(ConfigError) as e:
        plan_of(mfcs, **placement)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_mfcs_without_mesh_mode_is_refused():
    cfg = config_from_dict({"placement": {"mfcs": {"actor_rollout": {"mesh": [0]}}}})
    with pytest.raises(ConfigError, match="per-MFC meshes need placement.mode=mesh"):
        make_plan(cfg, check_files=False)


def test_a_model_the_mesh_backend_cannot_split_is_refused_by_the_plan(tmp_path):
    """GPT-2's modules are not the Qwen2/Llama layout the mesh backends split: refused before any worker
    starts (it used to fail 49 s in, inside a worker: 'GPT2Model' object has no attribute 'embed_tokens')."""
    import json

    from hydra import compose, initialize_config_dir

    from tests.config.helpers import REPO
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32}))
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        raw = compose("grpo_tiny_pp2", overrides=[f"actor_config.model_path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"runs 'actor' .* on the mesh train backend: its model_type 'gpt2' is not "
                                          r"one the mesh backends split .*use tp: 1 and pp: 1"):
        make_plan(config_from_dict(raw), check_files=True)
