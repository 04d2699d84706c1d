"""docs/configs.md and the schema cannot drift: every field has a row with its type and default,
no row documents a key that does not exist, and the documented names and messages are real."""
from __future__ import annotations

import dataclasses
import re
import typing

import pytest
import yaml

from mindspeed_rl.config import (ActorConfig, Config, CriticConfig, DataConfig, GenerateConfig, GroupConfig, PlacementConfig,
                                 RefConfig, RLConfig, TrainerConfig)
from mindspeed_rl.config.schema import (AgentConfig, LoraConfig, OffloadConfig, OverlongBufferConfig, RewardModelConfig,
                                        ValGenerateConfig, VLLMConfig, WeightSyncConfig)
from mindspeed_rl.config import checks as V

from .helpers import DOCS, error_of

SECTIONS = {"trainer": TrainerConfig, "actor_config": ActorConfig, "ref_config": RefConfig,
            "critic_config": CriticConfig, "reward_model": RewardModelConfig, "generate_config": GenerateConfig, "weight_sync": WeightSyncConfig,
            "rl_config": RLConfig, "data": DataConfig, "placement": PlacementConfig,
            "placement.groups.<name>": GroupConfig, "generate_config.vllm": VLLMConfig,
            "generate_config.agent": AgentConfig, "rl_config.overlong_buffer": OverlongBufferConfig,
            "actor_config.lora": LoraConfig, "actor_config.offload": OffloadConfig,
            "generate_config.val": ValGenerateConfig}

# Keys that scripts rely on: documented as stable, never renamed.
STABLE = {"trainer.total_steps", "trainer.output_dir", "trainer.seed", "trainer.save_interval", "trainer.resume",
          "trainer.dry_run", "rl_config.blocking", "rl_config.guarantee_order", "rl_config.n_samples_per_prompt"}

TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", list: "list", dict: "mapping"}

TEXT = DOCS.read_text()


def _tables(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [key, type, default, description]}} from the `### `section`` tables."""
    tables: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        heading = re.match(r"^#{2,4} `([^`]+)`\s*$", line)
        if heading:
            current = heading.group(1)
            tables[current] = {}
            continue
        if line.startswith("#"):
            current = None
            continue
        if current and line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            tables[current][cells[0].strip("`")] = cells
    return tables


TABLES = _tables(TEXT)


def _fields():
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f, hints[f.name]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _doc_value(cell: str):
    m = re.fullmatch(r"`(.*)`", cell)
    assert m, f"default cell {cell!r} is not one `value`"
    value = yaml.safe_load(m.group(1))
    if isinstance(value, str):  # PyYAML reads 1e-6 as a string; Hydra/OmegaConf read it as a float
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _type_name(tp) -> str:
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{TYPE_NAMES[inner[0]]} or null"
    return TYPE_NAMES[tp]


def test_every_section_has_a_table():
    assert [f.name for f in dataclasses.fields(Config)] == list(SECTIONS)[:-7]
    for section in SECTIONS:
        assert TABLES.get(section), f"docs/configs.md has no table under a heading `{section}`"


@pytest.mark.parametrize("section,field,tp", list(_fields()), ids=[f"{s}.{f.name}" for s, f, _ in _fields()])
def test_every_field_is_documented_with_type_and_default(section, field, tp):
    row = TABLES[section].get(field.name)
    assert row is not None, f"{section}.{field.name} is missing from docs/configs.md"
    assert len(row) == 4, row
    _, doc_type, doc_default, description = row
    expected_type = _type_name(tp)
    assert doc_type == expected_type or doc_type.startswith(expected_type + "["), \
        f"{section}.{field.name}: docs say type {doc_type!r}, the schema has {expected_type!r}"
    if dataclasses.is_dataclass(tp):  # a nested section: its own table holds the defaults
        assert doc_default == f"see `{section}.{field.name}`", doc_default
        return
    value, default = _doc_value(doc_default), _default(field)
    assert value == default, \
        f"{section}.{field.name}: docs say default {doc_default}, the schema has {default!r}"
    if isinstance(default, bool):
        assert isinstance(value, bool)
    assert len(description) > 20, f"{section}.{field.name}: say what it does"


def test_no_documented_key_is_missing_from_the_schema():
    for section, cls in SECTIONS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        stale = set(TABLES[section]) - names
        assert not stale, f"docs/configs.md documents {section} keys that do not exist: {sorted(stale)}"


def test_stable_keys_are_marked_and_listed():
    marked = {f"{s}.{k}" for s, rows in TABLES.items() for k, row in rows.items()
              if re.match(r"\*\*stable\.?\*\*", row[3])}
    assert marked == STABLE
    listed = TEXT.split("## Stable keys", 1)[1].split("\n## ", 1)[0]
    for key in STABLE:
        assert f"`{key}`" in listed


def test_allowed_values_are_documented():
    from mindspeed_rl.data.synthetic import KINDS
    from mindspeed_rl.dataflow import get_algorithm
    from mindspeed_rl.models.checkpoint import BUILTIN_MODELS
    from mindspeed_rl.config import vocab
    from mindspeed_rl.device import DEVICE_KINDS, WORKER_DEVICES
    from mindspeed_rl.rewards.registry import BUILTIN_REWARDS

    from mindspeed_rl.engines.registry import ROLLOUT_BACKENDS, TRAIN_BACKENDS, user_backends
    names = [*V.AGG_MODES, *V.KL_KINDS, *V.PLACEMENT_MODES, *V.LOGGERS, *user_backends(TRAIN_BACKENDS),
             *user_backends(ROLLOUT_BACKENDS),
             *V.DTYPES, *vocab.KL_CONTROLLER_KINDS, *DEVICE_KINDS, *WORKER_DEVICES, *BUILTIN_REWARDS,
             *(f"builtin:{k}" for k in KINDS), *(f"builtin:{m}" for m in BUILTIN_MODELS),
             *(m.name for m in get_algorithm("grpo")[0])]
    missing = [n for n in names if f"`{n}`" not in TEXT]
    assert not missing, f"docs/configs.md does not name {missing}"


def test_documented_error_examples_are_real(tmp_path):
    """The example messages in docs/configs.md are what the code prints."""
    from mindspeed_rl.config import config_from_dict
    from mindspeed_rl.planning import check_cluster, make_plan

    from .helpers import with_overrides

    cases = [({"rl_config.blocking": "yes"}, "load"),
             ({"actor_config.mini_batch_size": 32}, "load"),
             ({"rl_config.max_weight_staleness": 1, "rl_config.blocking": True}, "validate"),
             ({"actor_config.loss_agg_mode": "mean"}, "validate"),
             ({"placement.groups.integrated.dp": 3}, "plan"),
             ({"placement.mode": "custom", "placement.groups": {"gen": {"mfcs": ["actor_rollout"]}}}, "plan"),
             ({"actor_config.model_path": "/nonexistent/dir"}, "plan"),
             ({"data.dataset": "builtin:multiply"}, "plan")]
    for overrides, stage in cases:
        msg = error_of(overrides, stage)
        line = msg.splitlines()[-1].removeprefix("  - ")
        assert line in TEXT, f"docs/configs.md should quote the real message:\n{line}"
    plan = make_plan(config_from_dict(with_overrides({"placement.groups.integrated.num_cpus": 1.5})),
                     check_files=False)
    try:
        check_cluster(plan, {"CPU": 1.0})
    except ValueError as e:
        assert str(e) in TEXT
    else:
        raise AssertionError("check_cluster accepted a plan needing 2 CPUs on 1")


# ------------------------------------------------------------------ one vocabulary per list (issue 26 item 7)
def _vocabularies() -> dict[str, tuple[str, ...]]:
    """Dotted key -> the one tuple its value must come from (where the code defines it)."""
    from mindspeed_rl.config import vocab
    from mindspeed_rl.device import DEVICE_KINDS, WORKER_DEVICES
    return {"actor_config.loss_agg_mode": vocab.AGG_MODES, "critic_config.loss_agg_mode": vocab.AGG_MODES,
            "actor_config.kl_loss_type": vocab.KL_KINDS, "actor_config.kl_ctrl": vocab.KL_CONTROLLER_KINDS,
            "placement.device_kind": DEVICE_KINDS, "placement.groups.integrated.device": WORKER_DEVICES}


VOCABULARIES = _vocabularies()


def _doc_row(key: str) -> list[str]:
    section, name = key.rsplit(".", 1)
    section = re.sub(r"^placement\.groups\.[^.]+$", "placement.groups.<name>", section)
    return TABLES[section][name]


@pytest.mark.parametrize("key", list(VOCABULARIES))
def test_validation_lists_exactly_the_vocabulary(key):
    """The error of a value outside the list names the list as the code defines it, in its order."""
    msg = error_of({key: "nonsense"}, "validate")
    assert f"{key}='nonsense': must be one of {list(VOCABULARIES[key])}" in msg


@pytest.mark.parametrize("key", list(VOCABULARIES))
def test_docs_name_exactly_the_vocabulary(key):
    """docs/configs.md's row names every allowed value (or points to the row that does), and when it
    spells out "One of `a`, `b`, ...", that list is the code's tuple, in its order."""
    description = _doc_row(key)[3]
    same = re.search(r"same \w+ as `([^`]+)`", description)
    if same:
        assert VOCABULARIES[same.group(1)] is VOCABULARIES[key]
        description = _doc_row(same.group(1))[3]
    named = re.findall(r"`([^`]+)`", description)
    assert [v for v in VOCABULARIES[key] if v not in named] == [], f"docs/configs.md's {key} row"
    listed = re.search(r"One of ((?:`[^`]+`(?:, | or )?)+)\.", description)
    if listed:
        assert re.findall(r"`([^`]+)`", listed.group(1)) == list(VOCABULARIES[key])


def test_loss_aggregation_modes_have_one_source():
    from mindspeed_rl import algorithms
    from mindspeed_rl.algorithms import losses
    from mindspeed_rl.config import vocab
    assert V.AGG_MODES is losses.AGG_MODES is algorithms.AGG_MODES is vocab.AGG_MODES


def test_kl_estimators_have_one_source():
    from mindspeed_rl import algorithms
    from mindspeed_rl.algorithms import kl
    from mindspeed_rl.config import vocab
    assert V.KL_KINDS is kl.KL_KINDS is algorithms.KL_KINDS is vocab.KL_KINDS


def test_kl_controller_kinds_have_one_source():
    from mindspeed_rl import algorithms
    from mindspeed_rl.algorithms import kl
    from mindspeed_rl.config import vocab
    assert (V.KL_CONTROLLER_KINDS is kl.KL_CONTROLLER_KINDS is algorithms.KL_CONTROLLER_KINDS
            is vocab.KL_CONTROLLER_KINDS)


def test_device_kinds_have_one_table():
    """placement.device_kind's docs row says, per kind, the Ray resource and the torch device type that
    device/DEVICE_TABLE gives it; the config checks groups' num_* fields, the ones RAY_RESOURCES maps."""
    from mindspeed_rl.device import DEVICE_TABLE, RAY_RESOURCES
    from mindspeed_rl.parallel import placement
    description = _doc_row("placement.device_kind")[3]
    for k in DEVICE_TABLE:
        if k.name != "cpu":
            assert re.search(rf"`{k.name}` \(Ray's (custom )?`{k.ray_resource}`, workers on `{k.torch_type}`\)",
                             description), k
    assert placement.DEVICE_KINDS is V.DEVICE_KINDS
    assert set(RAY_RESOURCES) <= {f.name for f in dataclasses.fields(GroupConfig)}
    for field in RAY_RESOURCES:
        assert f"placement.groups.rule.{field}=-1.0: must be >= 0" in error_of({f"placement.groups.rule.{field}": -1},
                                                                              "validate")


def test_the_config_and_its_vocabularies_import_no_torch():
    """config/ (layer 1) reads config/vocab.py and device/kinds.py; none of them pulls in torch, so a config
    check (cli/visualize_dfg.py, a dry run's first error) stays quick."""
    import subprocess
    import sys
    code = ("import sys, mindspeed_rl.config, mindspeed_rl.config.vocab, mindspeed_rl.device; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
