"""Train a policy with REMAX: `python cli/train_remax.py [--config-name NAME] [key=value ...]`.

Configs live in `configs/` (default: remax_tiny, the built-in tiny task that runs on a laptop CPU).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402

from mindspeed_rl.cli_main import refuse_renamed_overrides, train_main  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@hydra.main(config_path=CONFIGS, config_name="remax_tiny", version_base=None)
def main(cfg) -> None:
    train_main(cfg, algorithm="remax")


if __name__ == "__main__":
    refuse_renamed_overrides(sys.argv[1:])
    main()
