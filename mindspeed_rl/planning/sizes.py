"""The worker groups' row sizes: a train MFC's optimizer step splits into its group's dp equal shares, since
DDP ranks step together, and a micro-batch that must hold whole prompt groups is rounded to them. A size that
cannot split is refused with the sizes that can; one rounded is said once, in the plan's notes."""
from __future__ import annotations

from ..config import ConfigError, GenerateConfig, PlacementConfig, RLConfig
from ..config.sizes import group_size_note, train_size_note
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from .groups import GroupPlan, dp_key
from .keys import PROMPTS_PER_STEP_KEY, REWARD_SECTION, ROLLOUT_MICRO_BATCH_KEY, SECTION_OF
from .models import ModelSections


def check_sizes(rl: RLConfig, models: ModelSections, generate: GenerateConfig, placement: PlacementConfig,
                groups: dict[str, GroupPlan], order: list[MFCDef], functions: dict) -> list[str]:
    """Every train MFC's optimizer step splits into its group's dp equal shares; returns the notes of the row
    sizes rounded to what they must divide."""
    size_notes: list[str] = []
    for g, p in groups.items():
        for m in p.mfcs:
            if InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP:
                note = _check_train_split(rl, models, placement, g, p.resources.dp, functions[m.name].engine)
                if note and note not in size_notes:
                    size_notes.append(note)
    n = rl.n_samples_per_prompt
    if any(InterfaceType(m.interface_type) is InterfaceType.GENERATE for m in order):
        size_notes.append(group_size_note(ROLLOUT_MICRO_BATCH_KEY,
                                          generate.micro_batch_size_per_device, n,
                                          "a rollout micro-batch holds whole prompt groups"))
    grouped_default = [m.name for m in order if m.get_n_samples and not m.micro_batch_size]
    if grouped_default:
        size_notes.append(group_size_note("rl_config.dock_micro_batch_size", rl.dock_micro_batch_size, n,
                                          f"for {', '.join(grouped_default)}, which takes whole prompt groups"))
    return [s for s in size_notes if s]


def _check_train_split(rl: RLConfig, models: ModelSections, placement: PlacementConfig, g: str, dp: int,
                       engine: str) -> str:
    """One train MFC's optimizer step against its group's dp (DDP ranks step together); its size note."""
    n, rows = rl.n_samples_per_prompt, rl.prompts_per_step * rl.n_samples_per_prompt
    if engine == "reward":   # pairs, not prompt groups
        mini = models.reward.mini_batch_size or rl.prompts_per_step
        if mini % dp:
            raise ConfigError(f"{dp_key(placement, g)}={dp}: {mini} preference pairs per optimizer step "
                              f"({REWARD_SECTION}.mini_batch_size, null: {PROMPTS_PER_STEP_KEY}) must split into "
                              f"{dp} equal shares, since DDP ranks step together")
        return ""
    model = "critic" if engine == "value" else "actor"
    section, a = SECTION_OF[model], getattr(models, model)
    mini_rows = a.ppo_mini_batch_size * n if a.ppo_mini_batch_size else rows
    if mini_rows % dp:
        what = (f"{section}.ppo_mini_batch_size={a.ppo_mini_batch_size} prompts x n_samples_per_prompt={n} "
                f"= {mini_rows} rows" if a.ppo_mini_batch_size else
                f"the step's {rows} rows ({section}.ppo_mini_batch_size=null)")
        fits = [d for d in range(1, rl.prompts_per_step + 1)
                if rl.prompts_per_step % d == 0 and (d * n) % dp == 0]
        divisors = [d for d in range(1, mini_rows + 1) if mini_rows % d == 0]
        fix = (f"set {section}.ppo_mini_batch_size to one of {fits} (prompts), or the dp to one of "
               f"{divisors}" if fits else f"set the dp to one of {divisors}")
        raise ConfigError(f"{dp_key(placement, g)}={dp}: {what} must split into {dp} equal shares, since DDP "
                          f"ranks step together; {fix}")
    return train_size_note(section, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_device,
                           rl.prompts_per_step, n, dp)
