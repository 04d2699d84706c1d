"""weight_sync.backend=ipc end to end: the real trainer with the rollout in another Ray actor
(placement disaggregated), its weights handed over through shared memory (engines/sync/ipc_sync.py: on
the CPU, /dev/shm segments; the trainer's parameters adopted into them, so the reader copies straight
from them). Same losses as the gloo group, and the rollout's log-probs equal the trainer's."""
from __future__ import annotations

import glob
import os
import time
from pathlib import Path

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.engines.sync.ipc_segments import _NAME_RE, PREFIX, shm_dir
from mindspeed_rl.trainer import Trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def run(tmp: Path, backend: str, steps: int = 3) -> list[dict]:
    return Trainer(config_from_dict({
        "trainer": {"total_steps": steps, "output_dir": str(tmp / backend), "progress": False, "logger": ["jsonl"],
                    "plot": False, "save_interval": 0, "stage_timeout_s": 60, "dashboard": False, "report": False},
        "rl_config": {"guarantee_order": True},
        "placement": {"mode": "disaggregated"},
        "weight_sync": {"backend": backend, "verify": True}})).run()


def test_ipc_weight_sync_in_the_trainer_equals_gloo(ray_session, tmp_path):
    ipc = run(tmp_path, "ipc")
    gloo = run(tmp_path, "gloo")
    assert len(ipc) == len(gloo) == 3
    for a, b in zip(ipc, gloo):
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) <= 1e-6, (a["actor/pg_loss"], b["actor/pg_loss"])
        assert a["reward/mean"] == b["reward/mean"]
        # the driver compared every reader's checksum with the trainer's; the same weights both ways
        assert a["weight_sync/actor_checksum"] == b["weight_sync/actor_checksum"]
        assert a["weight_sync/actor_mb"] > 0                  # the bytes went through the IPC sender
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in ipc)  # the rollout holds the trainer's weights
    # the trainer's actor was killed at shutdown: its reaper process removes its segments
    deadline = time.time() + 15
    while _orphans() and time.time() < deadline:
        time.sleep(0.2)
    assert not _orphans()


def _orphans() -> list[str]:
    """Segment files whose sender process is gone."""
    out = []
    for f in glob.glob(os.path.join(shm_dir(), PREFIX + "*")):
        m = _NAME_RE.search(os.path.basename(f))
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            out.append(f)
    return out
