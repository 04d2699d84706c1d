"""The plan's checks of sizes, model paths, data and names: each refuses a config before any worker starts,
naming the key, the value and the fix, or returns the note that says what was rounded."""
from __future__ import annotations

from ..config import Config, ConfigError
from ..config.sizes import group_size_note, train_size_note
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from ..models.checkpoint import read_config
from .errors import first_line
from .plan_types import MODEL_ENGINES, GroupPlan, Plan


def check_stages(cfg: Config, order: list[MFCDef]) -> dict:
    """Each MFC's compute function (workers/compute.py), checked against its declaration; the prompt groups a
    grouped algorithm compares; the stages trainer.simulate_cost_s_per_row names. Returns MFC -> function."""
    rl = cfg.rl_config
    from ..workers.compute import check_mfc
    functions = {}
    for m in order:
        try:
            functions[m.name] = check_mfc(m)
        except ValueError as e:
            raise ConfigError(f"rl_config.algorithm={rl.algorithm!r}: {e}") from None
    grouped = [m.name for m in order if m.get_n_samples]
    if grouped and rl.n_samples_per_prompt < 2:
        raise ConfigError(f"rl_config.n_samples_per_prompt={rl.n_samples_per_prompt}: {rl.algorithm} compares the "
                          f"responses within a prompt's group (MFCs {grouped}), so it needs at least 2; set it to 2 "
                          "or more (8 is common)")
    names = [m.name for m in order]
    for stage, cost in cfg.trainer.simulate_cost_s_per_row.items():
        if stage not in names:
            raise ConfigError(f"trainer.simulate_cost_s_per_row.{stage}={cost!r}: no stage {stage!r} in the "
                              f"{rl.algorithm} graph; give seconds per row for stages among {names} "
                              "(a stage left out costs 0)")
    return functions


def dp_key(cfg: Config, group: str) -> str:
    """The key that sets a worker group's dp: its placement.groups entry, or (mode mesh) its MFCs' meshes."""
    return "placement.mfcs (dp)" if cfg.placement.mode == "mesh" else f"placement.groups.{group}.dp"


def check_sizes(cfg: Config, groups: dict[str, GroupPlan], order: list[MFCDef], functions: dict) -> list[str]:
    """Every train MFC's optimizer step splits into its group's dp equal shares; returns the notes of the row
    sizes rounded to what they must divide."""
    size_notes: list[str] = []
    for g, p in groups.items():
        for m in p.mfcs:
            if InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP:
                note = _check_train_split(cfg, g, p.resources.dp, functions[m.name].engine)
                if note and note not in size_notes:
                    size_notes.append(note)
    n = cfg.rl_config.n_samples_per_prompt
    if any(InterfaceType(m.interface_type) is InterfaceType.GENERATE for m in order):
        size_notes.append(group_size_note("generate_config.micro_batch_size_per_device",
                                          cfg.generate_config.micro_batch_size_per_device, n,
                                          "a rollout micro-batch holds whole prompt groups"))
    grouped_default = [m.name for m in order if m.get_n_samples and not m.micro_batch_size]
    if grouped_default:
        size_notes.append(group_size_note("rl_config.dock_micro_batch_size", cfg.rl_config.dock_micro_batch_size, n,
                                          f"for {', '.join(grouped_default)}, which takes whole prompt groups"))
    return [s for s in size_notes if s]


def _check_train_split(cfg: Config, g: str, dp: int, engine: str) -> str:
    """One train MFC's optimizer step against its group's dp (DDP ranks step together); its size note."""
    rl = cfg.rl_config
    n, rows = rl.n_samples_per_prompt, rl.prompts_per_step * rl.n_samples_per_prompt
    if engine == "reward":   # pairs, not prompt groups
        mini = cfg.reward_model.mini_batch_size or rl.prompts_per_step
        if mini % dp:
            raise ConfigError(f"{dp_key(cfg, g)}={dp}: {mini} preference pairs per optimizer step "
                              f"(reward_model.mini_batch_size, null: rl_config.prompts_per_step) must split into "
                              f"{dp} equal shares, since DDP ranks step together")
        return ""
    section = "critic_config" if engine == "value" else "actor_config"
    a = getattr(cfg, section)
    mini_rows = a.ppo_mini_batch_size * n if a.ppo_mini_batch_size else rows
    if mini_rows % dp:
        what = (f"{section}.ppo_mini_batch_size={a.ppo_mini_batch_size} prompts x n_samples_per_prompt={n} "
                f"= {mini_rows} rows" if a.ppo_mini_batch_size else
                f"the step's {rows} rows ({section}.ppo_mini_batch_size=null)")
        fits = [d for d in range(1, rl.prompts_per_step + 1)
                if rl.prompts_per_step % d == 0 and (d * n) % dp == 0]
        divisors = [d for d in range(1, mini_rows + 1) if mini_rows % d == 0]
        fix = (f"set {section}.ppo_mini_batch_size to one of {fits} (prompts), or the dp to one of "
               f"{divisors}" if fits else f"set the dp to one of {divisors}")
        raise ConfigError(f"{dp_key(cfg, g)}={dp}: {what} must split into {dp} equal shares, since DDP "
                          f"ranks step together; {fix}")
    return train_size_note(section, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_device,
                           rl.prompts_per_step, n, dp)


def model_paths_of(cfg: Config, order: list[MFCDef]) -> dict[str, str]:
    """Each model the graph runs -> its path (ref and critic default to the actor's); an MFC whose model has
    none is refused."""
    used = {m.model_name for m in order}
    model_paths = {role: path for role, path in (
        ("actor", cfg.actor_config.model_path),
        ("ref", cfg.ref_config.model_path or cfg.actor_config.model_path),
        ("critic", cfg.critic_config.model_path or cfg.actor_config.model_path)) if role in used or role == "actor"}
    if any(m.model_name == "reward" and InterfaceType(m.interface_type) is not InterfaceType.COMPUTE for m in order):
        model_paths["reward"] = cfg.reward_model.model_path or ""   # check_config refused an empty one
    for m in order:
        if InterfaceType(m.interface_type) is not InterfaceType.COMPUTE and m.model_name not in model_paths:
            raise ConfigError(f"MFC {m.name!r} runs model {m.model_name!r}, which has no model_path in the config "
                              f"(known: {sorted(model_paths)})")
    return model_paths


def check_model_paths(cfg: Config, order: list[MFCDef], model_paths: dict[str, str], trained: dict[str, str]) -> None:
    """A real run: every model path the graph uses opens (a reward model is a one-label classifier)."""
    from ..models import check_model_path
    used = {m.model_name for m in order}
    try:
        check_model_path("actor_config.model_path", cfg.actor_config.model_path)
        if cfg.ref_config.model_path and "ref" in used:
            check_model_path("ref_config.model_path", cfg.ref_config.model_path)
        if cfg.critic_config.model_path and "critic" in used:
            check_model_path("critic_config.model_path", cfg.critic_config.model_path)
        if "reward" in model_paths:   # a one-label classifier (reward modeling may start from a causal LM)
            from ..models.reward import check_reward_model
            check_reward_model("reward_model.model_path", model_paths["reward"],
                               trainable_from_lm="reward" in trained)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_tokenizer(cfg: Config, model_paths: dict[str, str]) -> None:
    """The policy's tokenizer has every stop token and, with data.chat_template, a chat template: refused
    here, before any worker loads a model, rather than by the first generate call."""
    from ..data.loader import check_tokenizer_chat_template
    from ..models import load_tokenizer
    from ..models.checkpoint import stop_token_ids
    path = model_paths.get("actor") or cfg.actor_config.model_path
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"actor_config.model_path={path!r}: its tokenizer does not load ({first_line(e)})") from None
    try:
        stop_token_ids(tokenizer, cfg.generate_config.stop_tokens)
    except ValueError as e:
        raise ConfigError(f"{e}; actor_config.model_path={path!r}") from None
    if cfg.data.chat_template:
        try:
            check_tokenizer_chat_template(tokenizer)
        except ValueError as e:
            raise ConfigError(f"data.chat_template=true, actor_config.model_path={path!r}: {e}") from None


def check_names(cfg: Config, order: list[MFCDef], functions: dict, check_files: bool) -> None:
    """The reward function and the agent's tools the config names exist (a real run imports their modules)."""
    rl = cfg.rl_config
    try:
        from ..rewards import check_reward_name
        if rl.reward_fn and any(functions[m.name].name == "rule_reward" for m in order):
            check_reward_name(rl.reward_fn, import_module=check_files)
    except ValueError as e:
        raise ConfigError(f"rl_config.reward_fn: {e}") from None
    if cfg.generate_config.agent.enable:
        from ..agent.tools import check_tools
        try:
            check_tools(cfg.generate_config.agent.tools, import_module=check_files)
        except ValueError as e:
            raise ConfigError(f"generate_config.agent.tools: {e}") from None


def check_lora_targets(cfg: Config, model_paths: dict[str, str], trained) -> None:
    """actor_config.lora.target_modules against the policy's linear layers and lora.modules_to_save against its
    modules, before any worker starts, when its config.json is readable here (the model is built on the meta
    device: no weights read)."""
    lora = cfg.actor_config.lora
    if not lora.rank or "actor" not in trained or cfg.trainer.simulate_cost_s_per_row:
        return
    config = read_config(model_paths.get("actor", cfg.actor_config.model_path))
    if config is None:
        return
    from ..engines.train.lora import check_target_modules_of_config
    try:
        check_target_modules_of_config(config, lora.target_modules, lora.modules_to_save)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_dynamic_sampling_groups(cfg: Config, groups: dict, model_kinds: dict) -> None:
    """Dynamic sampling with a model run collectively over several ranks is refused: a step the cap ends
    short of prompts_per_step kept groups has fewer rows than the ranks' equal shares, so one rank would
    make a collective call (a gradient all-reduce, a sharded forward) that another never makes."""
    for g, p in groups.items():
        models = [m.name for m in p.mfcs if model_kinds[m.name] in MODEL_ENGINES
                  and InterfaceType(m.interface_type) in (InterfaceType.INFERENCE, InterfaceType.TRAIN_STEP)]
        if models and (p.resources.dp > 1 or p.tp > 1 or p.pp > 1):
            raise ConfigError(
                f"rl_config.dynamic_sampling=true with worker group '{g}' ({models}) at dp={p.resources.dp} "
                f"tp={p.tp} pp={p.pp}: a step that ends short of rl_config.prompts_per_step kept groups "
                "(rl_config.max_oversample reached) gives its ranks unequal rows, and their collective steps would "
                "wait on each other; run that group on one rank (dp=tp=pp=1) or set rl_config.dynamic_sampling=false")


def check_dataset(cfg: Config) -> None:
    """data.dataset opens and every row holds the keys the run reads (reward modeling: its preference pairs)."""
    from pathlib import Path
    spec = cfg.data.dataset
    if cfg.rl_config.algorithm == "reward_modeling":   # preference pairs, read whole now (names file, line, key)
        from ..data.preferences import load_preference_dataset, split_held_out
        d = cfg.data
        try:
            split_held_out(load_preference_dataset(spec, d.prompt_key, d.chosen_key, d.rejected_key, d.num_digits,
                                                   d.size, cfg.trainer.seed), d.eval_size, cfg.trainer.seed)
        except ValueError as e:
            raise ConfigError(f"data.dataset={spec!r}: {e}") from None
        return
    from ..data.prompts import BUILTIN_PREFIX
    if spec.startswith(BUILTIN_PREFIX):
        from ..data.synthetic import KINDS
        if spec[len(BUILTIN_PREFIX):] not in KINDS:
            raise ConfigError(f"data.dataset={spec!r}: unknown built-in task; built-in tasks are "
                              f"{['builtin:' + k for k in KINDS]}")
        return
    from ..data.prompts import SUFFIXES
    if not Path(spec).expanduser().is_file():
        raise ConfigError(f"data.dataset={spec!r}: no such file; give a {'/'.join(SUFFIXES)} path (see "
                          "cli/preprocess_data.py) or a built-in task such as builtin:copy")
    if Path(spec).suffix not in SUFFIXES:
        raise ConfigError(f"data.dataset={spec!r}: unsupported file type {Path(spec).suffix!r}; give a "
                          f"{'/'.join(SUFFIXES)} file (see cli/preprocess_data.py) or a built-in task such as "
                          "builtin:copy")
    from ..data.prompts import check_prompt_file
    try:  # every row, now: the trainer reads the file only after the workers have loaded their models
        check_prompt_file(spec, cfg.data.prompt_key, cfg.data.answer_key, setting_prefix="data.")
    except (ValueError, ImportError) as e:
        raise ConfigError(f"data.dataset={spec!r}: {e}") from None


def check_collective_devices(groups: dict[str, GroupPlan]) -> None:
    """Refuse a group whose ranks share torch's process group over NCCL or HCCL and could land two on one
    device: NCCL refuses two ranks of a communicator on one GPU (and HCCL one NPU) when the group first
    talks. Outside mode mesh Ray places each actor by its share of a device, so a share below one may pack two
    ranks onto one device; in mode mesh each rank's devices are its own by construction, checked here too."""
    from ..device import accelerator_share
    for g, p in groups.items():
        if p.deployment is None or not p.deployment.joins_default_process_group or p.world < 2:
            continue
        share = accelerator_share(p.resources)
        if p.devices:
            held = [set(p.actor_devices(k)) for k in range(p.world)]
            shared = sorted({d for a in range(len(held)) for b in range(a) for d in held[a] & held[b]})
            if shared and share:
                raise ConfigError(f"placement.mfcs: group '{g}' puts two of its ranks on device(s) {shared}; its "
                                  "collectives (NCCL/HCCL) need one device per rank: give its MFCs as many devices "
                                  "as dp * tp * pp")
        elif 0 < share < 1:
            field_ = "num_gpus" if p.resources.num_gpus else "num_npus"
            raise ConfigError(f"placement.groups.{g}.{field_}={share:g} with {p.world} ranks in one process group: "
                              f"Ray may place two of them on one device, which NCCL/HCCL refuse; give each rank a "
                              f"whole device ({field_}: 1), or place the MFCs by mesh (placement.mode=mesh)")


def check_cluster(plan: Plan, available: dict[str, float]) -> None:
    """Fail fast, naming the groups and the numbers, when the plan does not fit the Ray cluster."""
    from ..device import RAY_RESOURCES
    need = plan.resource_totals()
    for res, amount in need.items():
        have = float(available.get(res, 0.0))
        if amount > have + 1e-9:
            field_ = {r_: f_ for f_, r_ in RAY_RESOURCES.items()}[res]
            detail = ", ".join(f"{g}: {getattr(p.resources, field_)} x "
                               + (f"dp {p.resources.dp}" if p.tp * p.pp == 1 else
                                  f"{p.resources.dp * p.tp * p.pp} ranks (dp*tp*pp {p.resources.dp}*{p.tp}*{p.pp})")
                               for g, p in plan.groups.items()
                               if getattr(p.resources, field_) > 0)
            more = ("give Ray more (placement.ray_num_cpus)" if res == "CPU" else
                    f"add {res}s or nodes to the Ray cluster")
            raise ConfigError(f"placement needs {amount:g} {res} ({detail}) but the Ray cluster has {have:g}; "
                              f"lower placement.groups.<name>.{field_} (fractions are fine), or {more}")
