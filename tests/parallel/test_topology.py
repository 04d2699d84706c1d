"""ProcessTopology (PP outermost, DP, TP innermost), parallel groups, and the dock readers and writers."""
import itertools

import pytest

from mindspeed_rl.parallel import (ProcessTopology, dock_reader_ranks, dock_writer_ranks, parallel_groups,
                                   replica_members)


def test_realhf_docs_example_mfc1_second_node_dp2_tp2_pp2():
    """ReaLHF docs: a 2x8 cluster, MFC#1 on the second node (global ranks 8..15), DP=2, TP=2, PP=2."""
    g = parallel_groups(list(range(8, 16)), dp=2, tp=2, pp=2)
    assert g["pp"] == [[8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["tp"] == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["mapping"] == {0: 8, 1: 9, 2: 10, 3: 11, 4: 12, 5: 13, 6: 14, 7: 15}


def test_realhf_docs_example_mfc2_all_sixteen_dp4_tp4_pp1():
    g = parallel_groups(list(range(16)), dp=4, tp=4, pp=1)
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["dp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["pp"] == [[r] for r in range(16)]
    assert g["mapping"] == {i: i for i in range(16)}


def test_parallel_groups_reads_as_a_dict():
    g = parallel_groups([4, 5], dp=2, tp=1, pp=1)
    assert set(g) == {"dp", "tp", "pp", "mapping"} and len(g) == 4
    assert dict(g) == {"dp": [[4, 5]], "tp": [[4], [5]], "pp": [[4], [5]], "mapping": {0: 4, 1: 5}}
    assert g == dict(g)
    assert g.topology == ProcessTopology(2, 1, 1)
    assert g.global_rank(1) == 5 and g.sub_rank(5) == 1
    with pytest.raises(KeyError, match="keys"):
        g["ep"]
    with pytest.raises(ValueError, match="not one of this MFC's ranks"):
        g.sub_rank(6)


def test_layout_formula_and_coord_round_trip():
    for dp, tp, pp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3)):
        t = ProcessTopology(dp, tp, pp)
        for r in range(t.world_size):
            c = t.coord(r)
            assert r == c.pp * dp * tp + c.dp * tp + c.tp
            assert t.rank(*c) == r and t.rank(pp=c.pp, dp=c.dp, tp=c.tp) == r
        for axis in ("dp", "tp", "pp"):
            groups = t.groups(axis)
            assert sorted(r for grp in groups for r in grp) == list(range(t.world_size))  # a partition
            size = getattr(t, axis)
            assert all(len(grp) == size for grp in groups)
            for grp in groups:  # members differ only along `axis`, in its order
                coords = [t.coord(r) for r in grp]
                assert [getattr(c, axis) for c in coords] == list(range(size))
                others = {tuple(v for k, v in c._asdict().items() if k != axis) for c in coords}
                assert len(others) == 1


def test_groups_use_the_given_global_rank_order():
    g = parallel_groups([10, 11, 2, 3], dp=2, tp=2, pp=1)
    assert g["tp"] == [[10, 11], [2, 3]] and g["dp"] == [[10, 2], [11, 3]]


@pytest.mark.parametrize("args, message", [
    ((list(range(8)), 2, 2, 1), r"dp\*tp\*pp = 2\*2\*1 = 4 but 8 global ranks.*product is 8"),
    ((list(range(4)), 0, 2, 2), r"dp=0 must be an integer >= 1; use 1"),
    ((list(range(4)), 2, -1, 2), r"tp=-1 must be an integer >= 1"),
    ((list(range(4)), 4, 1, 1.0), r"pp=1.0 must be an integer >= 1"),
    (([0, 1, 1, 2], 4, 1, 1), r"global ranks \[1\] are listed more than once"),
    (([0, -1], 2, 1, 1), r"not non-negative integers"),
])
def test_parallel_groups_errors(args, message):
    with pytest.raises(ValueError, match=message):
        parallel_groups(*args)


def test_coord_and_rank_errors():
    t = ProcessTopology(2, 2, 2)
    with pytest.raises(ValueError, match=r"sub_rank=8 is not a rank of topology dp=2 tp=2 pp=2 \(ranks 0-7\)"):
        t.coord(8)
    with pytest.raises(ValueError, match=r"tp=2 is out of range.*tp index 0-1"):
        t.rank(0, 0, 2)
    with pytest.raises(ValueError, match="axis='ep'"):
        t.groups("ep")


@pytest.mark.parametrize("dp, tp, pp, readers, writers", [
    (1, 1, 1, [0], [0]),
    (4, 1, 1, [0, 1, 2, 3], [0, 1, 2, 3]),
    (2, 2, 1, [0, 2], [0, 2]),           # PP=1: the reader also writes
    (2, 2, 2, [0, 2], [4, 6]),
    (1, 2, 4, [0], [6]),
    (3, 1, 2, [0, 1, 2], [3, 4, 5]),
])
def test_dock_readers_and_writers(dp, tp, pp, readers, writers):
    t = ProcessTopology(dp, tp, pp)
    assert dock_reader_ranks(t) == readers
    assert dock_writer_ranks(t) == writers
    for d, (r, w) in enumerate(zip(readers, writers)):
        assert t.coord(r) == (0, d, 0) and t.coord(w) == (pp - 1, d, 0)


def test_replica_members_partition_the_ranks():
    t = ProcessTopology(2, 2, 2)
    assert replica_members(t, 0) == [0, 1, 4, 5]
    assert replica_members(t, 1) == [2, 3, 6, 7]
    assert parallel_groups(list(range(8, 16)), 2, 2, 2).replicas == [[8, 9, 12, 13], [10, 11, 14, 15]]
    for dp, tp, pp in itertools.product((1, 2, 3), (1, 2), (1, 3)):
        t = ProcessTopology(dp, tp, pp)
        members = [replica_members(t, d) for d in range(dp)]
        assert sorted(r for m in members for r in m) == list(range(t.world_size))
        assert all(len(m) == tp * pp for m in members)
        assert all(dock_reader_ranks(t)[d] in m and dock_writer_ranks(t)[d] in m for d, m in enumerate(members))
    with pytest.raises(ValueError, match=r"dp_idx=2 is not a replica.*replicas 0-1"):
        replica_members(ProcessTopology(2, 1, 1), 2)


def test_deployment_roles():
    """A mesh deployment gives each rank its role from the topology's readers and writers (engines/deployment.py)."""
    from mindspeed_rl.engines.deployment import DATA_PARALLEL, MESH, Deployment

    def role(dp, tp, pp, k):
        r = Deployment("mesh", MESH, dp=dp, tp=tp, pp=pp).roles()[k]
        return r.reads, r.writes, r.replica, r.reader, r.writer

    # replica 0: reader 0, writer 4; replica 1: reader 2, writer 6
    assert [role(2, 2, 2, k) for k in (0, 1, 4, 6, 7)] == [(True, False, 0, 0, 4), (False, False, 0, 0, 4),
                                                            (False, True, 0, 0, 4), (False, True, 1, 2, 6),
                                                            (False, False, 1, 2, 6)]
    # PP=1: one rank per replica both reads and writes
    assert role(2, 2, 1, 2) == (True, True, 1, 2, 2) and role(2, 2, 1, 3) == (False, False, 1, 2, 2)
    # exactly one reader and one writer per replica, whatever the shape; the replica's ranks are the topology's
    for dp, tp, pp in itertools.product((1, 2, 3), (1, 2), (1, 2, 3)):
        t = ProcessTopology(dp, tp, pp)
        roles = Deployment("mesh", MESH, dp=dp, tp=tp, pp=pp).roles()
        for d in range(dp):
            mine = [r for r in roles if r.replica == d]
            assert sum(r.reads for r in mine) == 1 and sum(r.writes for r in mine) == 1
            assert {r.reader for r in mine} == {dock_reader_ranks(t)[d]}
            assert {r.replica_ranks for r in mine} == {tuple(replica_members(t, d))}
            assert all(r.split == (tp * pp > 1) and r.dp == dp for r in mine)
    # data parallel: every actor a one-rank replica that reads and writes its own rows
    assert [(r.reads, r.writes, r.replica_ranks, r.split) for r in Deployment("torch", DATA_PARALLEL, dp=2).roles()] \
        == [(True, True, (0,), False), (True, True, (1,), False)]
