"""Typed config sections, strict loading from YAML/Hydra, and validation with clear errors."""
from .load import ConfigError, config_from_dict, config_to_dict
from .schema import (ActorConfig, Config, CriticConfig, DataConfig, GenerateConfig, GroupConfig, PlacementConfig, RefConfig,
                     RLConfig, TrainerConfig)
from .checks import check_config

__all__ = ["ActorConfig", "Config", "ConfigError", "CriticConfig", "DataConfig", "GenerateConfig", "GroupConfig", "PlacementConfig",
           "RLConfig", "RefConfig", "TrainerConfig", "config_from_dict", "config_to_dict", "check_config"]
