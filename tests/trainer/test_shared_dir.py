"""trainer/shared_dir.py: the run's directory is absolute on the driver, and a worker whose node does not see it
stops the run before any model loads, naming the node and the fix."""
from __future__ import annotations

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.trainer import Trainer
from mindspeed_rl.trainer.shared_dir import TOKEN_FILE, check_seen, sees_token, with_absolute_output_dir, write_token


def test_a_relative_output_dir_is_resolved_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict({"trainer": {"output_dir": "outputs/run"}})
    assert with_absolute_output_dir(cfg).trainer.output_dir == str(tmp_path / "outputs" / "run")
    assert cfg.trainer.output_dir == "outputs/run"   # the caller's config keeps its relative path
    assert Trainer(cfg).cfg.trainer.output_dir == str(tmp_path / "outputs" / "run")
    absolute = config_from_dict({"trainer": {"output_dir": str(tmp_path / "x")}})
    assert with_absolute_output_dir(absolute) is absolute


def test_a_worker_reads_the_token_only_where_the_directory_is_the_drivers(tmp_path):
    token = write_token(str(tmp_path / "run"))
    assert (tmp_path / "run" / TOKEN_FILE).read_text() == token
    assert sees_token(str(tmp_path / "run"), token)
    assert not sees_token(str(tmp_path / "run"), "a token of another run")
    assert not sees_token(str(tmp_path / "elsewhere"), token)   # a node whose disk has no such directory
    assert write_token(str(tmp_path / "run")) != token           # each run its own


def test_the_refusal_names_every_blind_node_its_workers_and_the_fix():
    answers = [("integrated/0", {"host": "10.0.0.1", "node_id": "aaaa" * 8, "seen": True}),
               ("rollout/0", {"host": "10.0.0.2", "node_id": "bbbb" * 8, "seen": False}),
               ("rollout/1", {"host": "10.0.0.2", "node_id": "bbbb" * 8, "seen": False}),
               ("rule/0", {"host": "10.0.0.3", "node_id": "cccc" * 8, "seen": False})]
    with pytest.raises(ConfigError) as e:
        check_seen("/runs/a", answers)
    msg = str(e.value)
    assert msg.startswith("trainer.output_dir=/runs/a: the workers on 2 node(s) do not see")
    assert "10.0.0.2 (node bbbbbbbbbbbb): rollout/0, rollout/1" in msg and "10.0.0.3" in msg and "10.0.0.1" not in msg
    assert "a filesystem every node mounts at the same path" in msg
    check_seen("/runs/a", answers[:1])   # every node sees it: nothing to say
