"""The same-node shared-memory data plane (`mindspeed_rl/transfer_dock/shm.py`).

The arena and reader are tested in process; the generation handshake, clean-up and reuse across
steps through a real dock actor and worker processes.
"""
from __future__ import annotations

import glob
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from mindspeed_rl.transfer_dock import shm
from mindspeed_rl.transfer_dock.codec import pack, unpack
from mindspeed_rl.transfer_dock.errors import DockValueError

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")


def dock_files(tag: str) -> list[str]:
    return sorted(glob.glob(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{tag}-*")))


@pytest.fixture
def generation(request):
    gen = shm.Generation(f"t{os.getpid()}x{request.node.name[-20:].replace('[', '').replace(']', '')}")
    yield gen
    gen.close()
    assert dock_files(gen.tag) == []


def rows(step: int, n: int = 4, length: int = 1000) -> list[torch.Tensor]:
    return [torch.full((length + r,), float(100 * step + r)) for r in range(n)]


# ---------------------------------------------------------------------- in process
def test_a_block_round_trips_through_shared_memory_zero_copy(generation):
    arena = shm.ShmArena(generation.tag, generation.path, "node")
    sent = rows(0) + [torch.arange(3, dtype=torch.float32)]
    desc = arena.write(pack(sent))
    assert desc.generation == 0 and desc.kind == "torch.float32" and list(desc.numel) == [len(r) for r in sent]
    assert len(pickle.dumps(desc)) < 1000, "the descriptor, not the bytes, travels"
    block = shm.ShmReader().block(desc)
    assert not block.flat.flags.writeable, "zero-copy rows are views of the producer's segment"
    got = unpack(block, copy=False)
    assert all(torch.equal(a, b) for a, b in zip(got, sent))
    picked = unpack(block.take([4, 1]))  # reordered rows: one private copy
    assert torch.equal(picked[0], sent[4]) and torch.equal(picked[1], sent[1])


def test_bfloat16_and_numpy_rows_keep_their_types(generation):
    arena, reader = shm.ShmArena(generation.tag, generation.path, "node"), shm.ShmReader()
    bf = [torch.randn(5).to(torch.bfloat16), torch.randn(2).to(torch.bfloat16)]
    got = unpack(reader.block(arena.write(pack(bf))))
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, b) for g, b in zip(got, bf))
    arrays = [np.arange(4, dtype=np.int32), np.arange(2, dtype=np.int32)]
    got = unpack(reader.block(arena.write(pack(arrays))))
    assert all(isinstance(g, np.ndarray) and g.dtype == np.int32 and (g == a).all() for g, a in zip(got, arrays))


def test_the_descriptor_pickles_as_plain_values_and_round_trips(generation):
    """Each consumer's get pickles and unpickles one descriptor per column: a numpy array inside
    cost ~75 us of the dock's and the consumer's CPU per get; plain bytes cost a few."""
    desc = shm.ShmArena(generation.tag, generation.path, "node").write(pack(rows(0)))
    blob = pickle.dumps(desc, pickle.HIGHEST_PROTOCOL)
    assert b"numpy" not in blob, "numel travels as bytes, not as a pickled numpy array"
    back = pickle.loads(blob)
    assert (back.segment, back.offset, back.dtype, back.torch_dtype, back.generation, back.node_id) == (
        desc.segment, desc.offset, desc.dtype, desc.torch_dtype, desc.generation, desc.node_id)
    assert back.numel.tolist() == desc.numel.tolist() == [1000, 1001, 1002, 1003]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16, "numpy"])
def test_zero_copy_rows_are_views_of_the_segment_equal_to_unpack(generation, dtype):
    """`ShmReader.rows` (the fast path of a copy=False get) gives what unpack gives, as views."""
    arena, reader = shm.ShmArena(generation.tag, generation.path, "node"), shm.ShmReader()
    arena.write(pack([torch.ones(3)]))  # the block below then starts past the segment's start
    if dtype == "numpy":
        sent = [np.arange(n, dtype=np.int32) for n in (5, 0, 2)]
    else:
        sent = [(torch.randn(n) * 100).to(dtype) for n in (5, 0, 2, 7)]
    desc = arena.write(pack(sent))
    got, want = reader.rows(desc), unpack(reader.block(desc), copy=False)
    assert len(got) == len(want) == len(sent)
    for g, w, s in zip(got, want, sent):
        assert type(g) is type(s) and g.dtype == s.dtype and g.shape == s.shape
        assert (g == s).all() and (w == s).all()
    if dtype != "numpy":
        seg = reader._tensors[desc.segment]
        assert got[0].data_ptr() == seg.data_ptr() + desc.offset, "a view of the segment, not a copy"
        assert got[2].data_ptr() == got[0].data_ptr() + 5 * got[0].element_size()


def test_a_new_generation_reuses_the_segments_from_the_start(generation):
    arena, reader = shm.ShmArena(generation.tag, generation.path, "node"), shm.ShmReader()
    first = [arena.write(pack(rows(0))) for _ in range(3)]
    assert len({(d.segment, d.offset) for d in first}) == 3, "one generation never reuses bytes"
    size = arena.nbytes
    generation.bump()
    second = arena.write(pack(rows(1)))
    assert (second.segment, second.offset, second.generation) == (first[0].segment, first[0].offset, 1)
    assert torch.equal(unpack(reader.block(second))[2], rows(1)[2])
    for step in range(2, 30):  # many cleared steps: the arena does not grow
        generation.bump()
        arena.write(pack(rows(step)))
    assert arena.nbytes == size


def test_a_block_larger_than_a_segment_gets_its_own(generation):
    arena, reader = shm.ShmArena(generation.tag, generation.path, "node"), shm.ShmReader()
    small = arena.write(pack(rows(0, n=1, length=10)))
    big_rows = [torch.ones(shm.MIN_SEGMENT_BYTES // 4 + 5)]
    big = arena.write(pack(big_rows))
    assert big.segment != small.segment
    assert torch.equal(unpack(reader.block(big))[0], big_rows[0])
    assert torch.equal(unpack(reader.block(small))[0], rows(0, n=1, length=10)[0])


def test_a_segment_that_is_not_here_is_a_clear_error(generation):
    arena = shm.ShmArena(generation.tag, generation.path, "node-a")
    desc = arena.write(pack(rows(0)))
    desc.segment += "-elsewhere"
    with pytest.raises(DockValueError, match=r"node-a.*data_plane='ray'"):
        shm.ShmReader().block(desc)


def test_files_of_a_dead_dock_are_removed_and_a_live_docks_are_kept(generation):
    shm.ShmArena(generation.tag, generation.path, "node").write(pack(rows(0)))
    assert len(dock_files(generation.tag)) == 2  # the generation file and one segment
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    tag = f"dead{dead_pid}"
    for name in (f"{tag}-gen-{dead_pid}", f"{tag}-{dead_pid}-0"):
        open(os.path.join(shm.SHM_DIR, shm.PREFIX + name), "wb").close()
    assert shm.remove_stale_files() == 2
    assert dock_files(tag) == [] and len(dock_files(generation.tag)) == 2


# ---------------------------------------------------------------------- through the dock actor
ray = pytest.importorskip("ray")


@pytest.fixture
def shm_dock(ray_session):
    from mindspeed_rl.transfer_dock import create_transfer_dock
    docks = []

    def make(*args, **kwargs):
        d = create_transfer_dock(*args, inline_bytes=1024, data_plane="shm", **kwargs)
        docks.append(d)
        return d
    yield make
    for d in docks:
        d.close()
        ray_session.kill(d.actor, no_restart=True)


@ray.remote(num_cpus=0.1)
class Producer:
    def put_step(self, client, step: int, n: int, length: int) -> None:
        client.put_experience({"x": rows(step, n, length)}, list(range(n)), wait=False)
        client.flush()


@pytest.mark.slow
def test_steps_through_the_actor_reuse_one_arena_and_close_frees_it(ray_session, shm_dock):
    dock = shm_dock(["x"], ["c"], 4)
    assert dock.data_plane == "shm"
    producer = Producer.remote()
    try:
        sizes = []
        for step in range(6):
            ray.get(producer.put_step.remote(dock, step, 4, 64 * 1024))
            out, got = dock.get_experience("c", ["x"], 4, copy=False)
            assert sorted(got) == [0, 1, 2, 3]
            for r, v in zip(got, out["x"]):
                assert torch.equal(v, rows(step, 4, 64 * 1024)[r]), f"step {step} row {r}"
            tag = dock.shm_info["tag"]
            sizes.append(sum(os.path.getsize(p) for p in dock_files(tag)))
            dock.clear()
        assert len(set(sizes)) == 1, f"shared memory grew over cleared steps: {sizes}"
        assert sizes[0] < 8 * 4 * 64 * 1024 * 4, sizes
        dock.close()
        assert dock_files(tag) == []
    finally:
        ray_session.kill(producer)


@pytest.mark.slow
def test_a_consumer_on_another_node_gets_shared_memory_rows_as_bytes(ray_session, shm_dock, monkeypatch):
    """A consumer whose node is not the dock's cannot map the segments: its get says so and the dock
    reads the rows for it. Another node is this process with the dock's node id changed in its copy of
    the client (no local channel or claims there either), and shared-memory reads made unusable here."""
    import copy

    import mindspeed_rl.transfer_dock.client as client_mod
    dock = shm_dock(["x"], ["c"], 4)
    producer = Producer.remote()
    try:
        ray.get(producer.put_step.remote(dock, 3, 4, 64 * 1024))
        elsewhere = copy.copy(dock)
        elsewhere.shm_info = {**dock.shm_info, "node_id": "another-node"}
        elsewhere.channel_info = elsewhere.claims_info = None

        def no_segments():
            raise AssertionError("a consumer on another node mapped a segment")
        monkeypatch.setattr(client_mod.shm, "reader", no_segments)
        for copy_rows in (False, True):
            out, got = elsewhere.get_experience("c", ["x"], 2, copy=copy_rows)
            assert all(torch.equal(v, rows(3, 4, 64 * 1024)[r]) for r, v in zip(got, out["x"]))
        assert dock.all_consumed("c")
    finally:
        ray_session.kill(producer)


@pytest.mark.slow
def test_a_put_written_before_clear_is_refused_and_changes_nothing(ray_session, shm_dock):
    dock = shm_dock(["x"], ["c"], 2)
    info = dock.shm_info
    arena = shm.arena_for(info["tag"], info["gen_path"], info["node_id"])
    stale = arena.write(pack(rows(0, n=2)))
    dock.clear()  # the step ends before the put arrives
    blob = pickle.dumps(({"x": stale}, [0, 1], False, None))
    with pytest.raises(ray.exceptions.RayTaskError, match="generation 0, but the dock has generation 1"):
        ray.get(dock.actor.put.remote(blob))
    assert dock.get_column_status()["x"]["written"] == 0
    dock.put_experience({"x": rows(1, n=2)}, [0, 1])  # a put made now goes in
    out, got = dock.get_experience("c", ["x"], 2)
    assert torch.equal(out["x"][got.index(1)], rows(1, n=2)[1])


@pytest.mark.slow
def test_state_dict_reads_shared_memory_rows_into_real_tensors(ray_session, shm_dock):
    dock = shm_dock(["x"], ["c"], 3)
    dock.put_experience({"x": rows(7, n=3)}, [0, 1, 2])
    state = dock.state_dict()
    dock.close()  # the segments are gone; the state must not need them
    assert all(torch.equal(state["cells"]["x"][r], rows(7, n=3)[r]) for r in range(3))
