"""A worker's threads split among the stages computing at once (workers/cores.py)."""
import threading

import torch

from mindspeed_rl.workers.cores import CoreShare, thread_share


def test_thread_share_splits_the_threads_and_leaves_each_stage_one():
    assert [thread_share(2, n) for n in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert [thread_share(4, n) for n in (1, 2, 3, 4, 5)] == [4, 2, 1, 1, 1]


def test_a_stage_computing_beside_another_takes_half_and_alone_takes_all():
    cores = CoreShare(2)
    first_in, second_done, seen = threading.Event(), threading.Event(), {}

    def first():
        cores.computing()
        seen["first alone"] = torch.get_num_threads()
        first_in.set()
        second_done.wait(10)
        cores.waiting()

    def second():
        first_in.wait(10)
        cores.computing()
        seen["second beside first"] = torch.get_num_threads()
        cores.waiting()
        second_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"first alone": 2, "second beside first": 1}
    cores.computing()   # both waiting again: the next micro-batch has them all
    assert torch.get_num_threads() == 2
    cores.waiting()


def test_bind_process_binds_every_thread_and_what_the_process_starts_later():
    """placement.groups.<g>.cpu_affinity: a thread started before the binding (as Ray's are before an actor's
    constructor) is bound too, and a process started after it (vLLM's engine core) inherits the cores."""
    import subprocess
    import sys

    script = """
import os, threading, time, subprocess, sys
from mindspeed_rl.workers.cores import bind_process
stop = threading.Event()
earlier = threading.Thread(target=stop.wait); earlier.start()
bind_process([0])
tasks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True).stdout.strip()
stop.set(); earlier.join()
print(len(tasks), all(c == {0} for c in tasks.values()), child)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    threads, all_bound, child = out.stdout.split(maxsplit=2)
    assert int(threads) >= 2 and all_bound == "True" and child.strip() == "[0]", out.stdout
