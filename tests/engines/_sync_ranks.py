"""Rank processes of the weight sync tests (tests/engines/test_weight_sync.py).

Run by `_mp_workers.run_procs` (re-exported here): a worker writes what its function returned, or
its traceback, to a file the test reads; a hung worker is killed at the deadline and its stacks
reported.
"""
from __future__ import annotations

import importlib
import time

import torch

from mindspeed_rl.engines.base import bucketed, hf_named_weights
from mindspeed_rl.engines.base import load_named as load_by_name
from mindspeed_rl.engines.sync.weight_sync import (Checksum, checksum, receive_buckets, send_buckets,
                                              stateless_group, tee_buckets)

from ._common import spy_update_weights, tiny_qwen2
from ._mp_workers import run_procs  # noqa: F401  (the tests run these ranks with it)

HOST = "127.0.0.1"
importlib.import_module("transformers.models.qwen2.modeling_qwen2")  # lazy in transformers: load it here


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


def flat_sync(rank: int, port: int, bucket_bytes: int, inplace_min_bytes: int) -> dict:
    """A trained `TorchTrainEngine` (rank 0, parameters flattened by the engine) syncs twice, with
    an optimizer step between, to an `HFRolloutEngine` (rank 1) through `receive_weights`, the
    worker's path. Every broadcast either side issues on the real gloo group is counted."""
    from mindspeed_rl.engines import MicroBatch, OptimConfig
    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    from mindspeed_rl.engines.sync.weight_sync import receive_weights

    from ._common import PAD, nll_loss_fn, random_rows

    group = stateless_group(HOST, port, rank, 2, "gloo", timeout_s=60)
    counted, broadcast = [], group.broadcast

    def counting_broadcast(tensor, src):
        counted.append(tensor.numel() * tensor.element_size())
        return broadcast(tensor, src)

    group.broadcast = counting_broadcast
    ids = torch.tensor([[1, 5, 6, 7, 3]])
    out = {"rounds": []}
    if rank == 0:
        engine = TorchTrainEngine(tiny_qwen2(seed=0, initializer_range=0.3), PAD, OptimConfig(lr=1e-2))
        for version in (1, 2):
            counted.clear()
            digest = Checksum()
            info = send_buckets(group, tee_buckets(engine.export_weights(bucket_bytes), digest=digest),
                                inplace_min_bytes=inplace_min_bytes)
            with torch.no_grad():
                logits = engine.module(ids).logits
            out["rounds"].append({"broadcasts": list(counted), "digest": digest.hexdigest(), "info": info,
                                  "logits": logits})
            mb = MicroBatch({"prompts": random_rows(4, 3, seed=1), "responses": random_rows(4, 5, seed=2)}, 1.0,
                            last=True)
            engine.train_step([mb], nll_loss_fn)
        return out
    rollout = HFRolloutEngine(tiny_qwen2(seed=1), pad_token_id=PAD)
    calls = spy_update_weights(rollout)
    storage = {n: p.data_ptr() for n, p in rollout.model.named_parameters(remove_duplicate=False)}
    for version in (1, 2):
        counted.clear()
        calls.clear()
        digest = Checksum()
        info = receive_weights(group, [rollout], version, digest)
        with torch.no_grad():
            logits = rollout.model(ids).logits
        m = rollout.model
        out["rounds"].append({
            "broadcasts": list(counted), "digest": digest.hexdigest(), "served": rollout.state_checksum(),
            "info": {k: v for k, v in info.items() if k != "names_into_targets"},
            "names_into_targets": list(info["names_into_targets"]), "calls": list(calls), "logits": logits,
            "tied": m.lm_head.weight is m.model.embed_tokens.weight, "version": rollout.weight_version,
            "same_storage": storage == {n: p.data_ptr() for n, p in m.named_parameters(remove_duplicate=False)}})
    return out
