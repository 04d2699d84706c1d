"""The driver: builds the plan, the dock and the workers from the config, and runs the steps."""
from .driver import Trainer, TrainingError
from .plan import Plan, format_plan, make_plan

__all__ = ["Plan", "Trainer", "TrainingError", "format_plan", "make_plan"]
