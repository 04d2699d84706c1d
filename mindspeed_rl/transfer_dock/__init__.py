"""The TransferDock: one broker for a step's experience, shared by every stage.

`TransferDock` is a plain thread-safe class; `create_transfer_dock` starts it as a Ray actor and
returns a `TransferDockClient` with the same methods for workers in other processes.
"""
from .dock import TransferDock
from .errors import (DockError, DockIndexError, DockKeyError, DockTimeoutError, DockValueError,
                     MissingDataError)
from .grpo import GRPO_COLUMNS, GRPO_CONSUMERS, GRPOTransferDock
from .samplers import AnyReadySampler, LengthBalancedSampler, OrderedSampler, Sampler

__all__ = [
    "TransferDock", "GRPOTransferDock", "GRPO_COLUMNS", "GRPO_CONSUMERS",
    "Sampler", "AnyReadySampler", "OrderedSampler", "LengthBalancedSampler",
    "DockError", "DockValueError", "DockKeyError", "DockIndexError", "DockTimeoutError", "MissingDataError",
    "TransferDockClient", "create_transfer_dock",
]


def __getattr__(name):  # Ray is imported only by code that uses the actor
    if name in ("TransferDockClient", "create_transfer_dock"):
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module 'mindspeed_rl.transfer_dock' has no attribute '{name}'")
