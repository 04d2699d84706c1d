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
