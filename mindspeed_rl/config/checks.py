"""Checks of a config on its own (no cluster, no files): divisibility, ranges, names.

Checks that need other layers (reward names, model paths, the placement against the dataflow
graph and the Ray cluster) run in `mindspeed_rl.planning`, still before any worker starts.
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Collection

from ..device import DEVICE_KINDS, RAY_RESOURCES, WORKER_DEVICES
from .load import ConfigError
from .schema import Config
from .vocab import AGENT_SYNTAXES, AGG_MODES, KL_CONTROLLER_KINDS, KL_KINDS, REWARD_SOURCES

MESH_MODE = "mesh"                        # placement.mode whose groups follow from placement.mfcs
PLACEMENT_MODES = ("colocated", "disaggregated", "custom", MESH_MODE)
WEIGHT_SYNC_BACKENDS = ("auto", "gloo", "ipc")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
LOGGER_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}   # a logger whose package is an extra -> the extra's name
SAVE_HF = ("final", "every_save", "never")
DTYPES = ("float32", "bfloat16", "float16")


def _positive(errors: list, key: str, value, fix: str = "", allow_zero: bool = False) -> None:
    bad = value is None or value < 0 or (value == 0 and not allow_zero)
    if bad:
        errors.append(f"{key}={value!r}: must be {'>= 0' if allow_zero else '> 0'}{'; ' + fix if fix else ''}")


def _one_of(errors: list, key: str, value, allowed) -> None:
    if value not in allowed:
        errors.append(f"{key}={value!r}: must be one of {list(allowed)}")


def installed(module: str) -> bool:
    """Can `module` be imported here (without importing it)?"""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or an import blocked by sys.modules
        return False


def _mini_batch(errors: list, section: str, mini, prompts_per_step: int) -> None:
    """A mini-batch counted in prompts must divide the step's prompts, so every optimizer step sees as many
    (and it stays valid for any n_samples_per_prompt, which multiplies both)."""
    key = f"{section}.ppo_mini_batch_size"
    if mini is None:
        return
    _positive(errors, key, mini, "or null for one update per step")
    if mini > 0 and prompts_per_step > 0 and prompts_per_step % mini:
        divisors = [d for d in range(1, prompts_per_step + 1) if prompts_per_step % d == 0]
        errors.append(f"{key}={mini} prompts does not divide rl_config.prompts_per_step={prompts_per_step}; every "
                      f"optimizer step must see as many prompts: set it to one of {divisors} (it counts prompts, "
                      f"x n_samples_per_prompt rows), or null for one update per step")


REWARD_MODELING = "reward_modeling"   # the algorithm that trains the reward model (dataflow/reward_modeling.py)


def _reward_model(e: list, cfg: Config, models: Collection[str] | None) -> None:
    """reward_model, rl_config.reward_weights / reward_fn and the reward-modeling keys."""
    rm, rl = cfg.reward_model, cfg.rl_config
    training = rl.algorithm == REWARD_MODELING
    _positive(e, "trainer.eval_interval", cfg.trainer.eval_interval, "0 evaluates only at the end", allow_zero=True)
    _positive(e, "trainer.log_samples", cfg.trainer.log_samples, "0 writes none from training", allow_zero=True)
    _positive(e, "data.eval_size", cfg.data.eval_size, "0 holds nothing out", allow_zero=True)
    weights = rl.reward_weights
    for source, w in weights.items():
        if source not in REWARD_SOURCES:
            e.append(f"rl_config.reward_weights.{source}: unknown reward source; the sources are {list(REWARD_SOURCES)} "
                     "(e.g. {model: 1.0, rule: 0.0})")
        elif isinstance(w, bool) or not isinstance(w, (int, float)):
            e.append(f"rl_config.reward_weights.{source}={w!r}: must be a number (the weight of its score)")
    if rm.enable and not training:
        numbers = {k: float(v) for k, v in weights.items() if k in REWARD_SOURCES and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        if not any(numbers.values()):
            e.append(f"rl_config.reward_weights={weights}: every weight is 0, so nothing would train the policy; give "
                     "the reward model (model) or the rule reward (rule) a weight, e.g. {model: 1.0, rule: 0.0}")
        if numbers.get("rule") and not rl.reward_fn:
            e.append(f"rl_config.reward_weights.rule={numbers['rule']} but rl_config.reward_fn is null: a rule weight "
                     "needs a rule reward; set rl_config.reward_fn or the rule's weight to 0")
    elif not rl.reward_fn and not training and (models is None or "actor" in models):
        e.append("rl_config.reward_fn=null and reward_model.enable=false: nothing scores the responses; set "
                 "rl_config.reward_fn (e.g. digits) or enable a reward model (reward_model.enable=true)")
    if rm.enable or training:
        _one_of(e, "reward_model.dtype", rm.dtype, DTYPES)
        _positive(e, "reward_model.micro_batch_size_per_device", rm.micro_batch_size_per_device)
        if not rm.model_path:
            e.append("reward_model.model_path is empty; " + (
                "set the model to train from (e.g. builtin:tiny-qwen2: its backbone gets a fresh one-label head)"
                if training else "set it to a reward model (a one-label sequence classifier, e.g. "
                                 "<trainer.output_dir>/final of cli/train_rm.py)"))
    if training:
        _positive(e, "reward_model.lr", rm.lr)
        _positive(e, "reward_model.grad_clip", rm.grad_clip)
        _positive(e, "reward_model.weight_decay", rm.weight_decay, allow_zero=True)
        if rm.mini_batch_size is not None:
            _positive(e, "reward_model.mini_batch_size", rm.mini_batch_size, "or null for one update per step")
            if rm.mini_batch_size > 0 and rl.prompts_per_step % rm.mini_batch_size:
                e.append(f"reward_model.mini_batch_size={rm.mini_batch_size} pairs does not divide "
                         f"rl_config.prompts_per_step={rl.prompts_per_step} (the pairs of a step); every optimizer "
                         "step must see as many pairs")
        if rl.n_samples_per_prompt != 1:
            e.append(f"rl_config.n_samples_per_prompt={rl.n_samples_per_prompt}: reward modeling reads each preference "
                     "pair once; set it to 1 (rl_config.prompts_per_step counts pairs)")


def check_config(cfg: Config, models: Collection[str] | None = None,
                    option_sections: Collection[str] | None = None) -> None:
    """Raise one ConfigError listing every problem found (so a user fixes them in one go).

    `models`: the model roles of the algorithm's graph (`actor`, `ref`, `critic`, ...). The section
    `<role>_config` of a model that is not in the graph is not checked: nothing reads it (GRPO has no
    critic; a run without a KL term loads no reference). None checks every section.
    `option_sections`: the config sections of backend options the run's backends read (the engine
    registry's `Backend.section`, e.g. generate_config.vllm); a check that holds only for a section's
    backend runs when its section is read. None checks every section.
    """
    def used(role: str) -> bool:
        return models is None or role in models

    def read(section: str) -> bool:
        return option_sections is None or section in option_sections

    e: list[str] = []
    _trainer(e, cfg.trainer)
    _loggers(e, cfg.trainer)
    _simulation(e, cfg.trainer)
    _steps(e, cfg.rl_config)
    _batch_sizes(e, cfg, used)
    _generation(e, cfg.generate_config)
    _weight_sync(e, cfg.weight_sync)
    _vllm(e, cfg, read(VLLM_SECTION))
    _optimizer(e, cfg.actor_config)
    _policy_loss(e, cfg.actor_config)
    if used("critic"):
        _critic(e, cfg.critic_config, cfg.rl_config.prompts_per_step)
    _reward_model(e, cfg, models)
    _advantage(e, cfg.rl_config)
    _agent(e, cfg.generate_config.agent)
    _overlong(e, cfg.rl_config.overlong_buffer, cfg.generate_config.max_new_tokens)
    _dynamic_sampling(e, cfg.rl_config)
    _data(e, cfg.data)
    _placement(e, cfg.placement)
    _validation(e, cfg)
    if e:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(e))


def _trainer(e: list[str], t) -> None:
    """trainer: step counts, checkpoints, the run's names, its Hugging Face export, the dashboard's port, the seed."""
    _positive(e, "trainer.total_steps", t.total_steps, allow_zero=True)
    _positive(e, "trainer.save_interval", t.save_interval, "0 turns periodic checkpoints off", allow_zero=True)
    _positive(e, "trainer.keep_checkpoints", t.keep_checkpoints, "0 keeps every checkpoint", allow_zero=True)
    _positive(e, "trainer.stage_timeout_s", t.stage_timeout_s)
    if not isinstance(t.project_name, str) or not t.project_name:
        e.append(f"trainer.project_name={t.project_name!r}: must be a non-empty string (wandb's project, mlflow's "
                 "experiment)")
    if t.experiment_name is not None and (not isinstance(t.experiment_name, str) or not t.experiment_name):
        e.append(f"trainer.experiment_name={t.experiment_name!r}: must be a non-empty string, or null for "
                 "output_dir's last part")
    bad_tags = [x for x in t.tags if not isinstance(x, str) or not x]
    if bad_tags:
        e.append(f"trainer.tags={list(t.tags)!r}: {bad_tags} are not non-empty strings; give a list of strings "
                 "(e.g. [grpo, tiny])")
    _one_of(e, "trainer.save_hf", t.save_hf, SAVE_HF)
    if not 0 <= t.dashboard_port <= 65535:
        e.append(f"trainer.dashboard_port={t.dashboard_port}: must be a TCP port in [0, 65535]; "
                 "0 picks a free one (printed at start)")
    if t.seed < 0:
        e.append(f"trainer.seed={t.seed}: must be >= 0 (numpy seeds are non-negative)")


def _loggers(e: list[str], t) -> None:
    """trainer.logger: known names, each with its package installed."""
    for lg in t.logger:
        _one_of(e, "trainer.logger", lg, LOGGERS)
    if "tensorboard" in t.logger and not installed("tensorboard"):
        e.append("trainer.logger=[..., tensorboard]: the tensorboard package is not installed; "
                 "`pip install tensorboard` (it is in requirements.txt), or drop tensorboard from trainer.logger")
    for lg, extra in LOGGER_EXTRAS.items():
        if lg in t.logger and not installed(lg):
            e.append(f"trainer.logger=[..., {lg}]: the {lg} package is not installed; `pip install -e .[{extra}]` "
                     f"(an optional extra), or drop {lg} from trainer.logger")


def _simulation(e: list[str], t) -> None:
    """trainer.simulate_*: seconds per row, slots and spread of a run without models."""
    for stage, cost in t.simulate_cost_s_per_row.items():  # stage names: checked against the graph in the plan
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
            e.append(f"trainer.simulate_cost_s_per_row.{stage}={cost!r}: must be seconds per row, a number >= 0 "
                     "(e.g. {actor_rollout: 0.004}); or trainer.simulate_cost_s_per_row={} for real compute")
    if t.simulate_generate_slots < 0:
        e.append(f"trainer.simulate_generate_slots={t.simulate_generate_slots}: must be >= 0 (0: rows one after another)")
    if t.simulate_generate_sigma < 0:
        e.append(f"trainer.simulate_generate_sigma={t.simulate_generate_sigma}: must be >= 0 (0: every row costs the same)")


def _steps(e: list[str], rl) -> None:
    """rl_config: the rows of a step, how far rollout may run ahead, the dock's micro-batch."""
    if rl.n_samples_per_prompt < 1:  # >= 2 for algorithms that compare a prompt's responses: see the plan
        e.append(f"rl_config.n_samples_per_prompt={rl.n_samples_per_prompt}: must be >= 1 (GRPO needs 2 or more: "
                 "set it to 2 or more, 8 is common)")
    _positive(e, "rl_config.prompts_per_step", rl.prompts_per_step)
    _positive(e, "rl_config.max_weight_staleness", rl.max_weight_staleness,
              "0 keeps rollout on-policy; k lets it run k weight versions ahead", allow_zero=True)
    if rl.max_weight_staleness > 0 and rl.blocking:
        e.append(f"rl_config.max_weight_staleness={rl.max_weight_staleness} with rl_config.blocking=true: blocking mode "
                 "runs a step's stages one after another, so no step can run ahead of another; set "
                 "rl_config.blocking=false (or max_weight_staleness=0)")
    if rl.partial_rollout and (not rl.max_weight_staleness or rl.guarantee_order):
        why = ("max_weight_staleness=0: the weights move only between steps, when nothing generates"
               if not rl.max_weight_staleness else
               "guarantee_order=true: the weights move only between rollout steps, so that each row comes "
               "from one known version")
        e.append(f"rl_config.partial_rollout=true with rl_config.{why}; set rl_config.max_weight_staleness >= 1 "
                 "and rl_config.guarantee_order=false (or partial_rollout=false)")
    _positive(e, "rl_config.dock_micro_batch_size", rl.dock_micro_batch_size)


def _batch_sizes(e: list[str], cfg: Config, used) -> None:
    """Micro- and mini-batch sizes of the actor, the reference and generation. Row sizes (*_per_device) only need
    to be > 0: what they must divide they are rounded to (config/sizes.py, printed by the plan); prompt sizes must
    divide the step's prompts."""
    a, rl = cfg.actor_config, cfg.rl_config
    if used("actor"):
        _positive(e, "actor_config.ppo_micro_batch_size_per_device", a.ppo_micro_batch_size_per_device)
        _positive(e, "actor_config.log_prob_micro_batch_size_per_device", a.log_prob_micro_batch_size_per_device)
        _mini_batch(e, "actor_config", a.ppo_mini_batch_size, rl.prompts_per_step)
    if used("ref"):
        _positive(e, "ref_config.log_prob_micro_batch_size_per_device",
                  cfg.ref_config.log_prob_micro_batch_size_per_device)
    _positive(e, "generate_config.micro_batch_size_per_device", cfg.generate_config.micro_batch_size_per_device)


def _generation(e: list[str], g) -> None:
    """generate_config's sampling: length, temperature, top-p, top-k (backend names are checked by the plan
    against the engine registry, engines/registry.py)."""
    _positive(e, "generate_config.max_new_tokens", g.max_new_tokens)
    _positive(e, "generate_config.temperature", g.temperature, "0 means greedy", allow_zero=True)
    if not 0 < g.top_p <= 1:
        e.append(f"generate_config.top_p={g.top_p}: must be in (0, 1]")
    _positive(e, "generate_config.top_k", g.top_k, "0 turns it off", allow_zero=True)


def _weight_sync(e: list[str], ws) -> None:
    """weight_sync: bucket size and how buckets move."""
    _positive(e, "weight_sync.bucket_mb", ws.bucket_mb, "weights move in buckets of this many MiB (512 is usual)")
    _one_of(e, "weight_sync.backend", ws.backend, WEIGHT_SYNC_BACKENDS)


VLLM_SECTION = "generate_config.vllm"   # the options section of the rollout backend that takes max_model_len
SLEEP_LEVELS = (1, 2)                   # vLLM's LLM.sleep levels: 1 keeps the weights on the host, 2 drops them


def _vllm(e: list[str], cfg: Config, read: bool) -> None:
    """generate_config.vllm: its values; when its backend reads it (`read`), a context that holds the longest
    prompt and response."""
    g, v = cfg.generate_config, cfg.generate_config.vllm
    if not 0 < v.gpu_memory_utilization <= 1:
        e.append(f"{VLLM_SECTION}.gpu_memory_utilization={v.gpu_memory_utilization}: must be in (0, 1]")
    if v.kv_cache_gb is not None:
        _positive(e, f"{VLLM_SECTION}.kv_cache_gb", v.kv_cache_gb, "the CPU's KV-cache size in GiB, or null (1.0)")
    _one_of(e, f"{VLLM_SECTION}.sleep_level", v.sleep_level, SLEEP_LEVELS)
    if read and v.enable_sleep_mode and v.sleep_level == 2 and cfg.rl_config.max_weight_staleness:
        e.append(f"{VLLM_SECTION}.sleep_level=2 with rl_config.max_weight_staleness="
                 f"{cfg.rl_config.max_weight_staleness}: level 2 drops the weights while vLLM sleeps and only a sync "
                 "writes them back, but with staleness a rollout may wake before the next sync; use sleep_level=1 "
                 "(weights kept on the host) or max_weight_staleness=0")
    if v.max_model_len is None:
        return
    _positive(e, f"{VLLM_SECTION}.max_model_len", v.max_model_len, "or null for prompt + response lengths")
    prompt = cfg.data.max_prompt_length
    longest = (prompt or 0) + g.max_new_tokens
    if read and prompt and 0 < v.max_model_len < longest:
        e.append(f"{VLLM_SECTION}.max_model_len={v.max_model_len}: below data.max_prompt_length + "
                 f"generate_config.max_new_tokens = {prompt} + {g.max_new_tokens} = {longest}, "
                 "so vLLM would refuse the longest prompt at the first generate; raise it to at least "
                 f"{longest}, or null (prompt + response lengths)")


def _optimizer(e: list[str], a) -> None:
    """actor_config's optimizer: dtype, learning rate, token budget, clipping, AdamW's betas and decay, LoRA."""
    _one_of(e, "actor_config.dtype", a.dtype, DTYPES)
    _positive(e, "actor_config.lr", a.lr)
    if a.max_tokens_per_micro_batch is not None:
        _positive(e, "actor_config.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch,
                  "or null for one forward per micro-batch")
    _positive(e, "actor_config.grad_clip", a.grad_clip)
    _lora(e, a.lora)
    if len(a.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                    for b in a.betas):
        e.append(f"actor_config.betas={a.betas}: AdamW needs two betas, numbers in [0, 1), e.g. [0.9, 0.999]")
    _positive(e, "actor_config.weight_decay", a.weight_decay, allow_zero=True)


def _policy_loss(e: list[str], a) -> None:
    """actor_config's loss: aggregation, KL kind and controller, the clip bounds, the off-policy weight's cap."""
    _one_of(e, "actor_config.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    _one_of(e, "actor_config.kl_loss_type", a.kl_loss_type, KL_KINDS)
    _one_of(e, "actor_config.kl_ctrl", a.kl_ctrl, KL_CONTROLLER_KINDS)
    if a.tis_cap < 1:
        e.append(f"actor_config.tis_cap={a.tis_cap}: must be >= 1 (a fresh on-policy token has weight 1; a cap below "
                 "would shrink or drop it)")
    _positive(e, "actor_config.kl_loss_coef", a.kl_loss_coef, allow_zero=True)
    if a.clip_ratio_c <= 1:
        e.append(f"actor_config.clip_ratio_c={a.clip_ratio_c}: the dual-clip bound must be > 1 (3.0 is usual)")
    if not 0 < a.clip_ratio_low < 1:
        e.append(f"actor_config.clip_ratio_low={a.clip_ratio_low}: must be in (0, 1); the ratio is clipped to "
                 "[1 - low, 1 + high]")
    _positive(e, "actor_config.clip_ratio_high", a.clip_ratio_high, "the ratio is clipped to [1 - low, 1 + high]")
    if a.kl_ctrl == "adaptive":
        _positive(e, "actor_config.kl_target", a.kl_target, "the adaptive controller steers the KL towards it")
        _positive(e, "actor_config.kl_horizon", a.kl_horizon, "the adaptive controller's time constant in rows")


def _critic(e: list[str], c, prompts_per_step: int) -> None:
    """critic_config, when the graph has a critic."""
    _positive(e, "critic_config.lr", c.lr)
    _positive(e, "critic_config.grad_clip", c.grad_clip)
    _positive(e, "critic_config.weight_decay", c.weight_decay, allow_zero=True)
    _positive(e, "critic_config.ppo_micro_batch_size_per_device", c.ppo_micro_batch_size_per_device)
    _positive(e, "critic_config.forward_micro_batch_size_per_device", c.forward_micro_batch_size_per_device)
    _positive(e, "critic_config.cliprange_value", c.cliprange_value)
    _one_of(e, "critic_config.loss_agg_mode", c.loss_agg_mode, AGG_MODES)
    _mini_batch(e, "critic_config", c.ppo_mini_batch_size, prompts_per_step)
    if c.max_tokens_per_micro_batch is not None:
        _positive(e, "critic_config.max_tokens_per_micro_batch", c.max_tokens_per_micro_batch,
                  "or null for one forward per micro-batch")


def _advantage(e: list[str], rl) -> None:
    """rl_config.gamma and lam (GAE) lie in [0, 1]."""
    for key, value in (("rl_config.gamma", rl.gamma), ("rl_config.lam", rl.lam)):
        if not 0 <= value <= 1:
            e.append(f"{key}={value}: must be in [0, 1] (1.0 is verl's default for outcome rewards)")


def _agent(e: list[str], ag) -> None:
    """generate_config.agent, when on: turns, the tools' timeout, the call syntax, the tools and which end a row."""
    if not ag.enable:
        return
    if ag.max_turns < 1:
        e.append(f"generate_config.agent.max_turns={ag.max_turns}: must be >= 1 (generate turns per row)")
    _positive(e, "generate_config.agent.tool_timeout_s", ag.tool_timeout_s,
              "a tool call gets this many seconds before an error result")
    _one_of(e, "generate_config.agent.syntax", ag.syntax, AGENT_SYNTAXES)
    if not isinstance(ag.tools, list) or not ag.tools or not all(isinstance(t, str) and t.strip() for t in ag.tools):
        e.append(f"generate_config.agent.tools={ag.tools!r}: must be a non-empty list of tool names (built-in: "
                 "calc) or dotted paths pkg.module:function")
    else:
        _return_direct(e, ag)


def _overlong(e: list[str], ob, max_new_tokens: int) -> None:
    """rl_config.overlong_buffer: a penalty window inside the response limit."""
    if not 0 <= ob.length <= max_new_tokens:
        e.append(f"rl_config.overlong_buffer.length={ob.length}: must be in [0, generate_config.max_new_tokens="
                 f"{max_new_tokens}] (the last tokens before the limit over which the penalty grows; 0: off)")
    _positive(e, "rl_config.overlong_buffer.penalty_factor", ob.penalty_factor, allow_zero=True)


def _dynamic_sampling(e: list[str], rl) -> None:
    """rl_config.dynamic_sampling needs overlapped, on-policy steps and groups of two or more."""
    if not rl.dynamic_sampling:
        return
    if not rl.max_oversample >= 1:
        e.append(f"rl_config.max_oversample={rl.max_oversample}: must be >= 1 (at most this many times "
                 "rl_config.prompts_per_step prompts are drawn per step; 1 draws none in place of dropped groups)")
    if rl.blocking:
        e.append("rl_config.dynamic_sampling=true with rl_config.blocking=true: the groups dropped after their "
                 "rewards are replaced while the rollout still runs, which needs the overlapped stages; set "
                 "rl_config.blocking=false (or dynamic_sampling=false)")
    if rl.max_weight_staleness:
        e.append(f"rl_config.dynamic_sampling=true with rl_config.max_weight_staleness={rl.max_weight_staleness}: "
                 "the prompts drawn in place of dropped groups would interleave between steps in flight; set "
                 "max_weight_staleness=0 (or dynamic_sampling=false)")
    if rl.n_samples_per_prompt < 2:
        e.append(f"rl_config.dynamic_sampling=true with rl_config.n_samples_per_prompt="
                 f"{rl.n_samples_per_prompt}: a group of one response is always all-equal and would be dropped; "
                 "use 2 or more samples per prompt")


def _data(e: list[str], d) -> None:
    """data: prompt length and the built-in task's sizes."""
    _positive(e, "data.max_prompt_length", d.max_prompt_length)
    _positive(e, "data.num_digits", d.num_digits)
    _positive(e, "data.size", d.size)


def _placement(e: list[str], pl) -> None:
    """placement: mode, Ray's CPUs, nodes and devices, and the keys that go with each mode."""
    _one_of(e, "placement.mode", pl.mode, PLACEMENT_MODES)
    n_cpus = pl.ray_num_cpus
    if n_cpus is not None and (n_cpus < 1 or float(n_cpus) != int(n_cpus)):
        e.append(f"placement.ray_num_cpus={n_cpus}: Ray needs a whole number >= 1 (or null for all cores); "
                 "fractions belong in placement.groups.<name>.num_cpus")
    _positive(e, "placement.n_nodes", pl.n_nodes)
    if pl.device_memory_gb is not None:
        _positive(e, "placement.device_memory_gb", pl.device_memory_gb,
                  "GB of memory of one device (80 for an H100), or null for the device kind's default")
    _positive(e, "placement.n_devices_per_node", pl.n_devices_per_node)
    _one_of(e, "placement.device_kind", pl.device_kind, DEVICE_KINDS)
    _positive(e, "placement.cpus_per_device", pl.cpus_per_device, "0 is fine for gpu/npu devices",
              allow_zero=pl.device_kind != "cpu")
    if pl.mfcs and pl.mode != MESH_MODE:
        e.append(f"placement.mfcs is set but placement.mode={pl.mode!r}; per-MFC meshes need placement.mode=mesh "
                 "(or drop placement.mfcs)")
    if pl.mode == MESH_MODE and pl.groups:
        e.append("placement.groups is set with placement.mode=mesh; in mesh mode the worker groups follow from "
                 "placement.mfcs: drop placement.groups")
    _groups(e, pl.groups)


def _groups(e: list[str], groups: dict) -> None:
    """placement.groups.<name>: replicas, resources, threads and device of each worker group."""
    for name, grp in groups.items():
        k = f"placement.groups.{name}"
        _positive(e, f"{k}.dp", grp.dp)
        for field in RAY_RESOURCES:  # num_cpus, num_gpus, num_npus
            _positive(e, f"{k}.{field}", getattr(grp, field), allow_zero=True)
        _positive(e, f"{k}.torch_threads", grp.torch_threads)
        _one_of(e, f"{k}.device", grp.device, WORKER_DEVICES)
        _cores(e, f"{k}.cpu_affinity", grp.cpu_affinity)


def _cores(e: list[str], key: str, cores) -> None:
    """Core ids a group is bound to: whole numbers this machine lets the trainer run on."""
    if cores is None:
        return
    if (not isinstance(cores, (list, tuple)) or not cores
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cores)):
        e.append(f"{key}={cores!r}: give a non-empty list of core ids such as [0] or [2, 3] (or null: not bound)")
        return
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if allowed is None:
        e.append(f"{key}={list(cores)}: binding to cores needs Linux (os.sched_setaffinity); set it to null")
    elif set(cores) - set(allowed):
        e.append(f"{key}={list(cores)}: cores {sorted(set(cores) - set(allowed))} are not among this machine's "
                 f"{allowed}; choose from those")


def _validation(e: list[str], cfg: Config) -> None:
    """trainer.val_interval, val_before_train, data.val_dataset / val_size and generate_config.val (the set's
    file itself is read by the plan: trainer/validation.py check_validation)."""
    t, v, d = cfg.trainer, cfg.generate_config.val, cfg.data
    _positive(e, "trainer.val_interval", t.val_interval, "0 turns validation off", allow_zero=True)
    on = t.val_interval > 0 or t.val_before_train
    _val_fraction(e, cfg)
    if on and d.val_dataset is None and not d.val_fraction:
        e.append(f"trainer.val_interval={t.val_interval}, val_before_train={t.val_before_train}: validation needs "
                 "data.val_dataset (a .jsonl/.parquet file of prompts and answers, or builtin:<kind> for a built-in "
                 "task's held-out split) or data.val_fraction (a share of data.dataset's prompts); or set "
                 "trainer.val_interval=0 and val_before_train=false")
    if on and cfg.rl_config.algorithm == REWARD_MODELING:
        e.append("trainer.val_interval / val_before_train: reward modeling generates nothing to validate; its "
                 "held-out pairs are data.eval_size and trainer.eval_interval")
    if d.val_dataset is not None and (not isinstance(d.val_dataset, str) or not d.val_dataset.strip()):
        e.append(f"data.val_dataset={d.val_dataset!r}: must be a path or builtin:<kind>, or null for none")
    _positive(e, "data.val_size", d.val_size)
    _positive(e, "generate_config.val.n", v.n, "responses per validation prompt (1: pass@1 only)")
    if v.temperature is not None and not v.temperature >= 0:
        e.append(f"generate_config.val.temperature={v.temperature}: must be >= 0 (0: greedy), or null for "
                 "generate_config.temperature")
    if v.top_p is not None and not 0 < v.top_p <= 1:
        e.append(f"generate_config.val.top_p={v.top_p}: must be in (0, 1], or null for generate_config.top_p")
    if v.top_k is not None and v.top_k < 0:
        e.append(f"generate_config.val.top_k={v.top_k}: must be >= 0 (0: off), or null for generate_config.top_k")
    if v.max_new_tokens is not None:
        _positive(e, "generate_config.val.max_new_tokens", v.max_new_tokens,
                  "or null for generate_config.max_new_tokens")
    if v.pass_threshold is not None and (isinstance(v.pass_threshold, bool) or not isinstance(
            v.pass_threshold, (int, float)) or not math.isfinite(v.pass_threshold)):
        e.append(f"generate_config.val.pass_threshold={v.pass_threshold!r}: must be a number (the reward at which a "
                 "response passes), or null for 1.0 with a rule reward")


def _val_fraction(e: list[str], cfg: Config) -> None:
    """data.val_fraction: a share in [0, 1) of a dataset file's prompts held out as the validation set."""
    d = cfg.data
    f = d.val_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
        e.append(f"data.val_fraction={f!r}: must be in [0, 1) (the share of data.dataset's prompts held out for "
                 "validation; 0: none)")
        return
    if not f:
        return
    if str(d.dataset).startswith("builtin:"):
        e.append(f"data.val_fraction={f}: data.dataset={d.dataset!r} is a built-in task, which holds out one prompt "
                 f"in ten by itself; set data.val_dataset={d.dataset} and data.val_fraction=0")
    elif d.val_dataset is not None:
        e.append(f"data.val_fraction={f} with data.val_dataset={d.val_dataset!r}: two validation sets; set "
                 "data.val_dataset=null to validate on data.dataset's held-out share, or data.val_fraction=0")
    elif cfg.rl_config.algorithm == REWARD_MODELING:
        e.append(f"data.val_fraction={f}: reward modeling holds out data.eval_size pairs instead; set it to 0")


def _lora(e: list[str], lora) -> None:
    """actor_config.lora: a rank > 0 turns adapters on; which backends and modules take them is the plan's
    check (the engine registry and the model's layers)."""
    k = "actor_config.lora"
    _positive(e, f"{k}.rank", lora.rank, "0 turns LoRA off; 8-64 is usual", allow_zero=True)
    if not lora.rank:
        return
    _positive(e, f"{k}.alpha", lora.alpha, "the adapter's output is scaled by alpha / rank (16 or 2 x rank is usual)")
    if not 0 <= lora.dropout < 1:
        e.append(f"{k}.dropout={lora.dropout}: must be in [0, 1)")
    if lora.lr is not None:
        _positive(e, f"{k}.lr", lora.lr, "or null for actor_config.lr")
    if lora.modules_to_save_lr is not None:
        _positive(e, f"{k}.modules_to_save_lr", lora.modules_to_save_lr, "or null for the adapters' lr")
    tm = lora.target_modules
    if not isinstance(tm, list) or not tm or not all(isinstance(t, str) and t.strip() for t in tm):
        e.append(f"{k}.target_modules={tm!r}: must be a non-empty list of module names (e.g. [q_proj, v_proj]) or "
                 "[all-linear]")


def _return_direct(e: list[str], ag) -> None:
    """generate_config.agent.return_direct names tools of generate_config.agent.tools (by the name the
    model calls them: a dotted path's last part)."""
    from ..agent.tools import tool_name
    names = [tool_name(t) for t in ag.tools]
    rd = ag.return_direct
    if not isinstance(rd, list) or not all(isinstance(t, str) for t in rd):
        e.append(f"generate_config.agent.return_direct={rd!r}: must be a list of tool names (or [] for none)")
    elif set(rd) - set(names):
        e.append(f"generate_config.agent.return_direct={rd!r}: {sorted(set(rd) - set(names))} not among the tools "
                 f"{names} (generate_config.agent.tools); name the tools whose result is the final answer, or []")
