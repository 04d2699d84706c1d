"""The ranks of the broadcast test: `python -m tests.parallel._broadcast_ranks OUT_DIR`.

One launcher process imports torch once and forks WORLD ranks (cheaper than WORLD interpreters on
a 2-core machine, and the pytest process, which may hold Ray's threads, is never forked). The ranks
join one gloo group through a FileStore in OUT_DIR and write what they received, or their
traceback, to OUT_DIR/rank{r}.pt; the test checks those files. Every wait has a deadline, so a
broken collective fails the test instead of hanging it.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from mindspeed_rl.engines.deployment import MESH, Deployment
from mindspeed_rl.parallel import broadcast_micro_batch, parallel_groups

WORLD = 4
COLLECTIVE_TIMEOUT_S = 20  # every gloo wait (init, new_group, broadcast) fails after this
RANKS_TIMEOUT_S = 45       # the launcher kills ranks still running after this


def _rows(gen: torch.Generator, lengths: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    if dtype == torch.bool:
        return [torch.rand(n, generator=gen) > 0.5 for n in lengths]
    if dtype == torch.int64:
        return [torch.randint(0, 32000, (n,), generator=gen) for n in lengths]
    return [torch.randn(n, generator=gen).to(dtype) for n in lengths]


def micro_batch(seed: int, lengths: list[int], first_row: int) -> tuple[dict[str, list[torch.Tensor]], list[int]]:
    """A dock-shaped micro-batch: four columns of the four dtypes, one variable-length row each."""
    gen = torch.Generator().manual_seed(seed)
    batch = {"responses": _rows(gen, lengths, torch.int64),
             "old_log_prob": _rows(gen, lengths, torch.float32),
             "ref_log_prob": _rows(gen, lengths, torch.bfloat16),
             "response_mask": _rows(gen, lengths, torch.bool)}
    return batch, list(range(first_row, first_row + len(lengths)))


# what each replica's reader sends, in order; the other ranks of the replica receive the same
SENT = {
    "dp2tp2": {
        0: [lambda: micro_batch(1, [5, 3, 7], 0),
            lambda: ({}, []),                                        # end of step: empty micro-batch
            lambda: ({"responses": [torch.zeros(2, 3, dtype=torch.int64)]}, [9])],  # bad: a 2-D row
        1: [lambda: micro_batch(2, [4, 0, 6, 2], 3),                # with a zero-length row
            lambda: ({}, []),
            lambda: ({"responses": [], "response_mask": []}, [])],  # columns without rows
    },
    # dp=1, tp=2, pp=2: one replica of all four ranks, reader 0, writer 2
    "dp1tp2pp2": {0: [lambda: micro_batch(3, [2, 9], 40), lambda: ({}, [])]},
}


def _receive(groups, script, rank):
    """Run `script` on this rank's replica; returns (role, [("ok", batch, rows) | ("error", msg)])."""
    replica_pgs = [dist.new_group(ranks) for ranks in groups.replicas]  # every rank creates every group
    t = groups.topology
    role = Deployment("mesh", MESH, dp=t.dp, tp=t.tp, pp=t.pp).roles()[groups.sub_rank(rank)]
    src = groups.global_rank(role.reader)
    got = []
    for make in script[role.replica]:
        batch, rows = make() if role.reads else (None, None)
        try:
            batch, rows = broadcast_micro_batch(batch, rows, src=src, group=replica_pgs[role.replica])
            got.append(("ok", batch, rows))
        except ValueError as e:
            got.append(("error", str(e)))
    return role, got


def run_rank(rank: int, store: str) -> dict:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        out = {}
        for name, (dp, tp, pp) in (("dp2tp2", (2, 2, 1)), ("dp1tp2pp2", (1, 2, 2))):
            role, got = _receive(parallel_groups(list(range(WORLD)), dp=dp, tp=tp, pp=pp), SENT[name], rank)
            out[name] = {"role": role, "got": got}
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _entry(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        result = {"ok": True, "value": run_rank(rank, store)}
    except BaseException:  # noqa: BLE001 - reported to the test, whatever it is
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def main(out_dir: str) -> int:
    ctx = multiprocessing.get_context("fork")
    store = os.path.join(out_dir, "store")
    procs = [ctx.Process(target=_entry, args=(r, store, out_dir), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    if hung:
        print(f"ranks {hung} still running after {RANKS_TIMEOUT_S}s; killed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
