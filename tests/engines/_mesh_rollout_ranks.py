"""Rank processes of the mesh rollout tests (tests/engines/test_mesh_rollout.py), run by
`_mp_workers.run_procs`: each joins a gloo group over TCP, builds a real `MeshRolloutEngine` and
returns what it generated for the test to compare with the single-process HF engine."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from mindspeed_rl.engines.base import RolloutSpec

from ._common import PAD

HOST = "127.0.0.1"


def run(rank: int, world: int, port: int, path: str, options: dict, calls: list, update: list | None) -> dict:
    """`calls[d]` = the generate calls of data-parallel replica d, each (prompts, params, seeds); every
    rank of the replica makes them. With `update` (HF-named full tensors), every rank then loads it as
    version 1 and makes its replica's first call again."""
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from mindspeed_rl.engines.rollout.mesh_rollout import MeshRolloutEngine

    engine = MeshRolloutEngine.build(RolloutSpec(model_path=path, pad_token_id=PAD, seed=0, options=options))
    m = engine.model
    mine = calls[m.dp_rank]
    outs = [engine.generate(p, params, seeds) for p, params, seeds in mine]
    after = None
    if update is not None:
        engine.update_weights(update, 1)
        after = engine.generate(*mine[0])
    result = {"coord": m.coord, "outs": [(o.responses, o.log_probs) for o in outs],
              "after": (after.responses, after.log_probs) if after else None, "version": engine.weight_version,
              "reader": engine.is_dock_reader, "writer": engine.is_dock_writer}
    engine.close()
    dist.destroy_process_group()
    return result
