"""configs/grpo_tiny_tool.yaml (the model calls the lookup tool when it decides to and writes the answer) and
configs/grpo_tiny_tool_forced.yaml (the calc call forced, its result the answer) load, validate and plan: the agent
rollout on the tool models, loss_mask through the old log-probs and the loss; and the agent section's bad values
are refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.config.load import ConfigError
from mindspeed_rl.config.checks import check_config
from mindspeed_rl.planning import make_plan

REPO = Path(__file__).resolve().parents[2]


def _cfg(config: str = "grpo_tiny_tool", **over):
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / f"{config}.yaml"))
    for key, value in over.items():
        section, _, field = key.rpartition(".")
        node = raw
        for part in section.split("."):
            node = node[part]
        node[field] = value
    return config_from_dict(raw)


@pytest.mark.parametrize("config, tools, tool_choice, return_direct, reward, model", [
    ("grpo_tiny_tool", ["lookup"], None, [], "lookup_answer", "builtin:tiny-qwen2-lookup"),
    ("grpo_tiny_tool_forced", ["calc"], "calc", ["calc"], "calc_digits", "builtin:tiny-qwen2-tool"),
])
def test_the_tool_configs_plan_the_agent_rollout(config, tools, tool_choice, return_direct, reward, model):
    cfg = _cfg(config)
    check_config(cfg)
    agent = cfg.generate_config.agent
    assert agent.enable and list(agent.tools) == tools and agent.tool_choice == tool_choice
    assert list(agent.return_direct) == return_direct
    assert cfg.rl_config.reward_fn == reward and cfg.actor_config.model_path == model
    plan = make_plan(cfg, check_files=False)
    m = {x.name: x for x in plan.order}
    assert m["actor_rollout"].fn == "agent_generate" and "loss_mask" in m["actor_rollout"].output_keys
    assert "loss_mask" in m["actor_train"].input_keys and "loss_mask" in plan.columns


@pytest.mark.parametrize("over, words", [
    ({"generate_config.agent.max_turns": 0}, "generate_config.agent.max_turns=0"),
    ({"generate_config.agent.syntax": "xml"}, "generate_config.agent.syntax='xml'"),
    ({"generate_config.agent.tool_timeout_s": 0.0}, "generate_config.agent.tool_timeout_s=0.0"),
    ({"generate_config.agent.tools": []}, "generate_config.agent.tools=[]"),
    ({"generate_config.agent.return_direct": ["search"]}, "generate_config.agent.return_direct=['search']: ['search']"),
    ({"generate_config.agent.return_direct": "calc"}, "generate_config.agent.return_direct='calc': expected a list"),
    ({"rl_config.overlong_buffer.length": 50}, "rl_config.overlong_buffer.length=50"),
    ({"rl_config.dynamic_sampling": True, "rl_config.blocking": True}, "rl_config.blocking=false"),
    ({"rl_config.dynamic_sampling": True, "rl_config.max_oversample": 0.5}, "rl_config.max_oversample=0.5"),
])
def test_bad_agent_and_dapo_values_are_refused_by_name(over, words):
    with pytest.raises(ConfigError) as e:
        check_config(_cfg(**over))
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("tools, check_files, words", [
    (["nosuch"], True, "generate_config.agent.tools: unknown tool 'nosuch'"),
    (["nosuch"], False, "generate_config.agent.tools: unknown tool 'nosuch'"),
    (["no_such_pkg.tools:fn"], True, "cannot import module 'no_such_pkg.tools'"),
    (["calc", "tests.agent.tools_example:calc"], False, "two tools are called 'calc'"),
])
def test_an_unknown_tool_is_refused_by_the_plan(tools, check_files, words):
    """Every tool resolves before any worker starts (a dry run checks the built-in names it can), so a typo ends
    the run with exit 2 and this message, not inside a rollout worker after Ray has started."""
    cfg = _cfg("grpo_tiny_tool_forced", **{"generate_config.agent.tools": tools,
                                           "generate_config.agent.return_direct": [],
                                           "generate_config.agent.tool_choice": None})
    with pytest.raises(ConfigError, match=words):
        make_plan(cfg, check_files=check_files)


def test_an_unknown_tool_exits_2_before_ray(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(REPO / "cli" / "train_grpo.py"), "--config-name", "grpo_tiny_tool",
                        "generate_config.agent.tools=[nosuch]", "generate_config.agent.return_direct=[]",
                        "generate_config.agent.tool_choice=null", f"trainer.output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "unknown tool 'nosuch'" in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
