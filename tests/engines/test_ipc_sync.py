"""Colocated weight sync through shared memory (`engines/sync/ipc_sync.py` and the `ipc_*` modules beside it).

The multi-process tests start real processes (torch.multiprocessing, spawn) that talk through
multiprocessing queues and share real /dev/shm segments: the CPU twin of the CUDA IPC path, same
code except how a staging buffer is allocated and mapped. Every wait is bounded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as tmp

from mindspeed_rl.engines.sync.ipc_receiver import IPCAttachments, IPCReceiver, receive_ipc
from mindspeed_rl.engines.sync.ipc_segments import cleanup_stale, segment_files, shm_dir
from mindspeed_rl.engines.sync.ipc_sender import IPCSender
from mindspeed_rl.engines.sync.ipc_sync import CallChannel, Mailbox, QueueChannel, send_ipc, serve_ipc
from mindspeed_rl.engines.sync.weight_sync import Checksum, checksum

BUCKET = 256 << 10          # 256 KiB: the 16 MiB embedding is split over 64 buckets
TIMEOUT = 90.0


class TinyLM(torch.nn.Module):
    """An LM's parameter shapes: a big embedding tied to lm_head, a bf16 layer, a small norm."""

    def __init__(self, vocab: int = 16384, dim: int = 256, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed_tokens = torch.nn.Embedding(vocab, dim)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(3))
            self.layers[1].to(torch.bfloat16)
            self.norm = torch.nn.Parameter(torch.randn(dim))
            self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight      # tied: one storage under two names

    def named(self):
        """Every weight under each of its names, as `hf_named_weights` yields them."""
        return [(n, p.detach()) for n, p in self.named_parameters(remove_duplicate=False)]


def model_bytes(model: TinyLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------- process bodies

def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _sender_proc(to_reader, from_reader, results, rounds: int) -> None:
    torch.set_num_threads(1)
    try:
        model = TinyLM(seed=0)
        sender = IPCSender(BUCKET, "cpu")
        ch = QueueChannel(to_reader, from_reader)
        out = []
        for r in range(rounds):
            if r == rounds - 1:          # the last round zero copy: the reader reads the parameters themselves
                sender.adopt(model)
            with torch.no_grad():        # new weights every round, so every round must move bytes
                for p in model.parameters():
                    p.add_(r + 1)
            digest = Checksum()
            info = send_ipc(sender, iter([model.named()]), ch, TIMEOUT, digest)
            out.append(dict(info, sent=digest.hexdigest(), files=segment_files(sender.prefix)))
        sender.close()
        results.put({"ok": True, "rounds": out, "prefix": sender.prefix,
                     "files_after_close": segment_files(sender.prefix), "model_bytes": model_bytes(model)})
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback
        results.put({"ok": False, "error": traceback.format_exc(), "exc": repr(e)})


def _receiver_proc(from_sender, to_sender, results, modes: list[str]) -> None:
    torch.set_num_threads(1)
    try:
        model = TinyLM(seed=1)           # random (non-zero) weights: every page resident before we measure
        targets = dict(model.named())
        attachments = IPCAttachments()
        ch = QueueChannel(to_sender, from_sender)
        out = []
        for mode in modes:
            before = checksum(model.named())
            rec = {"mode": mode, "before": before}
            if mode == "targets":
                digest = Checksum()
                rx = IPCReceiver(targets, digest=digest, attachments=attachments)
                rec["info"] = serve_ipc(rx, ch, TIMEOUT)
                rec["digest"] = digest.hexdigest()
            elif mode == "memory":       # no digest: hashing reads whole tensors back (not the sync's cost)
                rss0 = _status_kb("VmRSS") * 1024
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")         # VmHWM := current RSS; VmHWM after the sync is its peak
                rx = IPCReceiver(targets, attachments=attachments)
                rec["info"] = serve_ipc(rx, ch, TIMEOUT)
                rec["peak_growth"] = _status_kb("VmHWM") * 1024 - rss0
                rec["mapped"] = attachments.mapped_bytes
            elif mode == "load":         # a reader with no targets (vLLM-like): by name, split tensors assembled
                loaded = []

                def load(bucket):
                    from mindspeed_rl.engines.base import load_named
                    loaded.extend(load_named(model, bucket))
                digest = Checksum()
                rx = IPCReceiver(None, load, digest, attachments)
                rec["info"] = serve_ipc(rx, ch, TIMEOUT)
                rec["digest"] = digest.hexdigest()
                rec["loaded"] = sorted(set(loaded))
            rec["after"] = checksum(model.named())
            rec["tied"] = model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
            out.append(rec)
        attachments.close()
        results.put({"ok": True, "rounds": out, "model_bytes": model_bytes(model)})
    except BaseException as e:  # noqa: BLE001
        import traceback
        results.put({"ok": False, "error": traceback.format_exc(), "exc": repr(e)})


def _sender_then_hang(results) -> None:
    """Packs two buckets (two segments exist), reports them, then waits to be killed."""
    torch.set_num_threads(1)
    sender = IPCSender(BUCKET, "cpu")
    sender.start(TinyLM(vocab=2048, dim=128).named())
    hs = sender.next()
    results.put({"pid": os.getpid(), "prefix": sender.prefix, "segments": [h.segment for h in hs]})
    time.sleep(300)


def _get(q, what: str):
    import queue
    try:
        r = q.get(timeout=TIMEOUT * 2)
    except queue.Empty:
        raise AssertionError(f"{what}: no result within {TIMEOUT * 2}s") from None
    assert r.get("ok", True), f"{what} failed:\n{r.get('error')}"
    return r


def _join(procs) -> None:
    for p in procs:
        p.join(30)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)


# ---------------------------------------------------------------------------- two processes

@pytest.mark.slow
def test_two_processes_bit_exact_tied_split_bounded_memory():
    """A sender process syncs a model with a tied lm_head and a tensor 64x the bucket size to a
    reader process three times: into its parameters with a digest, into them again while its
    peak memory is measured, and through a by-name `load` (split tensors assembled). Every round
    the reader's weights equal the sender's bit for bit (checksums), the reader's receive digest
    equals the sender's, no bucket exceeds bucket_bytes, the segments are reused after the first
    round, the reader's peak memory grew by far less than the model (no second copy), and the
    sender's segment files are gone after close()."""
    ctx = tmp.get_context("spawn")
    to_reader, to_sender, res_s, res_r = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    modes = ["targets", "memory", "load", "targets"]
    procs = [ctx.Process(target=_sender_proc, args=(to_reader, to_sender, res_s, len(modes))),
             ctx.Process(target=_receiver_proc, args=(to_reader, to_sender, res_r, modes))]
    for p in procs:
        p.start()
    try:
        sent = _get(res_s, "sender")
        got = _get(res_r, "receiver")
    finally:
        _join(procs)
    nbytes = got["model_bytes"]
    for s, r in zip(sent["rounds"], got["rounds"]):
        assert r["before"] != s["sent"], r["mode"]          # the round had something to move
        assert r["after"] == s["sent"], r["mode"]           # bit-exact: names, dtypes, shapes, bytes
        assert r["tied"], r["mode"]                         # the reader's tie survived
        assert s["max_bucket_bytes"] <= BUCKET
        # packed: the embedding is split, and again as lm_head (another bucket); zero copy: never split
        assert s["split"] == (0 if s["bytes_zero_copy"] else 2)
        assert s["bytes"] > nbytes                          # so more than one model's bytes moved
        assert r["info"]["bytes"] == s["bytes"]
        assert s["readers"][0]["bytes"] == s["bytes"]
        slots = [f for f in s["files"] if os.path.basename(f).rsplit("-", 1)[1].startswith("s")]
        assert len(slots) == 2                              # two reused slots, never one file per bucket
    assert [s["segments_allocated"] for s in sent["rounds"]] == [2, 0, 0, 0]
    assert [s["bytes_zero_copy"] for s in sent["rounds"]] == [0, 0, 0, sent["rounds"][3]["bytes"]]
    tgt, mem, load, zero = got["rounds"]
    assert tgt["digest"] == sent["rounds"][0]["sent"]
    assert "lm_head.weight" in tgt["info"]["names_into_targets"]
    assert tgt["info"]["bytes_into_targets"] == tgt["info"]["bytes"]   # every byte straight into a parameter
    # the model is 16.9 MB; the reader maps two 256 KiB slots (mapped since round 1) and writes into
    # its own parameters: its peak memory hardly moves
    assert mem["mapped"] <= 2 * BUCKET
    assert mem["peak_growth"] < nbytes // 4, (mem["peak_growth"], nbytes)
    assert load["digest"] == sent["rounds"][2]["sent"]
    assert "lm_head.weight" in load["loaded"] and "embed_tokens.weight" in load["loaded"]
    assert zero["digest"] == sent["rounds"][3]["sent"]
    assert sent["files_after_close"] == []
    assert segment_files(sent["prefix"]) == []


@pytest.mark.slow
def test_segments_removed_when_the_sender_is_killed():
    """SIGKILL runs no Python in the sender: its reaper process unlinks the segments."""
    ctx = tmp.get_context("spawn")
    res = ctx.Queue()
    p = ctx.Process(target=_sender_then_hang, args=(res,))
    p.start()
    try:
        r = _get(res, "sender")
        files = segment_files(r["prefix"])
        assert [os.path.basename(f) for f in files] == sorted(r["segments"]) and len(files) == 2
        os.kill(r["pid"], signal.SIGKILL)
        p.join(30)
        deadline = time.monotonic() + 20
        while segment_files(r["prefix"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert segment_files(r["prefix"]) == []
    finally:
        _join([p])


def test_cleanup_stale_removes_only_dead_senders_files():
    """A segment named after a pid that no longer exists is removed; a live pid's is kept."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    dead = os.path.join(shm_dir(), f"msrl-ipc-{proc.pid}-0-s0g0")
    live = os.path.join(shm_dir(), f"msrl-ipc-{os.getpid()}-999999-s0g0")
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(b"x" * 64)
    try:
        removed = cleanup_stale()
        assert dead in removed and not os.path.exists(dead)
        assert os.path.exists(live) and live not in removed
    finally:
        for path in (dead, live):
            if os.path.exists(path):
                os.unlink(path)


# ---------------------------------------------------------------------------- one process (same code)

def _sync_in_process(sender, named, rx):
    """The step protocol without a channel: both sides in this process, the real segments."""
    sender.start(named)
    handles, seen = sender.next(), []
    while handles:
        seen += handles
        rx.receive(handles)
        handles = sender.next(done=handles)
    return seen, rx.finish()


def test_layout_buckets_bounded_split_pieces_cover_the_tensor():
    """Buckets never exceed bucket_bytes; a tensor under a bucket is never split; a bigger one's
    pieces cover its bytes exactly once, in consecutive buckets; a tie in one bucket is sent once."""
    big = torch.arange(10_000, dtype=torch.float32)             # 40,000 B over 4 KiB buckets
    small = torch.ones(1000)                                    # 4,000 B: whole
    named = [("small", small), ("alias", small), ("big", big), ("tail", torch.zeros(3))]
    with IPCSender(4096) as s:
        targets = {"small": torch.zeros(1000), "alias": torch.zeros(1000), "big": torch.zeros(10_000),
                   "tail": torch.ones(3)}
        handles, info = _sync_in_process(s, named, IPCReceiver(targets))
        assert all(h.nbytes <= 4096 for h in handles)
        pieces = [(h.index, p) for h in handles for p in h.pieces]
        assert [p.offset for _, p in pieces if p.name in ("small", "alias")] == [0, 0]   # sent once
        bigs = [(i, p) for i, p in pieces if p.name == "big"]
        assert len(bigs) == 10 and [i for i, _ in bigs] == list(range(bigs[0][0], bigs[0][0] + 10))
        ranges = sorted((p.start, p.start + p.nbytes) for _, p in bigs)
        assert ranges[0][0] == 0 and ranges[-1][1] == 40_000
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))   # tiled: every byte once
        assert all(torch.equal(targets[n], t) for n, t in named)
        assert s.last_sync["split"] == 1 and info["bytes"] == 4000 + 40_000 + 12


def test_cast_and_noncontiguous_targets_and_receive_ipc():
    """A reader keeping bf16 gets the sender's fp32 cast (a split tensor is assembled first); a
    non-contiguous target is written through copy_; receive_ipc returns the bytes it loaded."""
    big = torch.randn(3000)                                      # 12 KB: split over 4 KiB buckets
    mat = torch.randn(16, 8)
    with IPCSender(4096) as s:
        targets = {"big": torch.zeros(3000, dtype=torch.bfloat16), "mat": torch.zeros(8, 16).t()}
        _, info = _sync_in_process(s, [("big", big), ("mat", mat)], IPCReceiver(targets))
        assert torch.equal(targets["big"], big.to(torch.bfloat16)) and torch.equal(targets["mat"], mat)
        assert info["bytes_into_targets"] == 0                   # neither could take bytes in place
        tgt = {"mat": torch.zeros(16, 8)}
        s.start([("mat", mat)])
        hs = s.next()
        assert receive_ipc(hs, tgt) == mat.numel() * 4 and torch.equal(tgt["mat"], mat)
        assert s.next(done=hs) == []


def test_checksum_catches_a_corrupted_byte():
    """A byte changed in the shared segment after the sender packed it makes the reader's digest
    (and its weights) differ from the sender's: the check is not vacuous."""
    w = torch.randn(64, 64)
    with IPCSender(1 << 20) as s:
        sent, got = Checksum(), Checksum()
        s.start([("w", w)], sent)
        hs = s.next()
        with open(os.path.join(shm_dir(), hs[0].segment), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
        targets = {"w": torch.zeros(64, 64)}
        rx = IPCReceiver(targets, digest=got)
        rx.receive(hs)
        assert s.next(done=hs) == []
        rx.finish()
        assert got.hexdigest() != sent.hexdigest()
        assert checksum([("w", targets["w"])]) == got.hexdigest()


def test_adopt_zero_copy_follows_training_and_survives_close():
    """After `adopt`, the parameters live in the sender's segments (same values, still tied, same
    Parameter objects), a sync packs nothing, an in-place update of a parameter is what the next
    sync delivers, and close() removes the names while the module keeps working."""
    model, reader = TinyLM(vocab=512, dim=64, seed=0), TinyLM(vocab=512, dim=64, seed=1)
    before = checksum(model.named())
    params = list(model.parameters())
    s = IPCSender(4096)
    moved = s.adopt(model)
    assert moved >= model_bytes(model) and checksum(model.named()) == before
    assert list(model.parameters()) == params and model.lm_head.weight is model.embed_tokens.weight
    assert len(segment_files(s.prefix)) >= 1
    for step in range(2):
        with torch.no_grad():
            model.layers[0].weight.mul_(-2.0)        # a training step between syncs, in place
        att = IPCAttachments()
        _sync_in_process(s, model.named(), IPCReceiver(dict(reader.named()), attachments=att))
        assert s.last_sync["bytes_zero_copy"] == s.last_sync["bytes"] > 0
        assert s.last_sync["segments_allocated"] == 0        # no staging slot at all
        assert checksum(reader.named()) == checksum(model.named())
        att.close()
    s.close()
    assert segment_files(s.prefix) == []
    with torch.no_grad():
        model.norm.add_(1.0)                                  # the module's memory is still its own
    assert checksum(model.named()) != before


def test_protocol_errors():
    """Misuse fails loudly instead of overwriting a buffer a reader may still be copying."""
    w = torch.randn(2000)                                          # 8 KB: 2 buckets of 4 KiB
    with IPCSender(4096, slots=1) as s:
        s.start([("a", w), ("b", w.clone())])
        hs = s.next()
        with pytest.raises(RuntimeError, match="no free staging slot"):
            s.next()                                               # slot 0 not acknowledged
        with pytest.raises(RuntimeError, match="in progress"):
            s.start([("a", w)])
        with pytest.raises(RuntimeError, match="not awaiting"):
            s.release([7])
        with pytest.raises(ValueError, match="not a weight of the reader"):
            IPCReceiver({"zzz": torch.zeros(1)}).receive(hs)
        with pytest.raises(ValueError, match="shape"):
            IPCReceiver({"a": torch.zeros(5)}).receive(hs)
        rx = IPCReceiver({"a": torch.zeros(2000, dtype=torch.float64), "b": torch.zeros(2000)})
        rx.receive(hs)                                             # half of "a" (cast: assembled later)
        s.abort()
        with pytest.raises(RuntimeError, match="incomplete"):
            rx.finish()
    with pytest.raises(ValueError):
        IPCSender(8)


def test_serve_and_send_over_thread_queues():
    """send_ipc / serve_ipc in two threads of one process over queue.Queue: the pipelined loop
    (bucket i+1 packed while i is loaded), a reader failure reaches the sender as an error."""
    import queue
    import threading
    model = TinyLM(vocab=512, dim=64, seed=0)
    reader = TinyLM(vocab=512, dim=64, seed=1)
    a, b = queue.Queue(), queue.Queue()
    out = {}
    rx = IPCReceiver(dict(reader.named()))
    t = threading.Thread(target=lambda: out.update(serve_ipc(rx, QueueChannel(b, a), 30)))
    t.start()
    with IPCSender(8192) as s:
        info = send_ipc(s, model.named(), QueueChannel(a, b), 30)
        t.join(30)
        assert checksum(reader.named()) == checksum(model.named())
        assert info["buckets"] > 2 and out["bytes"] == info["bytes"]
        bad = IPCReceiver({"nothing": torch.zeros(1)})
        failed = []

        def serve_bad():
            try:
                serve_ipc(bad, QueueChannel(b, a), 30)
            except ValueError as e:
                failed.append(e)
        t = threading.Thread(target=serve_bad)
        t.start()
        with pytest.raises(RuntimeError, match="a reader failed"):
            send_ipc(s, model.named(), QueueChannel(a, b), 30)
        t.join(30)
        assert failed and not s.active


class _Reader:
    """A reader engine's weight-sync surface (receive_targets / update_weights), over a module."""

    def __init__(self, module, targets: bool):
        self.module, self.targets, self.versions = module, targets, []

    def receive_targets(self):
        return dict(self.module.named()) if self.targets else None

    def update_weights(self, named, version):
        from mindspeed_rl.engines.base import load_named
        load_named(self.module, named)
        self.versions.append(version)


def test_worker_wiring_calls_on_threads_two_readers():
    """The shape of the worker wiring, in one process: the sender's hand-offs are calls run on a
    pool of threads (as a threaded Ray actor runs `ipc_deliver`), the reader's sync thread serves
    a Mailbox with `IPCReceiver.for_readers` over two readers: one takes tensors in place, the other
    loads by name, both end at the version, the digest equals the sender's."""
    from concurrent.futures import ThreadPoolExecutor
    import threading
    model = TinyLM(vocab=1024, dim=64, seed=0)
    a, b = _Reader(TinyLM(vocab=1024, dim=64, seed=1), True), _Reader(TinyLM(vocab=1024, dim=64, seed=2), False)
    box, out, sent, got = Mailbox(), {}, Checksum(), Checksum()
    att = IPCAttachments()

    def reader_sync():
        rx = IPCReceiver.for_readers([a, b], 7, got, att)
        out.update(serve_ipc(rx, box, 30, finish=rx.finish_readers))
    with ThreadPoolExecutor(4) as pool, IPCSender(16 << 10) as s:
        t = threading.Thread(target=reader_sync)
        t.start()
        ch = CallChannel(lambda x: pool.submit(box.deliver, x, 30), lambda f, timeout: f.result(timeout))
        info = send_ipc(s, model.named(), ch, 30, digest=sent)
        t.join(30)
    att.close()
    assert not t.is_alive() and info["buckets"] > 2 and info["split"] >= 1
    assert got.hexdigest() == sent.hexdigest()
    assert checksum(a.module.named()) == checksum(b.module.named()) == checksum(model.named())
    assert a.versions[-1] == b.versions[-1] == 7
    assert out["bytes_into_targets"] == out["bytes"]


# ---------------------------------------------------------------------------- CUDA (a GPU machine only)

def _cuda_sender(to_reader, from_reader, results) -> None:
    try:
        model = TinyLM(seed=0).cuda()
        out = []
        with IPCSender(BUCKET, "cuda") as sender:
            for zero in (False, True):
                if zero:
                    sender.adopt(model)          # registers the storages: the reader maps them
                with torch.no_grad():
                    model.norm.add_(1.0)
                digest = Checksum()
                info = send_ipc(sender, model.named(), QueueChannel(to_reader, from_reader), TIMEOUT, digest)
                out.append(dict(info, sent=digest.hexdigest()))
        results.put({"ok": True, "rounds": out})
    except BaseException:  # noqa: BLE001
        import traceback
        results.put({"ok": False, "error": traceback.format_exc()})


def _cuda_reader(from_sender, to_sender, results) -> None:
    try:
        model = TinyLM(seed=1).cuda()
        out = []
        with IPCAttachments("cuda") as att:
            for _ in range(2):
                digest = Checksum()
                info = serve_ipc(IPCReceiver(dict(model.named()), digest=digest, attachments=att),
                                 QueueChannel(to_sender, from_sender), TIMEOUT)
                out.append(dict(info, digest=digest.hexdigest(), after=checksum(model.named())))
        results.put({"ok": True, "rounds": out})
    except BaseException:  # noqa: BLE001
        import traceback
        results.put({"ok": False, "error": traceback.format_exc()})


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC between two processes)")
def test_cuda_ipc_two_processes_packed_and_zero_copy():
    """Two processes on ONE GPU (where NCCL refuses two ranks): the packed path through CUDA IPC
    staging buffers, then zero copy from the sender's registered parameter storages; the reader's
    weights equal the sender's bit for bit both times."""
    ctx = tmp.get_context("spawn")
    to_reader, to_sender, res_s, res_r = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_cuda_sender, args=(to_reader, to_sender, res_s)),
             ctx.Process(target=_cuda_reader, args=(to_reader, to_sender, res_r))]
    for p in procs:
        p.start()
    try:
        sent = _get(res_s, "sender")
        got = _get(res_r, "reader")
    finally:
        _join(procs)
    for s, r in zip(sent["rounds"], got["rounds"]):
        assert r["after"] == s["sent"] and r["digest"] == s["sent"]
    assert sent["rounds"][0]["bytes_zero_copy"] == 0
    assert sent["rounds"][1]["bytes_zero_copy"] == sent["rounds"][1]["bytes"] > 0
