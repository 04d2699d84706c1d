"""The run's inputs beside its models' checkpoints, checked before any worker starts: the policy's tokenizer,
the training data set, the reward function's and the agent's tools' names. A real run opens them here, so a
missing file or key fails in a second, naming the key, the value and the fix, rather than after the workers
have loaded their models."""
from __future__ import annotations

from ..config import ActorConfig, ConfigError, DataConfig, GenerateConfig, RLConfig, TrainerConfig
from ..dataflow import MFCDef
from .keys import path_key

DATASET_KEY = "data.dataset"


def check_tokenizer(actor: ActorConfig, generate: GenerateConfig, data: DataConfig,
                    model_paths: dict[str, str]) -> None:
    """The policy's tokenizer has every stop token and, with data.chat_template, a chat template: refused
    here, before any worker loads a model, rather than by the first generate call."""
    from ..data.loader import check_tokenizer_chat_template
    from ..models import load_tokenizer
    from ..models.checkpoint import stop_token_ids
    from ..trainer.errors import first_line
    path = model_paths.get("actor") or actor.model_path
    key = path_key("actor")
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path!r}: its tokenizer does not load ({first_line(e)})") from None
    try:
        stop_token_ids(tokenizer, generate.stop_tokens)
    except ValueError as e:
        raise ConfigError(f"{e}; {key}={path!r}") from None
    if data.chat_template:
        try:
            check_tokenizer_chat_template(tokenizer)
        except ValueError as e:
            raise ConfigError(f"data.chat_template=true, {key}={path!r}: {e}") from None


def check_names(rl: RLConfig, generate: GenerateConfig, order: list[MFCDef], functions: dict,
                check_files: bool) -> None:
    """The reward function and the agent's tools the config names exist (a real run imports their modules)."""
    try:
        from ..rewards import check_reward_name
        if rl.reward_fn and any(functions[m.name].name == "rule_reward" for m in order):
            check_reward_name(rl.reward_fn, import_module=check_files)
    except ValueError as e:
        raise ConfigError(f"rl_config.reward_fn: {e}") from None
    if generate.agent.enable:
        from ..agent.tools import check_tools
        try:
            check_tools(generate.agent.tools, import_module=check_files)
        except ValueError as e:
            raise ConfigError(f"generate_config.agent.tools: {e}") from None


def check_dataset(data: DataConfig, rl: RLConfig, trainer: TrainerConfig) -> None:
    """data.dataset opens and every row holds the keys the run reads (reward modeling: its preference pairs)."""
    from pathlib import Path
    spec = data.dataset
    if rl.algorithm == "reward_modeling":   # preference pairs, read whole now (names file, line, key)
        from ..data.preferences import load_preference_dataset, split_held_out
        d = data
        try:
            split_held_out(load_preference_dataset(spec, d.prompt_key, d.chosen_key, d.rejected_key, d.num_digits,
                                                   d.size, trainer.seed), d.eval_size, trainer.seed)
        except ValueError as e:
            raise ConfigError(f"{DATASET_KEY}={spec!r}: {e}") from None
        return
    from ..data.prompts import BUILTIN_PREFIX
    if spec.startswith(BUILTIN_PREFIX):
        from ..data.synthetic import KINDS
        if spec[len(BUILTIN_PREFIX):] not in KINDS:
            raise ConfigError(f"{DATASET_KEY}={spec!r}: unknown built-in task; built-in tasks are "
                              f"{['builtin:' + k for k in KINDS]}")
        return
    from ..data.prompts import SUFFIXES
    if not Path(spec).expanduser().is_file():
        raise ConfigError(f"{DATASET_KEY}={spec!r}: no such file; give a {'/'.join(SUFFIXES)} path (see "
                          "cli/preprocess_data.py) or a built-in task such as builtin:copy")
    if Path(spec).suffix not in SUFFIXES:
        raise ConfigError(f"{DATASET_KEY}={spec!r}: unsupported file type {Path(spec).suffix!r}; give a "
                          f"{'/'.join(SUFFIXES)} file (see cli/preprocess_data.py) or a built-in task such as "
                          "builtin:copy")
    from ..data.prompts import check_prompt_file
    try:  # every row, now: the trainer reads the file only after the workers have loaded their models
        check_prompt_file(spec, data.prompt_key, data.answer_key, setting_prefix="data.")
    except (ValueError, ImportError) as e:
        raise ConfigError(f"{DATASET_KEY}={spec!r}: {e}") from None
