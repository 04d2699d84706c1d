"""Issue 24: an FSDP2 actor with dp=2 died every few dozen steps in `actor_train` (gloo aborting on
`op.preamble.length <= op.nbytes`, or `aten.mm.default got mixed torch.Tensor and DTensor`).

Cause: the colocated worker runs its stages in threads at once, and with FSDP both `actor_log_prob`
and `actor_train` are collective over the DP ranks (every forward gathers the sharded parameters).
A rank's `actor_train` could take rows its peer's `actor_log_prob` had just written and start its
forward while its own `actor_log_prob` was still in a forward: the two threads' collectives
paired with different ones on the other rank, and shared one FSDP module's gathered state. In the
real job log-probs ran as one call per rank, so only a rare tail overlapped; here each rank makes
four log-prob calls (log_prob_micro_batch_size_per_device=2 of its 8 rows) and training can start
after the first, so without the turns (`Worker._turn`) the two always overlap.

Real parts only: two `Worker` Ray actors as the trainer starts them (threaded, FSDP over a gloo
group of their own), the trainer's plan and dock, the real rollout, reference (a frozen FSDP copy sharded over
the same ranks, so its forwards take their turn too), log-prob and train stages run through `run_stage` at once, and
the weight sync between steps, as the driver calls them.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.config import config_from_dict

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STAGES = ("actor_rollout", "ref_log_prob", "actor_log_prob", "actor_train")  # the group's, in the graph's order
PROMPTS, N, DP = 4, 4, 2
WAIT_S = 240          # bounds a hang: the gloo group below times out after GLOO_TIMEOUT_S
GLOO_TIMEOUT_S = 45


def _config(tmp_path):
    return config_from_dict({
        "trainer": {"total_steps": 2, "output_dir": str(tmp_path), "progress": False, "logger": ["jsonl"],
                    "plot": False, "save_interval": 0, "stage_timeout_s": 60, "dashboard": False, "report": False},
        "rl_config": {"prompts_per_step": PROMPTS, "n_samples_per_prompt": N, "guarantee_order": True},
        # 8 rows per rank: 4 log-prob calls of 2 rows; 2 optimizer steps of 2 micro-batches of 2 rows
        "actor_config": {"backend": "fsdp", "log_prob_micro_batch_size_per_device": 2,
                         "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 2},
        "placement": {"groups": {"integrated": {"dp": DP, "num_cpus": 0.25}}},
    })


def _fill(dock, rows: int, step: int) -> None:
    """A step's prompts and the advantages of its rows (the reward stages live in another group: not
    started here); everything else the hosted stages write."""
    g = torch.Generator().manual_seed(step)
    prompts = [p for p in torch.randint(3, 16, (rows // N, 4), generator=g) for _ in range(N)]  # tiny vocab: 16
    dock.put_experience({"prompts": prompts, "prompt_length": [torch.tensor([4])] * rows,
                         "advantages": [torch.randn(1, generator=g) for _ in range(rows)]},
                        list(range(rows)), producer="dataset")


def test_fsdp_log_probs_and_training_take_turns_on_every_rank(ray_session, tmp_path):
    ray = ray_session
    from mindspeed_rl.planning import make_plan
    from mindspeed_rl.transfer_dock.client import create_transfer_dock
    from mindspeed_rl.trainer.worker_specs import worker_specs
    from mindspeed_rl.workers.worker import Worker

    cfg = _config(tmp_path)
    plan = make_plan(cfg)
    group = plan.groups["integrated"]
    assert [m.name for m in group.mfcs] == list(STAGES) and group.resources.dp == DP
    dock = create_transfer_dock(plan.columns, plan.consumers, PROMPTS, N, guarantee_order=True, default_timeout=60)
    actor = ray.remote(Worker).options(num_cpus=0.25, max_concurrency=len(group.mfcs) + 4)
    workers = [actor.remote(spec) for spec in worker_specs(cfg, plan, group, [dock], lambda k: {})]
    assert len(workers) == DP
    try:
        host = ray.get(workers[0].ping.remote(), timeout=WAIT_S)["host"]
        port = ray.get(workers[0].free_port.remote(), timeout=WAIT_S)
        ray.get([w.init_process_group.remote(host, port, GLOO_TIMEOUT_S) for w in workers], timeout=WAIT_S)
        ray.get([w.setup.remote() for w in workers], timeout=WAIT_S)
        ray.get([w.sync_weights.remote("actor", 0) for w in workers], timeout=WAIT_S)
        for step in range(2):
            _fill(dock, plan.rows_per_step, step)
            calls = [(k, name, w.run_stage.remote(name, step, step)) for name in STAGES for k, w in enumerate(workers)]
            reports = {(k, name): r for (k, name, _), r in
                       zip(calls, ray.get([ref for _, _, ref in calls], timeout=WAIT_S))}
            for k in range(DP):
                ref, lp, train = reports[(k, "ref_log_prob")], reports[(k, "actor_log_prob")], reports[(k, "actor_train")]
                # the sharded reference's forwards are collective: its turn comes first, then the actor's
                assert (ref["rows"], ref["micro_batches"]) == (8, 1) and lp["t_start"] >= ref["t_end"], (ref, lp)
                # each rank its equal share of log-prob rows and of training rows, in 4 calls / 4 micro-batches
                assert (lp["rows"], lp["micro_batches"]) == (8, 4), lp
                assert (train["rows"], train["micro_batches"], train["metrics"]["updates"]) == (8, 4, 2), train
                assert torch.isfinite(torch.tensor(train["metrics"]["pg_loss"])), train["metrics"]
                # the turn: this rank's training started only after its log-prob stage was done
                assert train["t_start"] >= lp["t_end"], (k, step, lp["t_end"], train["t_start"])
            assert all(dock.all_consumed(name) for name in STAGES)
            synced = ray.get([w.sync_weights.remote("actor", step + 1) for w in workers], timeout=WAIT_S)
            # both ranks gathered the same full weights into their rollout engines
            assert [c for r in synced for c in r["received"]] == [synced[0]["sent"]] * DP, synced
            dock.clear()
    finally:
        for w in workers:
            ray.kill(w)
        dock.close()
