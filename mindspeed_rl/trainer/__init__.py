"""The driver: builds the plan, the dock and the workers from the config, and runs the steps."""
from .driver import Trainer, TrainingError

__all__ = ["Trainer", "TrainingError"]
