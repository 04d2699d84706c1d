"""No config number may be nan, inf or -inf: every float key of the schema is tried with each, the
way the CLI loads it (a Hydra override, then `config_from_dict`). The keys come from the dataclasses,
so a float key added later is covered without touching this file."""
from __future__ import annotations

import dataclasses
import typing

import pytest
from hydra import compose, initialize_config_dir

from mindspeed_rl.config import Config, ConfigError, GroupConfig, config_from_dict

from .helpers import REPO
from .test_cli import run_cli

NON_FINITE = ("nan", "inf", "-inf")


def _is_float(tp) -> bool:
    """float or Optional[float]."""
    if tp is float:
        return True
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return typing.get_origin(tp) is typing.Union and args == [float]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def float_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, default) of every float field, and of every list field whose default holds floats
    (actor_config.betas), in every section; a placement group's fields under placement.groups.g."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            keys += float_keys(tp, key + ".")
        elif _is_float(tp):
            keys.append((key, _default(f)))
        elif isinstance(_default(f), list) and any(isinstance(x, float) for x in _default(f)):
            keys.append((key, _default(f)))
    if cls is Config:
        keys += float_keys(GroupConfig, "placement.groups.g.")
    return keys


FLOAT_KEYS = float_keys()


def override(key: str, default, value: str) -> str:
    """The command-line override putting `value` in `key` (a list key: in place of its last float)."""
    if isinstance(default, list):
        items = [str(x) for x in default]
        last = max(i for i, x in enumerate(default) if isinstance(x, float))
        items[last] = value
        return f"++{key}=[{','.join(items)}]"
    return f"++{key}={value}"


def load_like_the_cli(*overrides: str):
    """What `cli/train_grpo.py` does with its arguments before the trainer: compose, then load."""
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return config_from_dict(compose(config_name="grpo_tiny", overrides=list(overrides)))


def test_the_schema_has_the_float_keys_this_file_relies_on():
    """Guards the enumeration itself: if it found nothing, every parametrized case would vanish."""
    keys = dict(FLOAT_KEYS)
    for key in ("trainer.stage_timeout_s", "actor_config.lr", "actor_config.betas", "generate_config.top_p",
                "placement.ray_num_cpus", "placement.groups.g.num_cpus", "placement.groups.g.num_gpus"):
        assert key in keys, sorted(keys)


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("key,default", FLOAT_KEYS, ids=[k for k, _ in FLOAT_KEYS])
def test_non_finite_float_is_refused_naming_the_key(key, default, value):
    with pytest.raises(ConfigError) as err:
        load_like_the_cli(override(key, default, value))
    msg = str(err.value)
    where = f"{key}[{len(default) - 1}]" if isinstance(default, list) else key
    assert msg.startswith(f"{where}={value}: must be a finite number"), msg
    assert "give a finite number" in msg


def test_finite_values_still_load():
    cfg = load_like_the_cli("trainer.stage_timeout_s=1e300", "actor_config.betas=[0.0,0.5]",
                            "++placement.groups.g.num_cpus=0.25")
    assert cfg.trainer.stage_timeout_s == 1e300 and cfg.actor_config.betas == [0.0, 0.5]
    assert cfg.placement.groups["g"].num_cpus == 0.25


@pytest.mark.parametrize("value", NON_FINITE)
def test_non_finite_in_an_untyped_mapping_is_refused(value):
    """Values of mapping keys (seconds per stage) are numbers too, whatever the schema's annotation."""
    with pytest.raises(ConfigError, match=rf"^trainer\.simulate_cost_s_per_row\.actor_rollout={value}: "
                                          "must be a finite number"):
        load_like_the_cli(f"++trainer.simulate_cost_s_per_row.actor_rollout={value}")


def test_default_in_the_message_is_the_fix():
    with pytest.raises(ConfigError) as err:
        load_like_the_cli("actor_config.lr=nan")
    assert "(the default: actor_config.lr=0.001)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_like_the_cli("placement.ray_num_cpus=inf")
    assert "(the default: placement.ray_num_cpus=null)" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("override_, named", [("trainer.stage_timeout_s=inf", "trainer.stage_timeout_s=inf"),
                                              ("actor_config.lr=nan", "actor_config.lr=nan")])
def test_cli_refuses_non_finite_before_ray(tmp_path, override_, named):
    """The two cases of the issue, through the real CLI: exit 2 with `config error:`, no Ray, no traceback."""
    proc, _ = run_cli(tmp_path, override_)
    assert proc.returncode == 2, proc.stderr
    assert f"config error: {named}: must be a finite number" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # Ray never started, so no worker loaded a model (a time bound would be flaky on a loaded machine)
    assert "[ray-probe] initialized=False" in proc.stderr, proc.stderr
