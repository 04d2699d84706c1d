"""Weight sync throughput and sender memory: a Qwen2.5-0.5B-architecture model sent over gloo.

    python benchmarks/weight_sync.py --json docs/benchmarks/weight_sync.json

What runs (all on the CPU, in separate processes talking over loopback TCP):

* single sender: a plain HF Qwen2ForCausalLM built from mindspeed_rl/models/configs/qwen2_5_0_5b.json
  (random init, 494M parameters, tied embeddings) sends `bucketed(hf_named_weights(model), bucket)`
  with `weight_sync.send_buckets` to a receiver process that runs what a rollout worker runs,
  `weight_sync.receive_weights(group, [engine], version)` (`Worker._sync` calls exactly it), on an
  `HFRolloutEngine` over its own model: big tensors straight into the engine's parameters
  (`receive_targets`), the rest through its `update_weights`. float32 and bfloat16, several bucket
  sizes; variants: the pack-everything wire, and the same function with an engine that offers no
  targets (every bucket copied out by name, as vLLM's reload does), with/without prefetch and
  buffer reuse.
* FSDP2 sender: the same model in an `FSDPTrainEngine` over 2 ranks (a gloo default group); both
  ranks iterate `export_weights(bucket)` (its gathers are collective), rank 0 sends to a 3rd process
  that receives as above. Also timed: the export alone (both ranks iterate `export_weights`, nothing
  is sent), and a variant that gathers with `DTensor.full_tensor` (gloo's all-gather) instead of the
  engine's per-rank broadcasts. One timed sync per case.
* the floor: one `broadcast` of a single flat buffer of the same bytes, in the same group between
  the same processes. Single sender: the sender's parameters are views into that buffer (so it
  costs no extra memory) and each timed sync follows a timed flat broadcast, so both see the same
  load on a shared machine; a case's ratio compares the medians of its own turns. FSDP: measured
  at the end, after the receiver has dropped its model.

Time: from a barrier before the sync to a barrier after the receiver has loaded the last bucket
(so the receiver's copy-out is inside the sync's time, not inside the floor's); throughput is
bytes on the wire / time (GB = 1e9 bytes). Memory: the sender's peak RSS during the sync minus its
RSS just before it (Linux: writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS;
VmHWM after the sync is the peak), measured on a sync that starts with the group's reused buffers
released, so buffers the sync allocates count. Its ratio is over the largest bucket actually sent
(a tensor bigger than the bucket size, the 136M-entry embedding, is a bucket of its own).
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "mindspeed_rl" / "models" / "configs" / "qwen2_5_0_5b.json"
HOST = "127.0.0.1"
MiB = 1 << 20
BIG = 1 << 62  # inplace_min_bytes that packs every tensor


# ---------------------------------------------------------------------------- process-side helpers

def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns the RSS in bytes."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def _peak() -> int:
    return _status_kb("VmHWM") * 1024


def build_model(dtype: torch.dtype = torch.float32, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    overrides = json.loads(os.environ.get("WEIGHT_SYNC_BENCH_CONFIG", "{}"))  # --layers, for quick trials
    cfg = Qwen2Config(**{**json.loads(CONFIG.read_text()), **overrides})
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()   # plain random init, float32
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(dtype)


def _barrier(group) -> None:
    group.pg.allreduce([torch.zeros(1)]).wait()


def _timed(group, fn) -> float:
    _barrier(group)
    t0 = time.perf_counter()
    fn()
    _barrier(group)
    return time.perf_counter() - t0


def _flat_bytes(model, dtype: torch.dtype, bucket_bytes: int) -> int:
    """The bytes a sync of `model` in `dtype` puts on the wire (cast a bucket at a time)."""
    from mindspeed_rl.engines.base import bucketed, hf_named_weights
    from mindspeed_rl.engines.sync.weight_sync import BucketSpec

    named = ((n, t.to(dtype)) for n, t in hf_named_weights(model))
    return sum(BucketSpec.describe(b).nbytes for b in bucketed(named, bucket_bytes))


def _flat_floor(group, is_sender: bool, nbytes: int, repeats: int) -> list[float]:
    """Seconds of `repeats` broadcasts of one flat buffer of `nbytes` (after one warm-up)."""
    n = torch.tensor([nbytes], dtype=torch.int64)
    group.broadcast(n, 0).wait()
    flat = torch.empty(int(n.item()), dtype=torch.uint8)
    if is_sender:
        flat.fill_(1)
    group.broadcast(flat, 0).wait()   # warm-up (the receiver's pages get mapped here)
    times = [_timed(group, lambda: group.broadcast(flat, 0).wait()) for _ in range(repeats)]
    del flat
    gc.collect()
    return times


def _sync_case(group, is_sender: bool, case: dict, repeats: int, send_iter, receive,
               warmup: bool = True, flat: torch.Tensor | None = None) -> dict:
    """One configuration: a warm-up sync, `repeats` timed syncs (buffers kept between them, as in a
    run; each after a timed broadcast of `flat` when given), then one sync from released buffers
    with the peak RSS measured. `receive(case)`: the receiver's whole side of one sync."""
    from mindspeed_rl.engines.sync.weight_sync import send_buckets

    def sync():
        if is_sender:
            send_buckets(group, send_iter(case["bucket_bytes"]), src=0,
                         inplace_min_bytes=case["inplace_min_bytes"], overlap=case.get("overlap", True))
        else:
            receive(case)

    if warmup:
        sync()
    times, flat_times = [], []
    for _ in range(repeats):
        if flat is not None:
            flat_times.append(_timed(group, lambda: group.broadcast(flat, 0).wait()))
        times.append(_timed(group, sync))
    group.release_buffers()
    before = _reset_peak()
    _barrier(group)
    t0 = time.perf_counter()
    sync()
    _barrier(group)
    cold = time.perf_counter() - t0
    extra = _peak() - before
    last = {k: v for k, v in group.last_sync.items() if k != "names_into_targets"}
    return {"seconds": times, "flat_seconds": flat_times, "cold_seconds": cold, "peak_extra_bytes": extra,
            "max_packed_bytes": 0, "bytes_into_targets": 0, **last}


WORKER = "into params (worker)"     # receive_weights with an engine that offers its parameters
COPY_OUT = "copy out (worker)"      # the same function, an engine that offers none: every bucket copied


def _plan(dtype: str, buckets_mb: list[int], variants: bool, copy_out: bool) -> list[dict]:
    base = {"inplace_min_bytes": None, "receiver": {}, "wire": "in place + packed", "recv": WORKER}
    cases = [{**base, "dtype": dtype, "bucket_mb": b} for b in buckets_mb]
    mid = buckets_mb[len(buckets_mb) // 2]
    if copy_out:
        cases += [{**base, "dtype": dtype, "bucket_mb": mid, "recv": COPY_OUT, "copy_out": True}]
    if variants:
        cases += [
            {**base, "dtype": dtype, "bucket_mb": mid, "inplace_min_bytes": BIG, "wire": "all packed"},
            {**base, "dtype": dtype, "bucket_mb": mid, "receiver": {"prefetch": False}, "copy_out": True,
             "recv": "copy out, no prefetch"},
            {**base, "dtype": dtype, "bucket_mb": mid, "receiver": {"prefetch": False, "reuse_buffers": False},
             "copy_out": True, "recv": "copy out, fresh per bucket"},
        ]
    from mindspeed_rl.engines.sync.bucket_layout import INPLACE_MIN_BYTES
    for c in cases:
        c["bucket_bytes"] = c["bucket_mb"] * MiB
        if c["inplace_min_bytes"] is None:
            c["inplace_min_bytes"] = INPLACE_MIN_BYTES
    return cases


def _receiver(group, model):
    """The rollout worker's side of a sync over `model`: `receive_weights` into an HFRolloutEngine
    (parameters offered as targets) or, for a case with `copy_out`, one that offers none."""
    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
    from mindspeed_rl.engines.sync.weight_sync import receive_weights

    engine, copying = HFRolloutEngine(model, pad_token_id=0), HFRolloutEngine(model, pad_token_id=0)
    copying.receive_targets = lambda: None
    version = [0]

    def receive(case):
        version[0] += 1
        receive_weights(group, [copying if case.get("copy_out") else engine], version[0], **case["receiver"])
    return receive


# ---------------------------------------------------------------------------- ranks

def _into_flat(model, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """Move the model's parameters (cast to `dtype`) into views of one flat byte buffer of `nbytes`
    (the bytes a sync sends: the tied lm_head travels twice, so the tail is filler). The floor then
    broadcasts the model's own bytes at no extra memory, the way FSDP's flat parameters would."""
    from mindspeed_rl.engines.sync.bucket_layout import aligned

    flat = torch.empty(nbytes, dtype=torch.uint8)
    off = 0
    with torch.no_grad():
        for p in model.parameters():        # each once (a tied parameter once)
            n = p.numel() * dtype.itemsize
            view = flat[off:off + n].view(dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            off = aligned(off + n)
    assert off <= nbytes, (off, nbytes)
    flat[off:].fill_(1)
    return flat


def single_rank(rank: int, port: int, args: dict) -> dict:
    """Rank 0 sends from a plain HF model, rank 1 receives into one. Per case the flat broadcast and
    the sync take turns, so both see the same load on a shared machine. The sender's parameters
    live in its flat buffer; the receiver holds its model and a flat buffer (at most ~7 GB in all)."""
    from mindspeed_rl.engines.base import bucketed, hf_named_weights
    from mindspeed_rl.engines.sync.weight_sync import checksum, stateless_group

    torch.set_num_threads(args["threads"])
    group = stateless_group(HOST, port, rank, 2, "gloo", timeout_s=900)
    sender = rank == 0
    out = {"floor": {}, "floor_bytes": {}, "cases": [], "checks": {}}
    model = build_model(torch.float32, seed=0 if sender else 1)
    flat = None
    for i, d in enumerate(args["dtypes"]):
        dtype = getattr(torch, d)
        n = torch.tensor([_flat_bytes(model, dtype, 256 * MiB) if sender else 0], dtype=torch.int64)
        group.broadcast(n, 0).wait()
        nbytes = out["floor_bytes"][d] = int(n.item())
        flat = None
        gc.collect()
        if sender:
            flat = _into_flat(model, dtype, nbytes)
        else:
            model = model.to(dtype)
            gc.collect()
            flat = torch.empty(nbytes, dtype=torch.uint8)
        group.broadcast(flat, 0).wait()   # warm-up (the receiver's pages get mapped here)
        send_iter = (lambda b: bucketed(hf_named_weights(model), b)) if sender else None
        receive = None if sender else _receiver(group, model)
        out["floor"][d] = []
        for case in _plan(d, args["buckets_mb"], args["variants"] and i == 0, args["variants"]):
            r = _sync_case(group, sender, case, args["repeats"], send_iter, receive, flat=flat)
            out["cases"].append({**case, **r})
            out["floor"][d] += r["flat_seconds"]
        out["checks"][d] = checksum(hf_named_weights(model)) if args["verify"] else None
    return out


def fsdp_rank(rank: int, ports: tuple[int, int], args: dict) -> dict:
    """Ranks 0 and 1: an FSDP2 engine over both (a default gloo group); rank 0 also sends to rank 2,
    a plain HF receiver, in a stateless group of two (sync ranks 0 and 1)."""
    import datetime

    import torch.distributed as dist

    from mindspeed_rl.engines.base import TrainSpec, hf_named_weights
    from mindspeed_rl.engines.sync.weight_sync import checksum, stateless_group

    torch.set_num_threads(args["threads"])
    fsdp_port, sync_port = ports
    in_sync = rank in (0, 2)
    group = stateless_group(HOST, sync_port, 0 if rank == 0 else 1, 2, "gloo", timeout_s=900) if in_sync else None
    sender = rank == 0
    out = {"floor": {}, "cases": [], "checks": {}}
    dtypes = args["dtypes"]
    engine = model = None
    if rank < 2:
        dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{fsdp_port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=900))
        from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine

        spec = TrainSpec(model_path="(in memory)", dtype=dtypes[0], process_group=dist.group.WORLD)
        engine = FSDPTrainEngine(build_model(torch.float32, seed=0), spec)   # fp32 shards
        gc.collect()
    else:
        model = build_model(getattr(torch, dtypes[0]), seed=1)
    nbytes = {}
    for i, d in enumerate(dtypes):
        if engine is not None:
            engine.export_dtype = getattr(torch, d)   # what TrainSpec.dtype sets at build time
        elif i:
            model = model.to(getattr(torch, d))
            gc.collect()
        send_iter = (lambda b: engine.export_weights(b)) if engine is not None else None
        receive = _receiver(group, model) if rank == 2 else None
        plan = _plan(d, args["fsdp_buckets_mb"], False, False)
        if i == 0 and args["fsdp_variants"]:
            plan += [{**plan[0], "overlap": False, "wire": "no overlap"},
                     {**plan[0], "all_gather": True, "wire": "full_tensor gather"}]
        for case in plan:
            if engine is not None:   # the engine's per-rank broadcasts, or DTensor.full_tensor (an all-gather)
                engine._broadcast_gather = (lambda p: False) if case.get("all_gather") else \
                    type(engine)._broadcast_gather.__get__(engine)
            if rank == 1:   # iterates the export (its gathers are collective) without sending
                for _ in range(3 if case.get("overlap", True) else 2):  # timed, cold, export alone
                    for _ in engine.export_weights(case["bucket_bytes"]):
                        pass
                continue
            # one timed sync (no warm-up: a gathered export is slow on gloo; its first sync only
            # adds writing the layout to the store)
            r = _sync_case(group, sender, case, 1, send_iter, receive, warmup=False)
            export = {}
            if rank == 0 and case.get("overlap", True):   # the export alone (gathers and casts, nothing sent)
                before = _reset_peak()
                t0 = time.perf_counter()
                for _ in engine.export_weights(case["bucket_bytes"]):
                    pass
                export = {"export_only_seconds": time.perf_counter() - t0,
                          "export_only_peak_extra_bytes": _peak() - before}
            out["cases"].append({**case, **r, **export})
            nbytes[d] = r["bytes"]
        if args["verify"]:
            if rank == 2:   # what the rollout engine serves now
                out["checks"][d] = checksum(hf_named_weights(model))
            else:   # the export, as the receiver should now hold it (both ranks gather)
                named = [(n, t.clone()) for b in engine.export_weights(256 * MiB) for n, t in b]
                out["checks"][d] = checksum(named)
                del named
                gc.collect()
    # the floor in this very group, at the end (the receiver's model dropped; the shards stay)
    if rank == 2:
        del model, receive
        gc.collect()
    if in_sync:
        for d in dtypes:
            out["floor"][d] = _flat_floor(group, sender, nbytes.get(d, 0), args["repeats"])
        out["floor_bytes"] = nbytes
    if rank < 2:
        dist.destroy_process_group()
    return out


def _entry(fn, args, q) -> None:
    try:
        q.put((args[0], "ok", fn(*args)))
    except BaseException:  # noqa: BLE001
        q.put((args[0], "error", traceback.format_exc()))


def run_ranks(fn, n: int, extra: tuple, timeout_s: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, (r, *extra), q), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < n:
            try:
                rank, status, value = q.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"ranks {sorted(set(range(n)) - set(results))} did not finish in {timeout_s}s")
            if status != "ok":
                raise SystemExit(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(n)]


# ---------------------------------------------------------------------------- report

def _summarize(sender: dict, receiver: dict, kind: str) -> list[dict]:
    rows = []
    flat_gbps = _floor_gbps(sender)
    for c, rc in zip(sender["cases"], receiver["cases"]):
        t = statistics.median(c["seconds"])
        gbps = c["bytes"] / t / 1e9
        flat = flat_gbps.get(c["dtype"])
        if c.get("flat_seconds"):   # the flat broadcasts taken turns with this case's syncs
            flat = sender["floor_bytes"][c["dtype"]] / statistics.median(c["flat_seconds"]) / 1e9
        biggest = c["max_bucket_bytes"]
        rows.append({
            "sender": kind, "dtype": c["dtype"], "bucket_mb": c["bucket_mb"], "wire": c["wire"],
            "receiver": c["recv"], "buckets": c["buckets"], "bytes": c["bytes"],
            "max_bucket_bytes": biggest, "bytes_into_targets": rc["bytes_into_targets"],
            "seconds_median": t, "seconds": c["seconds"],
            "cold_seconds": c["cold_seconds"], "sync_gbps": gbps, "flat_gbps": flat,
            "sync_over_flat_broadcast": gbps / flat if flat else None,
            "sender_peak_extra_bytes": c["peak_extra_bytes"], "sender_staging_bytes": 2 * c["max_packed_bytes"],
            "sender_peak_extra_over_bucket": c["peak_extra_bytes"] / biggest,
            "receiver_peak_extra_bytes": rc["peak_extra_bytes"],
        })
        rows[-1]["flat_seconds"] = c.get("flat_seconds") or None
        if "export_only_seconds" in c:
            rows[-1].update({k: c[k] for k in ("export_only_seconds", "export_only_peak_extra_bytes")})
            rows[-1]["export_only_seconds_over_sync"] = c["export_only_seconds"] / t
            rows[-1]["export_only_peak_extra_over_bucket"] = c["export_only_peak_extra_bytes"] / biggest
    return rows


def _floor_gbps(sender: dict) -> dict[str, float]:
    return {d: sender["floor_bytes"][d] / statistics.median(ts) / 1e9 for d, ts in sender["floor"].items() if ts}


def _print_table(rows: list[dict], floors: dict) -> None:
    print("floor (one broadcast of one flat buffer of the same bytes): "
          + ", ".join(f"{k}: {v:.2f} GB/s" for k, v in floors.items()))
    head = (f"{'sender':<7} {'dtype':<9} {'bucket':>6} {'wire':<18} {'receiver':<26} {'bkts':>4} "
            f"{'GB':>5} {'s':>6} {'GB/s':>5} {'/flat':>5} {'snd+MB':>7} {'/bkt':>5} {'rcv+MB':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r['sync_over_flat_broadcast']:.2f}" if r["sync_over_flat_broadcast"] else "  -"
        print(f"{r['sender']:<7} {r['dtype']:<9} {r['bucket_mb']:>4}Mi {r['wire']:<18} {r['receiver']:<26} "
              f"{r['buckets']:>4} {r['bytes'] / 1e9:>5.2f} {r['seconds_median']:>6.2f} {r['sync_gbps']:>5.2f} "
              f"{ratio:>5} {r['sender_peak_extra_bytes'] / MiB:>7.0f} {r['sender_peak_extra_over_bucket']:>5.2f} "
              f"{r['receiver_peak_extra_bytes'] / MiB:>7.0f}")
        if "export_only_seconds" in r:
            print(f"        (export alone, nothing sent: {r['export_only_seconds']:.2f} s, sender "
                  f"+{r['export_only_peak_extra_bytes'] / MiB:.0f} MB = "
                  f"{r['export_only_peak_extra_over_bucket']:.2f} x the largest bucket)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--bucket-mb", default="64,256,512")
    ap.add_argument("--fsdp-bucket-mb", default="256")
    ap.add_argument("--repeats", type=int, default=4,
                    help="timed syncs per case (single sender), each after a timed flat broadcast; "
                         "flat broadcasts of the FSDP floor")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    ap.add_argument("--no-variants", action="store_true", help="skip the all-packed wire and receiver variants")
    ap.add_argument("--cases", default="hf,fsdp", help="hf: a plain HF sender; fsdp: an FSDP2 sender over 2 ranks")
    ap.add_argument("--no-fsdp-variants", action="store_true",
                    help="skip the FSDP cases with overlap=False and with DTensor.full_tensor gathers")
    ap.add_argument("--layers", type=int, help="fewer decoder layers (a quick trial, not the benchmark)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 of both sides after the syncs")
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args(argv)
    from mindspeed_rl.engines.sync.weight_sync import free_port

    args = {"dtypes": ns.dtypes.split(","), "buckets_mb": [int(x) for x in ns.bucket_mb.split(",")],
            "fsdp_buckets_mb": [int(x) for x in ns.fsdp_bucket_mb.split(",")], "repeats": ns.repeats,
            "threads": ns.threads, "variants": not ns.no_variants, "verify": not ns.no_verify,
            "fsdp_variants": not ns.no_fsdp_variants}
    cases = ns.cases.split(",")
    if ns.layers:
        os.environ["WEIGHT_SYNC_BENCH_CONFIG"] = json.dumps({"num_hidden_layers": ns.layers})
    t0 = time.time()
    rows, floors, raw_floors = [], {}, {}
    if "hf" in cases:
        s, r = run_ranks(single_rank, 2, (free_port(), args), timeout_s=1800)
        if args["verify"]:
            for d in args["dtypes"]:
                assert s["checks"][d] == r["checks"][d], f"{d}: sender and receiver hold different weights"
        rows += _summarize(s, r, "hf")
        floors.update({f"hf {d}": v for d, v in _floor_gbps(s).items()})
        raw_floors["hf"] = s
    fsdp_state = "not asked for (--cases)"
    if "fsdp" in cases:
        try:
            from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine  # noqa: F401
        except ImportError as e:
            fsdp_state = f"not run: {e}"
        else:
            f0, _, f2 = run_ranks(fsdp_rank, 3, ((free_port(), free_port()), args), timeout_s=1800)
            if args["verify"]:
                for d in args["dtypes"]:
                    assert f0["checks"][d] == f2["checks"][d], f"fsdp {d}: sender and receiver differ"
            rows += _summarize(f0, f2, "fsdp2x2")
            floors.update({f"fsdp2x2 {d}": v for d, v in _floor_gbps(f0).items()})
            raw_floors["fsdp2x2"] = f0
            fsdp_state = "run"
    _print_table(rows, floors)
    result = {
        "benchmark": "weight_sync",
        "command": "python benchmarks/weight_sync.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": {"config": str(CONFIG.relative_to(ROOT)), "parameters": 494_032_768 if not ns.layers else None,
                  "layers_override": ns.layers,
                  "note": "random init; tied lm_head.weight is sent under its own name too"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "backend": "gloo over loopback TCP", "threads_per_process": args["threads"],
                    "note": "2 CPU cores shared with other jobs: absolute GB/s are noisy, ratios less so"},
        "floor_flat_broadcast": {f"{k} {d}": {"gbps": _floor_gbps(v)[d], "bytes": v["floor_bytes"][d],
                                              "seconds": v["floor"][d]}
                                 for k, v in raw_floors.items() for d in v["floor"]},
        "fsdp": fsdp_state,
        "rows": rows,
        "wall_s": time.time() - t0,
    }
    result["ratios"] = _ratios(rows)
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _ratios(rows: list[dict]) -> dict:
    """The headline ratios over the default wire and the worker's receiver (`receive_weights` into a
    rollout engine that offers its parameters; worst case over dtypes and buckets), with the raw
    figures beside them; per sender kind. Beside them, the same function with an engine that copies
    every bucket out by name (a reader without targets, e.g. vLLM). FSDP's throughput ratio is
    bounded by its export (gathers over gloo): see its rows' export_only_seconds."""
    out = {}
    for kind in sorted({r["sender"] for r in rows}):
        default = [r for r in rows if r["sender"] == kind and r["wire"] == "in place + packed"
                   and r["receiver"] == WORKER]
        if not default:
            continue
        slow = min(default, key=lambda r: r["sync_over_flat_broadcast"])
        fat = max(default, key=lambda r: r["sender_peak_extra_over_bucket"])
        prefix = "" if kind == "hf" else f"{kind}_"
        out[prefix + "sync_over_flat_broadcast"] = {
            "value": slow["sync_over_flat_broadcast"], "target": ">= 0.8", "worst_at": _where(slow),
            "sync_gbps": slow["sync_gbps"], "flat_gbps": slow["flat_gbps"], "receiver": WORKER,
            "all": {_where(r): round(r["sync_over_flat_broadcast"], 3) for r in default}}
        copying = [r for r in rows if r["sender"] == kind and r["wire"] == "in place + packed"
                   and r["receiver"] == COPY_OUT]
        if copying:
            r = min(copying, key=lambda r: r["sync_over_flat_broadcast"])
            out[prefix + "sync_over_flat_broadcast_copy_out"] = {
                "value": r["sync_over_flat_broadcast"], "worst_at": _where(r), "sync_gbps": r["sync_gbps"],
                "flat_gbps": r["flat_gbps"], "all": {_where(r): round(r["sync_over_flat_broadcast"], 3)
                                                     for r in copying},
                "note": "the same receive_weights with an engine that offers no targets: every bucket copied out"}
        out[prefix + "sender_peak_extra_over_bucket"] = {
            "value": fat["sender_peak_extra_over_bucket"], "target": "<= 2.5", "worst_at": _where(fat),
            "sender_peak_extra_bytes": fat["sender_peak_extra_bytes"], "max_bucket_bytes": fat["max_bucket_bytes"],
            "all": {_where(r): round(r["sender_peak_extra_over_bucket"], 3) for r in default}}
    return out


def _where(r: dict) -> str:
    return f"{r['dtype']} {r['bucket_mb']}MiB"


if __name__ == "__main__":
    main()
