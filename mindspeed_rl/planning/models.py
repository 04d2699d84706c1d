"""The models a graph runs and the config sections that describe them: the actor's, the reference's, the
critic's and the reward model's. The stages that size, place or check a model read these four sections and no
other; the reference and the critic start from the actor's checkpoint unless their section names their own."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ActorConfig, ConfigError, CriticConfig, RefConfig
from ..config.schema import RewardModelConfig
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from .keys import SECTION_OF, path_key


@dataclass(frozen=True)
class ModelSections:
    """The models' own config sections."""
    actor: ActorConfig
    ref: RefConfig
    critic: CriticConfig
    reward: RewardModelConfig

    def path(self, model: str) -> str | None:
        """The checkpoint a model loads: its section's model_path, the actor's for a reference or critic without
        one (None for a model other than the actor, the reference and the critic)."""
        a = self.actor.model_path
        return {"actor": a, "ref": self.ref.model_path or a, "critic": self.critic.model_path or a}.get(model)


def model_paths_of(models: ModelSections, order: list[MFCDef]) -> dict[str, str]:
    """Each model the graph runs -> its path (ref and critic default to the actor's); an MFC whose model has
    none is refused."""
    used = {m.model_name for m in order}
    model_paths = {role: models.path(role) for role in SECTION_OF if role in used or role == "actor"}
    if any(m.model_name == "reward" and InterfaceType(m.interface_type) is not InterfaceType.COMPUTE for m in order):
        model_paths["reward"] = models.reward.model_path or ""   # check_config refused an empty one
    for m in order:
        if InterfaceType(m.interface_type) is not InterfaceType.COMPUTE and m.model_name not in model_paths:
            raise ConfigError(f"MFC {m.name!r} runs model {m.model_name!r}, which has no model_path in the config "
                              f"(known: {sorted(model_paths)})")
    return model_paths


def check_model_paths(models: ModelSections, order: list[MFCDef], model_paths: dict[str, str],
                      trained: dict[str, str]) -> None:
    """A real run: every model path the graph uses opens (a reward model is a one-label classifier)."""
    from ..models import check_model_path
    used = {m.model_name for m in order}
    try:
        check_model_path(path_key("actor"), models.actor.model_path)
        if models.ref.model_path and "ref" in used:
            check_model_path(path_key("ref"), models.ref.model_path)
        if models.critic.model_path and "critic" in used:
            check_model_path(path_key("critic"), models.critic.model_path)
        if "reward" in model_paths:   # a one-label classifier (reward modeling may start from a causal LM)
            from ..models.reward import check_reward_model
            check_reward_model(path_key("reward"), model_paths["reward"], trainable_from_lm="reward" in trained)
    except ValueError as e:
        raise ConfigError(str(e)) from None
