"""The plan's second stage: the registry's rows of the rollout and train backends a config chooses, resolved once
(engines/registry.py). The later stages ask these rows what they can run (a split, a feature, a model) rather
than comparing a backend's name, so a plugin's backend is planned as a built-in one is."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

from ..config import ActorConfig, ConfigError, GenerateConfig, TrainerConfig
from ..engines.registry import Backend
from .keys import ROLLOUT_BACKEND_KEY, TRAIN_BACKEND_KEY


@dataclass(frozen=True)
class Backends:
    """The backend stage's result: the chosen rows, and how a row's options are read from its own section."""
    rollout: Backend
    train: Backend
    options_of: Callable[[Backend], dict] = field(repr=False)   # registry.backend_options of the run's config


def choose_backends(generate: GenerateConfig, actor: ActorConfig, trainer: TrainerConfig,
                    options_of: Callable[[Backend], dict]) -> Backends:
    """The registry's rows of the rollout and train backends a config runs; refuses a name the registry lacks."""
    from ..engines import registry
    for key, table, name in ((ROLLOUT_BACKEND_KEY, registry.ROLLOUT_BACKENDS, generate.backend),
                             (TRAIN_BACKEND_KEY, registry.TRAIN_BACKENDS, actor.backend)):
        if name not in registry.user_backends(table):
            raise ConfigError(f"{key}={name!r}: must be one of {registry.user_backends(table)} (docs/engines.md)")
    # the three sections the registry's choice reads (the simulate backend when simulate_cost_s_per_row is set)
    rollout, train = registry.chosen_backends(SimpleNamespace(trainer=trainer, generate_config=generate,
                                                              actor_config=actor))
    return Backends(registry.ROLLOUT_BACKENDS[rollout], registry.TRAIN_BACKENDS[train], options_of)


def check_installed(rollout: Backend, train: Backend) -> None:
    """A real run: each backend's package imports here, else its install command, before any worker starts."""
    from ..config.checks import installed
    for key, backend in ((ROLLOUT_BACKEND_KEY, rollout), (TRAIN_BACKEND_KEY, train)):
        if backend.needs and not installed(backend.needs):
            raise ConfigError(f"{key}={backend.name}: the {backend.needs} package is not installed here; "
                              f"{backend.install}")

