"""What every `cli/train_*.py` entry point does with its Hydra config (they are thin aliases)."""
from __future__ import annotations

import os
import sys


def refuse_renamed_overrides(argv: list[str]) -> None:
    """Exit 2 naming what an old size key became, when the command line sets one.

    Why here: Hydra refuses `actor_config.mini_batch_size=32` as "not in struct" before the loader
    ever sees it, which tells the user nothing about the rename (verl's sizes counted in prompts)."""
    from .config.schema import renamed_key_message

    n = 8
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if eq and key == "rl_config.n_samples_per_prompt" and value.strip().isdigit():
            n = int(value)
    found = []
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq:
            continue
        try:
            parsed = int(value)
        except ValueError:
            parsed = None if value.strip().lower() == "null" else value
        message = renamed_key_message(key, parsed, n)
        if message:
            found.append(message)
    if found:
        print("config error: " + "; ".join(found) + " (see docs/configs.md)", file=sys.stderr)
        sys.exit(2)
    refuse_unknown_keys(argv)


def refuse_unknown_keys(argv: list[str]) -> None:
    """Exit 2 naming an override's unknown key and the keys of its section (`generate_config.val.temprature=0`),
    where Hydra would stop with exit 1 and no list of what the section has. Keys under a mapping field
    (placement.groups.<name>, backend_options) are the loader's to check."""
    import yaml

    from .config import ConfigError, config_from_dict
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key.startswith(("+", "~", "hydra.", "-")) or "." not in key:
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            continue
        tree: dict = {}
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = parsed
        try:
            config_from_dict(tree)
        except ConfigError as e:
            if "unknown key" in str(e):
                print(f"config error: {e}", file=sys.stderr)
                sys.exit(2)
        except Exception:  # a value the loader reads otherwise than Hydra would: Hydra's to judge
            continue


def train_main(raw_cfg, algorithm: str | None = None) -> list[dict]:
    """Build the typed config, fail fast on bad input, run the trainer. A user's mistake (config, output
    directory, checkpoint, cluster size) exits 2 with one line; a failed run exits 1 with one line."""
    from .config import ConfigError, config_from_dict
    from .trainer import Trainer, TrainingError

    import signal

    def stop(signum, frame):  # Ctrl-C while the plan is made (tokenizer, dataset, model checks): nothing ran yet
        print(f"stopped by {signal.Signals(signum).name} during start-up; nothing ran", file=sys.stderr)
        sys.stdout.flush()
        os._exit(128 + signum)  # nothing to clean up yet, and no library's except-clause can swallow it

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cfg = config_from_dict(raw_cfg)
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not cfg.trainer.dry_run:
        print(f"mindspeed_rl: {cfg.rl_config.algorithm} on {cfg.data.dataset}, {cfg.trainer.total_steps} steps, "
              f"{'blocking' if cfg.rl_config.blocking else 'non-blocking'}, placement {cfg.placement.mode}; "
              f"output in {cfg.trainer.output_dir}", file=sys.stderr)
        for note in trainer.plan.size_notes:  # sizes rounded to what they must divide, said once
            print(f"batch size: {note}", file=sys.stderr)
        if trainer.plan.memory is not None:  # the estimate per device (planning/memory.py)
            for line in trainer.plan.memory.lines():
                print(line, file=sys.stderr)
    from .trainer.driver import Interrupted
    try:
        return trainer.run()
    except Interrupted as e:  # SIGINT/SIGTERM: one line (where it got to, how to resume), exit 130/143
        print(e.summary(sys.argv), file=sys.stderr)
        sys.exit(e.exit_code)
    except ConfigError as e:  # found once the run started (the cluster's resources, a checkpoint): still the user's
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        sys.exit(1)
