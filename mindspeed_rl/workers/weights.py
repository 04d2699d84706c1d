"""Weight sync on one worker: publishing a trained model's weights to its readers, a bucket at a time.

The trainer's ranks export and hand each bucket to their own local readers (a copy in one process);
rank 0 also sends it to readers in other workers: by a broadcast in a stateless group of its own
(gloo/nccl/hccl, `engines/sync/weight_sync.py`) or, when the trainer and its readers share one device, by
IPC handles (`engines/sync/ipc_sync.py`). Nobody holds the whole model twice.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from .stage import StageError


class WeightHost:
    def __init__(self, engines, *, rank: int, group: str, device: str, sync_cfg, stage_timeout_s: float,
                 partial_rollout: bool = False):
        self.engines, self.rank, self.group, self.device = engines, rank, group, device
        self.sync_cfg, self.stage_timeout_s = sync_cfg, stage_timeout_s
        self.partial_rollout = partial_rollout   # rl_config.partial_rollout: a sync pauses generation (`_writing`)
        self.sync_groups: dict[str, Any] = {}
        self.ipc_senders: dict[str, Any] = {}      # model -> IPCSender (the trainer's rank 0, weight_sync ipc)
        self.ipc_peers: dict[str, list] = {}       # model -> the reader actors it hands handles to
        self.ipc_mailboxes: dict[str, Any] = {}    # model -> Mailbox (a reader): handles arrive on other threads
        self.ipc_attach: dict[str, Any] = {}       # model -> IPCAttachments (a reader's mappings, kept across syncs)

    def init_sync_group(self, model: str, host: str, port: int, rank: int, world_size: int,
                        timeout_s: float = 60.0) -> None:
        from ..device import dist_backend, resolve_device
        from ..engines.sync.weight_sync import stateless_group
        backend = self.sync_cfg.backend
        device = resolve_device(self.device) if backend == "auto" else torch.device("cpu")
        self.sync_groups[model] = stateless_group(host, port, rank, world_size, dist_backend(device), timeout_s,
                                                  device=device)

    def device_key(self) -> str:
        """Which device this actor computes on, comparable across processes: "cuda:<uuid>" (two processes
        with different CUDA_VISIBLE_DEVICES see one GPU under different indexes, never under different
        uuids), or "cpu:<node id>" (one host's /dev/shm). The driver picks IPC weight sync when a
        trainer and all its readers share one key that starts with "cuda:"."""
        from ..device import resolve_device
        dev = resolve_device(self.device)
        if dev.type == "cuda":
            return "cuda:" + str(torch.cuda.get_device_properties(dev).uuid)
        import ray
        return f"{dev.type}:" + ray.get_runtime_context().get_node_id()

    def init_ipc_sync(self, model: str, role: str, peers=()) -> None:
        """weight_sync.backend ipc (engines/sync/ipc_sync.py): "send" on the trainer's rank 0 (one staging
        sender, kept for the job; `peers`: the reader actors), "read" on a worker hosting readers."""
        from ..device import resolve_device
        from ..engines.sync.ipc_receiver import IPCAttachments
        from ..engines.sync.ipc_sender import IPCSender
        from ..engines.sync.ipc_sync import Mailbox
        dev = resolve_device(self.device)
        if role == "send":
            sender = IPCSender(self.sync_cfg.bucket_mb << 20, dev)
            # zero copy: an engine whose exported tensors are its own, unsharded parameters declares
            # the module holding them (`ipc_shareable_module`); sharded engines gather into transients
            # parameters: an engine that offloads them between stages (engines/train/offload.py) frees that memory,
            # which a registered handle would keep alive; it sends packed copies instead
            engine = self.engines.train[model]
            shareable = getattr(engine, "ipc_shareable_module", None)
            module = shareable() if callable(shareable) else None
            if module is not None and not _offloads_params(engine):
                sender.adopt(module)
            self.ipc_senders[model], self.ipc_peers[model] = sender, list(peers)
        elif role == "read":
            self.ipc_mailboxes[model] = Mailbox()
            self.ipc_attach[model] = IPCAttachments(dev)
        else:
            raise ValueError(f"init_ipc_sync: role {role!r}: 'send' or 'read'")

    def ipc_deliver(self, model: str, handles) -> Any:
        """A batch of handles (None at the end) from the trainer, for the thread running this worker's
        `sync_weights` (another actor thread); returns its ack, or at the end its stats."""
        return self.ipc_mailboxes[model].deliver(handles, self._ipc_timeout())

    def _ipc_timeout(self) -> float:
        return max(60.0, 2 * self.stage_timeout_s + 60.0)

    def close_ipc_sync(self) -> None:
        """Unlink the senders' segments and drop the readers' mappings (a killed actor's are removed
        by the sender's reaper process and with the process, respectively)."""
        for s in self.ipc_senders.values():
            with contextlib.suppress(Exception):
                s.close()
        for a in self.ipc_attach.values():
            with contextlib.suppress(Exception):
                a.close()
        self.ipc_senders, self.ipc_attach, self.ipc_mailboxes, self.ipc_peers = {}, {}, {}, {}

    def sync_weights(self, model: str, version: int) -> dict:
        """Publish `model`'s weights as `version` to its readers, a bucket at a time.

        The trainer's ranks export (a sharded engine gathers each bucket: every rank iterates) and
        hand each bucket to their own local readers (a copy in one process); rank 0 also broadcasts it
        to the sync group when readers live elsewhere, whose members load each bucket as it arrives
        (`weight_sync.receive_weights`: big tensors straight into a reader's own where it offers
        them). Nobody holds the whole model twice. With `weight_sync.verify` every side reports a checksum
        of what it sent, received and now serves.
        """
        from ..engines.sync.weight_sync import Checksum
        t0 = time.perf_counter()
        readers = self.engines.readers(model)
        digest = Checksum() if self.sync_cfg.verify else None
        out: dict[str, Any] = {"received": [], "readers": len(readers)}
        with self._writing(model):
            self.engines.wake_weights(model)   # a sleeping rollout's weights back before they are written
            self._sync(model, version, readers, digest, out)
        if digest is not None:
            out["received"] += [c for c in (r.state_checksum() for r in readers) if c is not None]
        out["seconds"] = time.perf_counter() - t0
        return out

    @contextlib.contextmanager
    def _writing(self, model: str):
        """What a sync holds while it writes `model`'s readers. By default the weights lock for writing: the
        rollout's micro-batches in flight end first and new ones wait, so no micro-batch is generated by two
        versions; with long-tailed responses that wait is the longest row in flight, while the slots it
        frees idle. With `partial_rollout` the lock for reading (no engine falls asleep or wakes meanwhile,
        and micro-batches go on) and the rollout engine's `paused`: its calls in flight stop at their next
        decode step and go on with the new weights."""
        lock = self.engines.weights_lock(model)
        rollout = self.engines.rollout.get(model)
        if not self.partial_rollout or rollout is None:
            with lock.writing():   # between the rollout's micro-batches, never inside one
                yield
            return
        with lock.reading(), rollout.paused():
            yield

    def _sync(self, model: str, version: int, readers: list, digest, out: dict) -> None:
        from ..engines.sync.weight_sync import receive_weights
        group = self.sync_groups.get(model)
        if model in self.engines.train:
            engine = self.engines.train[model]
            # the export reads device tensors (an FSDP gather, a CUDA IPC handle): parameters that wait on the
            # host between stages come back for it and leave after; then the cache goes back to the driver
            with engine.holding(False, "sync"):
                self._send(model, engine, version, readers, digest, out, group)
            self.engines.release_cache()
            if digest is not None and self.rank == 0:
                out["sent"] = digest.hexdigest()
        elif model in self.ipc_mailboxes:  # mapped from the trainer's memory into a reader's own
            from ..engines.sync.ipc_receiver import IPCReceiver
            from ..engines.sync.ipc_sync import serve_ipc
            rx = IPCReceiver.for_readers(readers, version, digest, self.ipc_attach[model])
            info = serve_ipc(rx, self.ipc_mailboxes[model], self._ipc_timeout(), finish=rx.finish_readers)
            out["bytes_into_targets"] = info["bytes_into_targets"]
            if digest is not None:
                out["received"].append(digest.hexdigest())
        elif group is not None:  # big tensors straight into a reader's own (`receive_targets`)
            out["bytes_into_targets"] = receive_weights(group, readers, version, digest)["bytes_into_targets"]
            if digest is not None:
                out["received"].append(digest.hexdigest())
        else:
            raise StageError(f"worker group '{self.group}' has no way to get weights of '{model}'")

    def _send(self, model: str, engine, version: int, readers: list, digest, out: dict, group) -> None:
        """The trainer's side: export, hand each bucket to the local readers, and on rank 0 send it on."""
        from ..engines.sync.weight_sync import send_buckets, tee_buckets
        stream = tee_buckets(engine.export_weights(self.sync_cfg.bucket_mb << 20), readers, version, digest)
        if model in self.ipc_senders and self.rank == 0:
            import ray

            from ..engines.sync.ipc_sync import CallChannel, send_ipc
            chans = [CallChannel(lambda x, p=p: p.ipc_deliver.remote(model, x),
                                 lambda ref, t: ray.get(ref, timeout=t)) for p in self.ipc_peers[model]]
            out["transfer"] = send_ipc(self.ipc_senders[model], stream, chans, self._ipc_timeout())
        elif group is not None and self.rank == 0:
            out["transfer"] = send_buckets(group, stream)
        else:
            for _ in stream:  # a sharded engine's other ranks take part in each bucket's gather
                pass


def _offloads_params(engine) -> bool:
    from ..engines.train.offload import PARAMS
    return engine.offloader is not None and PARAMS in engine.offloader.parts

