"""Train a reward model: `python cli/train_rm.py [--config-name NAME] [key=value ...]`.

Reward modeling is a graph of one train_step MFC over preference pairs (rl_config.algorithm:
reward_modeling), run by the same trainer as RL. Configs live in `configs/` (default: rm_tiny, the
built-in preference pairs of the copy task, on a laptop CPU); the model is saved as a plain Hugging Face
checkpoint in <trainer.output_dir>/final, what `reward_model.model_path` of an RL run reads.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402

from mindspeed_rl.cli_main import refuse_renamed_overrides, train_main  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@hydra.main(config_path=CONFIGS, config_name="rm_tiny", version_base=None)
def main(cfg) -> None:
    train_main(cfg, algorithm="reward_modeling")


if __name__ == "__main__":
    refuse_renamed_overrides(sys.argv[1:])
    main()
