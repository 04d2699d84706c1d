"""Colocated weight sync through shared memory / CUDA IPC (`engines/sync/ipc_sync.py`) against an
in-process `load_state_dict` of the same weights.

    python benchmarks/ipc_sync.py [--device cpu|cuda] [--dtype bfloat16] [--bucket-mb 64,256,512]
                                  [--repeats 5] [--layers N] [--json out.json]

What runs: two processes (torch.multiprocessing, spawn) on one device. The sender holds a
Qwen2.5-0.5B-architecture model (mindspeed_rl/models/configs/qwen2_5_0_5b.json, random init,
494M parameters, tied embeddings) and runs `send_ipc(IPCSender(bucket), hf_named_weights(model))`;
the reader runs `serve_ipc(IPCReceiver(targets))` into its own model's parameters
(`named_parameters(remove_duplicate=False)`, what an engine's `receive_targets()` returns). Both
hand-offs go through multiprocessing queues (in the trainer they would be Ray calls).

Time of a sync: on the sender, from `send_ipc`'s start to its return, which waits for the reader's
final acknowledgement, so the reader's last copy is inside it. One warm-up sync per bucket size
(it allocates the staging segments and the reader maps them; reported as `first_s`), then
`repeats` timed syncs (median reported). The baseline, in the reader's process after the syncs:
`model.load_state_dict(sd)` of a state dict of the same shapes and dtypes (tied lm_head included,
as the sync also sends it), median of `repeats`. ratio = baseline seconds / sync seconds (1.0:
as fast as copying the weights within one process; the H100 target is >= 0.8).
Two modes: `packed` (every bucket copied into the sender's reused staging slots, then out by the
reader: two copies) and `zero_copy` (the sender's parameters moved once into shared memory with
`IPCSender.adopt`, outside the timing; on CUDA nothing moves; the reader copies straight from
them: one copy, like the baseline).
Also reported: the reader's peak RSS growth during the last timed sync (Linux VmHWM after
`clear_refs`; its mappings were made by the warm-up): what it allocated, far below the model's size.
A last sync with `weight_sync.Checksum` on both sides proves the bytes arrived (`checksum_equal`).

The CUDA mode (`--device cuda`) is written against the same API and has not run: no GPU here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "mindspeed_rl" / "models" / "configs" / "qwen2_5_0_5b.json"
TIMEOUT = 600.0
MiB = 1 << 20


def build_model(dtype: torch.dtype, device: str, seed: int, layers: int | None):
    """The architecture on `device` with uniform random weights (built on the meta device and
    filled in place: the default init of 494M parameters takes a minute on a busy CPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = json.loads(CONFIG.read_text())
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    model = model.to(dtype).to_empty(device=device).eval()   # cast on meta: no float32 copy is ever made
    model.tie_weights()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.requires_grad_(False)
            p.uniform_(-0.05, 0.05, generator=g)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _sync_dev(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def sender_main(args, to_reader, from_reader, results) -> None:
    from mindspeed_rl.engines.base import hf_named_weights
    from mindspeed_rl.engines.sync.ipc_sender import IPCSender
    from mindspeed_rl.engines.sync.ipc_sync import QueueChannel, send_ipc
    from mindspeed_rl.engines.sync.weight_sync import Checksum
    try:
        torch.set_num_threads(args.threads)
        model = build_model(getattr(torch, args.dtype), args.device, 0, args.layers)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        results.put({"ready": "sender", "model_bytes": nbytes,
                     "params": sum(p.numel() for p in model.parameters())})
        ch = QueueChannel(to_reader, from_reader)
        out = []
        for mb, mode in [(mb, mode) for mode in args.modes for mb in args.bucket_mb]:
            to_reader.put({"case": mb})
            with IPCSender(mb * MiB, args.device, zero_copy=mode == "zero_copy") as sender:
                t0 = time.perf_counter()
                adopted = sender.adopt(model) if mode == "zero_copy" else 0
                adopt_s = time.perf_counter() - t0
                times = []
                for i in range(args.repeats + 1):
                    _sync_dev(args.device)
                    t0 = time.perf_counter()
                    info = send_ipc(sender, hf_named_weights(model), ch, TIMEOUT)
                    times.append(time.perf_counter() - t0)
                sent = Checksum()
                send_ipc(sender, hf_named_weights(model), ch, TIMEOUT, digest=sent)
                r = info["readers"][0]
                out.append({"mode": mode, "adopted_bytes": adopted, "adopt_s": adopt_s,
                            "bytes_zero_copy": info["bytes_zero_copy"], "bucket_mb": mb, "first_s": times[0],
                            "median_s": statistics.median(times[1:]),
                            "times_s": times[1:], "bytes": info["bytes"], "buckets": info["buckets"],
                            "max_bucket_bytes": info["max_bucket_bytes"], "split": info["split"],
                            "bytes_into_targets": r["bytes_into_targets"], "sent_checksum": sent.hexdigest()})
        to_reader.put({"case": None})
        results.put({"sender": out})
    except BaseException:  # noqa: BLE001
        import traceback
        results.put({"error": "sender:\n" + traceback.format_exc()})


def reader_main(args, from_sender, to_sender, results) -> None:
    from mindspeed_rl.engines.sync.ipc_receiver import IPCAttachments, IPCReceiver
    from mindspeed_rl.engines.sync.ipc_sync import QueueChannel, serve_ipc
    from mindspeed_rl.engines.sync.weight_sync import Checksum
    try:
        torch.set_num_threads(args.threads)
        model = build_model(getattr(torch, args.dtype), args.device, 1, args.layers)
        targets = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        results.put({"ready": "reader"})
        ch = QueueChannel(to_sender, from_sender)
        out = []
        while True:
            msg = ch.get(TIMEOUT)
            if msg["case"] is None:
                break
            with IPCAttachments(args.device) as att:
                for i in range(args.repeats + 1):
                    last = i == args.repeats
                    if last:
                        rss0 = _kb("VmRSS") * 1024
                        with open("/proc/self/clear_refs", "w") as f:
                            f.write("5")
                    serve_ipc(IPCReceiver(targets, attachments=att), ch, TIMEOUT)
                    if last:
                        growth = _kb("VmHWM") * 1024 - rss0
                        mapped = att.mapped_bytes
                got = Checksum()
                serve_ipc(IPCReceiver(targets, digest=got, attachments=att), ch, TIMEOUT)
            out.append({"bucket_mb": msg["case"], "reader_peak_growth_bytes": growth, "mapped_bytes": mapped,
                        "received_checksum": got.hexdigest()})
        # the baseline: load_state_dict of the same weights within this process
        sd = {k: torch.empty_like(v).uniform_(-0.05, 0.05) for k, v in model.state_dict().items()}
        base = []
        for _ in range(args.repeats + 1):
            _sync_dev(args.device)
            t0 = time.perf_counter()
            model.load_state_dict(sd)
            _sync_dev(args.device)
            base.append(time.perf_counter() - t0)
        results.put({"reader": out, "baseline_times_s": base[1:],
                     "baseline_bytes": sum(v.numel() * v.element_size() for v in sd.values())})
    except BaseException:  # noqa: BLE001
        import traceback
        results.put({"error": "reader:\n" + traceback.format_exc()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bucket-mb", default="64,256,512")
    ap.add_argument("--modes", default="packed,zero_copy",
                    help="packed: every bucket copied into the staging slots; zero_copy: the sender's "
                         "parameters are shared (CPU: IPCSender.adopt) and the reader copies from them")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick trials)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.bucket_mb = [int(x) for x in args.bucket_mb.split(",")]
    args.modes = args.modes.split(",")

    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    to_reader, to_sender, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=sender_main, args=(args, to_reader, to_sender, results)),
             ctx.Process(target=reader_main, args=(args, to_reader, to_sender, results))]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        deadline = time.monotonic() + TIMEOUT * (1 + len(args.bucket_mb) * len(args.modes))
        while not ("sender" in got and "reader" in got):
            try:
                r = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit("benchmark: no result before the deadline") from None
            if "error" in r:
                raise SystemExit(r["error"])
            got.update(r)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    base = statistics.median(got["baseline_times_s"])
    rows = []
    for s, r in zip(got["sender"], got["reader"]):
        rows.append({**s, **r, "ratio": base / s["median_s"], "gb_per_s": s["bytes"] / s["median_s"] / 1e9,
                     "checksum_equal": s["sent_checksum"] == r["received_checksum"]})
    report = {"device": args.device, "dtype": args.dtype, "model_bytes": got["model_bytes"], "params": got["params"],
              "baseline_load_state_dict_s": base, "baseline_times_s": got["baseline_times_s"],
              "baseline_bytes": got["baseline_bytes"], "repeats": args.repeats, "cases": rows,
              "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "loadavg": os.getloadavg()}
    print(f"IPC weight sync, Qwen2.5-0.5B architecture ({got['params'] / 1e6:.0f}M params, {args.dtype}, "
          f"{got['model_bytes'] / 1e9:.2f} GB), device {args.device}; "
          f"in-process load_state_dict: {base:.4f} s ({got['baseline_bytes'] / 1e9:.2f} GB copied)")
    print(f"{'mode':>9} {'bucket MiB':>10} {'buckets':>8} {'GB sent':>8} {'sync s':>8} {'first s':>8} {'GB/s':>6} "
          f"{'ratio':>6} {'reader +MB':>10} {'checksum':>9}")
    for r in rows:
        print(f"{r['mode']:>9} {r['bucket_mb']:>10} {r['buckets']:>8} {r['bytes'] / 1e9:>8.2f} {r['median_s']:>8.4f} "
              f"{r['first_s']:>8.3f} {r['gb_per_s']:>6.2f} {r['ratio']:>6.2f} "
              f"{r['reader_peak_growth_bytes'] / 1e6:>10.1f} "
              f"{'equal' if r['checksum_equal'] else 'DIFFERS':>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if not all(r["checksum_equal"] for r in rows):
        raise SystemExit("benchmark: checksums differ")


if __name__ == "__main__":
    main()
