"""Rank processes of the weight sync tests (tests/engines/test_weight_sync.py).

Self-contained (its own fork server and `run_procs`), so the sync tests depend on nothing but
`weight_sync` and a tiny HF model. A worker writes what its function returned, or its traceback,
to a file the test reads; a hung worker is killed at the deadline and its stacks reported.
"""
from __future__ import annotations

import faulthandler
import importlib
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path

import torch

from mindspeed_rl.engines.base import bucketed, hf_named_weights
from mindspeed_rl.engines.base import load_named as load_by_name
from mindspeed_rl.engines.weight_sync import (Checksum, checksum, receive_buckets, send_buckets,
                                              stateless_group, tee_buckets)

from ._common import tiny_qwen2

HOST = "127.0.0.1"
importlib.import_module("transformers.models.qwen2.modeling_qwen2")  # lazy in transformers: load it here


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _entry(fn, args, out: str) -> None:
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, file=open(out + ".stack", "w"), all_threads=True)
    try:
        result = {"ok": True, "value": fn(*args)}
    except BaseException:  # noqa: BLE001 - reported to the test, whatever it is
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, out)


def run_procs(jobs, tmp_path: Path, timeout_s: float = 90.0) -> list:
    """Run `jobs` ([(fn, args)]) in parallel processes; their return values, in order. Fails (and
    kills what is left) if any raised, died or outlived `timeout_s`."""
    ctx = _context()
    outs = [tmp_path / f"rank{i}.pt" for i in range(len(jobs))]
    procs = [ctx.Process(target=_entry, args=(fn, tuple(args), str(out)), daemon=True)
             for (fn, args), out in zip(jobs, outs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        if hung:
            for i in hung:
                os.kill(procs[i].pid, signal.SIGUSR1)
            time.sleep(1.0)
            stacks = "\n".join(f"--- rank {i}:\n{_read(str(outs[i]) + '.stack')}" for i in hung)
            raise AssertionError(f"ranks {hung} still running after {timeout_s}s\n{stacks}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    results, errors = [], []
    for i, (p, out) in enumerate(zip(procs, outs)):
        if not out.is_file():
            errors.append(f"rank {i} exited with code {p.exitcode} and no result")
            continue
        r = torch.load(out, weights_only=False)
        if not r["ok"]:
            errors.append(f"rank {i} raised:\n{r['error']}")
        results.append(r.get("value"))
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"(unreadable: {e})"


# ---------------------------------------------------------------------------- syncs

def model_for(rank: int, dtype: str) -> torch.nn.Module:
    """Rank 0 holds the trained weights (seed 0); readers start from other seeds."""
    return tiny_qwen2(seed=rank).to(getattr(torch, dtype))


def sync_rounds(rank: int, world: int, port: int, rounds: list[dict], receive_opts: dict) -> list[dict]:
    """Several syncs in one group. Each round: {dtype, bucket_bytes, inplace_min_bytes, keep}
    (keep: send only the first `keep` buckets). Rank 0 sends its model's buckets; the others
    receive into their own model by name. Returns, per round, what this rank saw."""
    group = stateless_group(HOST, port, rank, world, "gloo", timeout_s=30)
    out = []
    models: dict[str, torch.nn.Module] = {}
    for rd in rounds:
        model = models.setdefault(rd["dtype"], model_for(rank, rd["dtype"]))
        before = checksum(hf_named_weights(model))
        if rank == 0:
            buckets = list(bucketed(hf_named_weights(model), rd["bucket_bytes"]))[:rd.get("keep")]
            digest = Checksum()   # hashed as the buckets stream out
            info = send_buckets(group, tee_buckets(iter(buckets), digest=digest), src=0,
                                inplace_min_bytes=rd["inplace_min_bytes"])
            rec = {"info": info, "sent": digest.hexdigest()}
        else:
            names, dtypes = [], set()
            for bucket in receive_buckets(group, src=0, **receive_opts):
                names += [n for n, _ in bucket]
                dtypes |= {t.dtype for _, t in bucket}
                load_by_name(model, bucket)
            rec = {"info": dict(group.last_sync), "names": names, "dtypes": dtypes}
        rec.update(before=before, after=checksum(hf_named_weights(model)),
                   layout_version=group.layout_version, layout_changes=group.layout_changes)
        out.append(rec)
    return out


def join_group(rank: int, world: int, port: int, timeout_s: float) -> dict:
    """Try to form a group some members of which never come; report how it ended and when."""
    t0 = time.monotonic()
    try:
        stateless_group(HOST, port, rank, world, "gloo", timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"raised": type(e).__name__, "is_runtime_error": isinstance(e, RuntimeError),
                "message": str(e)[:2000], "elapsed": time.monotonic() - t0}
    return {"raised": None, "elapsed": time.monotonic() - t0}


def sender_gone(rank: int, world: int, port: int, timeout_s: float) -> dict:
    """Rank 0 joins and leaves without sending: a receiver waiting for a bucket fails in time."""
    group = stateless_group(HOST, port, rank, world, "gloo", timeout_s=timeout_s)
    if rank == 0:
        time.sleep(timeout_s + 3)   # stays (holding the store) but never sends
        return {"raised": None}
    t0 = time.monotonic()
    try:
        for _ in receive_buckets(group):
            pass
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:500], "elapsed": time.monotonic() - t0}
    return {"raised": None, "elapsed": time.monotonic() - t0}
