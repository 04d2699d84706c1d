"""Read back what wandb wrote offline (`WANDB_MODE=offline`): the records of a run's `run-<id>.wandb` file.

wandb 0.31 no longer ships a Python reader of its transaction log (`wandb sync --view` and
`wandb.sdk.internal.datastore` are gone; wandb-core, in Go, reads it). The file is a LevelDB-style log,
as wandb's datastore documents it: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB blocks
of chunks, each `<crc32c: u32, length: u16, type: u8>` + data (type 1 a whole record, 2/3/4 its first,
middle and last pieces; a block's tail under 7 bytes is zero padding). Each record is wandb's own protobuf
`wandb.proto.wandb_internal_pb2.Record`, parsed here with wandb's classes.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a wandb transaction log"
    out, pos, parts = [], HEADER.size, []
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:
            pos += left
            continue
        _, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:   # the zero padding at a block's end
            pos += left
            continue
        if pos + CHUNK.size + length > len(data):   # a chunk still being written
            break
        chunk = data[pos + CHUNK.size:pos + CHUNK.size + length]
        pos += CHUNK.size + length
        if kind == FULL:
            parts = [chunk]
        elif kind == FIRST:
            parts = [chunk]
            continue
        elif kind == MIDDLE:
            parts.append(chunk)
            continue
        else:
            parts.append(chunk)
        r = pb.Record()
        r.ParseFromString(b"".join(parts))
        out.append(r)
    return out


def offline_run(wandb_dir: Path, timeout_s: float = 30.0) -> dict:
    """The one offline run under `wandb_dir`: its project, name, tags, config and history rows.

    wandb-core (a process of its own) writes the file after `run.finish()` returns: it is read again until
    it holds the run's exit record, for at most `timeout_s`."""
    import time
    runs = sorted(Path(wandb_dir).glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run in {wandb_dir}, found {runs}"
    deadline = time.monotonic() + timeout_s
    while True:
        found = records(runs[0])
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out: dict = {"history": [], "config": {}}
    for r in found:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(project=r.run.project, name=r.run.display_name, tags=list(r.run.tags))
            out["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return out
