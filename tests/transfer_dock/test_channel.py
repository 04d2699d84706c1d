"""The dock's local channel (`mindspeed_rl/transfer_dock/channel.py`).

In process: a real Unix-socket server on an asyncio loop in a thread, real blocking connections.
Through Ray: a real dock actor, its callers on this node, and what happens when the actor dies.
"""
from __future__ import annotations

import asyncio
import glob
import os
import select
import threading
import time

import pytest
import torch

from mindspeed_rl.transfer_dock import channel, shm
from mindspeed_rl.transfer_dock.errors import DockError, DockKeyError, DockValueError

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm for the socket")


class LoopServer:
    """`channel.serve` on an event loop in a background thread (as the dock actor runs it)."""

    def __init__(self, handlers: dict, direct: dict | None = None) -> None:
        self.path = channel.socket_path(shm.SHM_DIR, f"test{os.getpid()}x{id(self):x}", os.getpid())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(channel.serve(self.path, handlers, direct), self.loop).result(10)

    def stop(self) -> None:
        async def shut():  # end every connection's task while the loop still runs
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


@pytest.fixture
def server():
    gate = asyncio.Event()
    log: list = []

    async def echo(x):
        log.append(x)
        return x

    async def wait_gate(x):  # answers only once `open_gate` ran
        await gate.wait()
        return x

    async def open_gate():
        gate.set()

    async def fail_dock():
        raise DockKeyError("column 'nope' is not in the dock")

    async def fail_bug():
        return {}["missing"]

    async def raw():
        return channel.Raw(b"\x80\x05K\x07.")  # pickle of 7, sent as is

    async def big(n):
        return bytes(n)

    srv = LoopServer({"echo": echo, "wait_gate": wait_gate, "open_gate": open_gate, "fail_dock": fail_dock,
                      "fail_bug": fail_bug, "raw": raw, "big": big})
    srv.log = log
    yield srv
    srv.stop()


def test_the_socket_is_private_to_its_user(server):
    assert os.stat(server.path).st_mode & 0o777 == 0o600


def test_answers_come_back_to_their_request_even_out_of_order(server):
    conn = channel.Connection(server.path)
    held = conn.send("wait_gate", ("first",))  # answered last
    later = [conn.send("echo", (i,)) for i in range(5)]
    assert [conn.result(rid, 5.0) for rid in reversed(later)] == [4, 3, 2, 1, 0]
    assert not conn.done(held), "a get still waiting must not block the calls sent after it"
    conn.result(conn.send("open_gate", ()), 5.0)
    assert conn.result(held, 5.0) == "first"
    assert server.log == [0, 1, 2, 3, 4], "requests run in the order sent"


def test_the_dock_errors_arrive_as_themselves_and_bugs_with_the_actors_traceback(server):
    conn = channel.Connection(server.path)
    with pytest.raises(DockKeyError, match="column 'nope'"):
        conn.result(conn.send("fail_dock", ()), 5.0)
    with pytest.raises(RuntimeError, match=r"KeyError: 'missing'[\s\S]*fail_bug"):
        conn.result(conn.send("fail_bug", ()), 5.0)
    with pytest.raises(DockError, match=r"no method 'nope'.*echo"):
        conn.result(conn.send("nope", ()), 5.0)
    assert conn.result(conn.send("echo", ("still fine",)), 5.0) == "still fine"


def test_raw_and_large_answers(server):
    conn = channel.Connection(server.path)
    assert bytes(conn.result(conn.send("raw", ()), 5.0)) == b"\x80\x05K\x07."
    n = 20 << 20  # larger than any socket buffer: read in many pieces
    assert len(conn.result(conn.send("big", (n,)), 30.0)) == n
    payload = torch.arange(1 << 20).numpy()  # a large request too
    assert (conn.result(conn.send("echo", (payload,)), 30.0) == payload).all()


def test_a_wait_past_its_timeout_raises_and_the_connection_stays_usable(server):
    conn = channel.Connection(server.path)
    held = conn.send("wait_gate", ("late",))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="get_experience.. got no answer from the dock in 0 s"):
        conn.result(held, 0.3, what="get_experience()")
    assert 0.25 < time.monotonic() - t0 < 5.0
    conn.result(conn.send("open_gate", ()), 5.0)
    assert conn.result(held, 5.0) == "late", "the answer that came late is still delivered"


def test_direct_calls_are_answered_on_the_connection_thread_while_the_loop_is_busy():
    """Why the dock answers most calls on the connection's own thread: no turn of the event loop
    per call. A direct handler's `LATER` hands the call to the loop's handler of that name, and
    the calls behind it are still answered at once."""
    async def maybe(x):
        return ("loop", x)

    srv = LoopServer({"maybe": maybe}, direct={"twice": lambda x: 2 * x,
                                               "maybe": lambda x: channel.LATER if x < 0 else ("thread", x)})
    stuck, release = threading.Event(), threading.Event()

    def hold_the_loop():  # the loop thread is stuck here until the test releases it
        stuck.set()
        release.wait(30.0)

    try:
        conn = channel.Connection(srv.path)
        assert conn.result(conn.send("maybe", (-1,)), 5.0) == ("loop", -1)
        srv.loop.call_soon_threadsafe(hold_the_loop)
        assert stuck.wait(10.0), "the event loop never ran the callback that holds it"
        later = conn.send("maybe", (-2,))  # goes to the loop: answered once it is free
        # answered while the loop is provably held: a call that needed the loop would time out here
        assert conn.result(conn.send("twice", (21,)), 5.0) == 42, "direct calls must not wait for the event loop"
        assert conn.result(conn.send("maybe", (3,)), 5.0) == ("thread", 3)
        assert not release.is_set() and not conn.done(later), "the loop's call was answered while the loop was held"
        release.set()
        assert conn.result(later, 10.0) == ("loop", -2)
        with pytest.raises(DockError, match=r"no method 'nope'.*maybe, twice"):
            conn.result(conn.send("nope", ()), 5.0)
    finally:
        release.set()
        srv.stop()


SERVER_PROCESS = """
import asyncio, sys
from mindspeed_rl.transfer_dock import channel
async def main():
    async def never():
        await asyncio.Event().wait()
    async def echo(x):
        return x
    await channel.serve(sys.argv[1], {"never": never, "echo": echo})
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


@pytest.mark.slow
def test_a_killed_server_is_a_clear_error_not_a_hang(tmp_path):
    import signal
    import subprocess
    import sys
    path = channel.socket_path(shm.SHM_DIR, f"test{os.getpid()}xkill", os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", SERVER_PROCESS, path], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert proc.stdout.readline().strip() == "ready"
        conn = channel.Connection(path)
        assert conn.result(conn.send("echo", (1,)), 10.0) == 1
        held = conn.send("never", ())
        os.kill(proc.pid, signal.SIGKILL)  # as `ray.kill` ends a dock actor
        proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(channel.ChannelError, match="died or was killed"):
            conn.result(held, 30.0)
        with pytest.raises(channel.ChannelError):  # and every later call says so at once
            conn.send("echo", (1,))
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(OSError):
            channel.Connection(path)  # nobody listens: a new client falls back to Ray calls
    finally:
        proc.kill()
        if os.path.exists(path):
            os.unlink(path)


def test_threads_sharing_a_connection_each_get_their_own_answers(server):
    conn = channel.Connection(server.path)
    errors: list = []

    def worker(k: int) -> None:
        try:
            for i in range(200):
                assert conn.result(conn.send("echo", ((k, i),)), 10.0) == (k, i)
        except BaseException as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]


# ---------------------------------------------------------------------- through a dock actor
@pytest.mark.slow
@pytest.mark.ray
def test_the_dock_actor_serves_its_node_over_the_channel_and_dies_loudly(ray_session):
    from mindspeed_rl.transfer_dock import create_transfer_dock

    dock = create_transfer_dock(["x"], ["c"], prompts_num=4)
    try:
        assert dock.channel_info is not None and os.path.exists(dock.channel_info["path"])
        dock.put_experience({"x": [torch.ones(3)] * 4}, range(4))
        conn = dock._connection()
        assert conn is not None, "this process is on the dock's node: it should use the channel"
        _, rows = dock.get_experience("c", ["x"], 4)
        assert sorted(rows) == [0, 1, 2, 3]
        with pytest.raises(DockValueError, match="already written"):
            dock.put_experience({"x": [torch.ones(3)]}, [0])
    finally:
        dock.close()
    assert not os.path.exists(dock.channel_info["path"]), "close() removes the socket"
    assert dock.get_consumer_status()["c"]["taken"] == 4, "an open connection outlives close()"
    ray_session.kill(dock.actor, no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(channel.ChannelError, match="died or was killed"):
        for _ in range(50):  # the kill takes effect within a few calls
            dock.get_consumer_status()
            time.sleep(0.1)
    assert time.monotonic() - t0 < 10.0


@pytest.mark.slow
@pytest.mark.ray
def test_calls_keep_their_order_across_the_channel_and_ray_and_refs_come_back_through_ray(ray_session):
    """A put that carries Ray object references goes as a Ray call, the rest over the channel:
    a failed put pending on one path is raised before anything is sent on the other, and a get
    whose rows are Ray objects still arrives whole (the reply is held and fetched through Ray)."""
    from mindspeed_rl.transfer_dock import create_transfer_dock

    dock = create_transfer_dock(["small", "big"], ["c"], prompts_num=4, inline_bytes=1024, data_plane="ray")
    try:
        small, big = [torch.full((2,), float(r)) for r in range(4)], [torch.full((1000,), float(r)) for r in range(4)]
        dock.put_experience({"small": small}, range(4), wait=False)  # over the channel
        dock.put_experience({"small": small[:1]}, [0], wait=False)  # written twice: refused, later
        with pytest.raises(DockValueError, match="already written"):
            dock.put_experience({"big": big}, range(4), wait=False)  # by reference: a Ray call
        assert dock.get_column_status()["big"]["written"] == 0, "the Ray put was not sent after the error"
        dock.put_experience({"big": big}, range(4), wait=False)
        out, rows = dock.get_experience("c", ["small", "big"], 4, blocking=True, timeout=30.0)
        assert sorted(rows) == [0, 1, 2, 3]
        for r, s_, b in zip(rows, out["small"], out["big"]):
            assert torch.equal(s_, small[r]) and torch.equal(b, big[r])
    finally:
        dock.close()
        ray_session.kill(dock.actor, no_restart=True)


@pytest.mark.slow
@pytest.mark.ray
def test_a_get_waiting_on_the_loop_wakes_at_a_put_answered_on_a_connection_thread(ray_session):
    """A blocking get that finds no rows waits on the actor's event loop; puts over the channel are
    stored by a connection thread, which must wake it (or it would sleep to its timeout).

    With guarantee_order every attempt of the get looks at row 0 and counts it in the dock's
    rows_examined (and the consumer claims nothing locally): the connection thread's attempt counts
    1, then it hands the get to the loop, whose attempt counts 2 before it waits. So at 2 the get
    is at the loop, and the put below is the one that must wake it."""
    from mindspeed_rl.transfer_dock import create_transfer_dock

    dock = create_transfer_dock(["x"], ["c"], prompts_num=4, guarantee_order=True)
    try:
        pending = dock.get_experience_async("c", ["x"], 4, blocking=True, timeout=20.0)
        deadline = time.monotonic() + 30.0
        while dock.get_metrics()["rows_examined"] < 2:  # the get reaches the loop and waits there
            assert time.monotonic() < deadline, f"the get never reached the loop: {dock.get_metrics()}"
            time.sleep(0.01)
        assert dock.get_metrics()["rows_examined"] == 2, "the get made more attempts than the two before waiting"
        producer = threading.Thread(target=dock.put_experience, args=({"x": [torch.ones(2)] * 4}, range(4)))
        t0 = time.monotonic()
        producer.start()  # its own connection (one per thread)
        producer.join(30)
        _, rows = pending.result()
        assert sorted(rows) == [0, 1, 2, 3] and time.monotonic() - t0 < 10.0
        assert dock.get_experience("c", ["x"], 4) == ({}, []), "each row once"
    finally:
        dock.close()
        ray_session.kill(dock.actor, no_restart=True)


@pytest.mark.slow
@pytest.mark.ray
def test_close_frees_the_files_even_with_a_failed_put_pending(ray_session):
    from mindspeed_rl.transfer_dock import create_transfer_dock

    dock = create_transfer_dock(["x"], ["c"], prompts_num=2, inline_bytes=0)
    try:
        dock.put_experience({"x": [torch.ones(8)] * 2}, range(2))
        dock.put_experience({"x": [torch.ones(8)]}, [0], wait=False)  # written twice: refused
        paths = [dock.channel_info["path"], dock.shm_info["gen_path"]]
        assert all(os.path.exists(p) for p in paths)
        dock.close()  # the refused put's answer is nobody's business any more
        assert not any(os.path.exists(p) for p in paths)
        assert not glob.glob(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{dock.shm_info['tag']}-*"))
    finally:
        ray_session.kill(dock.actor, no_restart=True)


@pytest.mark.slow
@pytest.mark.ray
def test_a_forked_child_opens_its_own_connection(ray_session):
    """Two processes reading one socket would steal each other's answers."""
    from mindspeed_rl.transfer_dock import create_transfer_dock

    dock = create_transfer_dock(["x"], ["c"], prompts_num=8)
    try:
        dock.put_experience({"x": [torch.ones(2)] * 4}, range(4))
        parent_conn = dock._connection()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own connection, its own answers
            ok = 0
            try:
                ok = int(dock._connection() is not parent_conn and len(dock.get_experience("c", ["x"], 2)[1]) == 2)
            finally:
                os.write(write, bytes([ok]))
                os._exit(0)
        os.close(write)
        if not select.select([read], [], [], 30.0)[0]:  # never hang on a stuck child
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not answer in 30 s")
        assert os.read(read, 1) == b"\x01", "the child did not get its rows over a connection of its own"
        os.waitpid(pid, 0)
        _, rows = dock.get_experience("c", ["x"], 2)  # the parent's connection still answers right
        assert len(rows) == 2 and dock.get_consumer_status()["c"]["taken"] == 4
    finally:
        dock.close()
        ray_session.kill(dock.actor, no_restart=True)
