"""Score a model on a validation set: `python cli/evaluate.py model_path=<hf dir> data.val_dataset=... [out=<dir>]`.

Any Hugging Face checkpoint directory (a run's `<output_dir>/hf/final` included) is sampled on the run's
rollout backend (`generate_config.backend`: hf or vllm) with `generate_config.val`'s sampling and scored with
the run's reward (`rl_config.reward_fn`, a reward model when the config has one). It is the trainer's own
validation stage (trainer/validation.py) with no training step: the config's workers start, validate the
weights they loaded once, and stop. Prints the `val/*` metrics and writes them, with what was evaluated, to
`<out>/evaluation.json` (out: outputs/evaluate by default).

The config is Hydra's, as for cli/train_grpo.py: `--config-name NAME` (default grpo_tiny) and `key=value`
overrides. `model_path=` sets actor_config.model_path (default: the config's). A bad input (a missing or
empty validation set, a wrong key, an unknown generate_config.val key) exits 2 with one line before Ray starts.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
OWN_ARGS = ("model_path", "out")   # this command's own words, not config keys
DEFAULT_OUT = "outputs/evaluate"
RESULT_FILE = "evaluation.json"


def own_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(`model_path`/`out` given on the command line, the rest for Hydra)."""
    own, rest = {}, []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in OWN_ARGS:
            own[key] = value
        else:
            rest.append(arg)
    return own, rest


def evaluate(raw_cfg, model_path: str | None, out: str) -> dict:
    """The config with the run's training turned off and one validation of the loaded weights; the result."""
    from omegaconf import OmegaConf

    from mindspeed_rl.config import ConfigError, config_from_dict
    from mindspeed_rl.trainer import Trainer, TrainingError
    from mindspeed_rl.trainer.driver import Interrupted

    raw = OmegaConf.to_container(raw_cfg, resolve=True)
    if model_path:
        raw.setdefault("actor_config", {})["model_path"] = model_path
    raw.setdefault("trainer", {}).update(
        total_steps=0, val_before_train=True, output_dir=out, resume=False, save_interval=0, save_hf="never",
        dashboard=False, report=False, progress=False, plot=False,
        logger=[x for x in raw.get("trainer", {}).get("logger", ["console"]) if x == "console"])
    try:
        cfg = config_from_dict(raw)
        if cfg.data.val_dataset is None:
            raise ConfigError("data.val_dataset is null: give the prompts to evaluate on (a .jsonl/.parquet file, or "
                              "builtin:<kind> for a built-in task's held-out split)")
        trainer = Trainer(cfg)
        trainer.run()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        print(e.summary(sys.argv), file=sys.stderr)
        sys.exit(e.exit_code)
    except TrainingError as e:
        print(f"evaluation stopped: {e}", file=sys.stderr)
        sys.exit(1)
    metrics = trainer.validation.results[-1]
    v = cfg.generate_config.val
    result = {"model_path": cfg.actor_config.model_path, "val_dataset": cfg.data.val_dataset,
              "rollout_backend": cfg.generate_config.backend, "reward_fn": cfg.rl_config.reward_fn,
              "generate_config.val": {"temperature": v.temperature, "top_p": v.top_p, "top_k": v.top_k, "n": v.n,
                                      "max_new_tokens": v.max_new_tokens},
              "seed": cfg.trainer.seed, "metrics": metrics}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, RESULT_FILE), "w") as f:
        json.dump(result, f, indent=2)
    return result


def main() -> None:
    own, rest = own_args(sys.argv[1:])
    sys.argv[1:] = rest
    from mindspeed_rl.cli_main import refuse_renamed_overrides
    refuse_renamed_overrides(rest)

    @hydra.main(config_path=CONFIGS, config_name="grpo_tiny", version_base=None)
    def run(cfg) -> None:
        out = own.get("out") or DEFAULT_OUT
        result = evaluate(cfg, own.get("model_path"), out)
        print(json.dumps(result["metrics"], indent=2, sort_keys=True))
        print(f"evaluation: {os.path.join(out, RESULT_FILE)}", file=sys.stderr)

    run()


if __name__ == "__main__":
    main()
