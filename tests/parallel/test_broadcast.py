"""broadcast_micro_batch for real: 4 gloo ranks on CPU, two replicas broadcasting at once.

Topology dp=2, tp=2 (ranks 0,1 | 2,3; readers 0 and 2), then dp=1, tp=2, pp=2 (all four ranks,
reader 0). The ranks run in `_broadcast_ranks` (a launcher forks them); the checks are here.
"""
import os
import subprocess
import sys

import pytest
import torch

from mindspeed_rl.parallel.broadcast import _header

from . import _broadcast_ranks as R

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_same_batch(got, rows, expected):
    batch, exp_rows = expected
    assert rows == exp_rows
    assert list(got) == list(batch)
    for col, exp in batch.items():
        assert len(got[col]) == len(exp), col
        for g, e in zip(got[col], exp):
            assert g.dtype == e.dtype and g.shape == e.shape, col
            assert torch.equal(g, e), col


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("broadcast")
    proc = subprocess.run([sys.executable, "-m", "tests.parallel._broadcast_ranks", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=R.RANKS_TIMEOUT_S + 30)
    results = []
    for r in range(R.WORLD):
        path = out / f"rank{r}.pt"
        assert path.is_file(), f"rank {r} wrote no result (launcher rc {proc.returncode}):\n{proc.stderr[-3000:]}"
        res = torch.load(path, weights_only=False)
        assert res["ok"], f"rank {r} raised:\n{res['error']}"
        results.append(res["value"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


@pytest.mark.slow
def test_two_replicas_each_get_their_readers_micro_batches(ranks):
    roles = [ranks[r]["dp2tp2"]["role"] for r in range(4)]
    assert [(r.reads, r.writes, r.replica, r.reader) for r in roles] == [
        (True, True, 0, 0), (False, False, 0, 0), (True, True, 1, 2), (False, False, 1, 2)]
    for r in range(4):
        replica = roles[r].replica
        got = ranks[r]["dp2tp2"]["got"]
        assert len(got) == 3
        kind, batch, rows = got[0]
        assert kind == "ok"
        assert_same_batch(batch, rows, R.SENT["dp2tp2"][replica][0]())
        assert got[1] == ("ok", {}, [])  # the empty micro-batch: end of step


@pytest.mark.slow
def test_received_rows_keep_lengths_and_dtypes(ranks):
    kind, batch, rows = ranks[3]["dp2tp2"]["got"][0]  # a receiver of replica 1
    assert rows == [3, 4, 5, 6]
    assert [t.numel() for t in batch["responses"]] == [4, 0, 6, 2]
    assert {c: batch[c][0].dtype for c in batch} == {"responses": torch.int64, "old_log_prob": torch.float32,
                                                      "ref_log_prob": torch.bfloat16, "response_mask": torch.bool}


@pytest.mark.slow
def test_a_bad_batch_raises_on_every_rank_of_its_replica_only(ranks):
    for r in (0, 1):  # replica 0 sent a 2-D row
        kind, message = ranks[r]["dp2tp2"]["got"][2]
        assert kind == "error"
        assert "from rank 0" in message and "column 'responses' row 0 is a 2-D tensor" in message
    for r in (2, 3):  # replica 1 sent columns with no rows: they arrive as empty columns
        assert ranks[r]["dp2tp2"]["got"][2] == ("ok", {"responses": [], "response_mask": []}, [])


@pytest.mark.slow
def test_pp2_replica_spans_all_stages(ranks):
    roles = [ranks[r]["dp1tp2pp2"]["role"] for r in range(4)]
    assert [(x.reads, x.writes) for x in roles] == [(True, False), (False, False), (False, True), (False, False)]
    for r in range(4):
        got = ranks[r]["dp1tp2pp2"]["got"]
        assert_same_batch(got[0][1], got[0][2], R.SENT["dp1tp2pp2"][0][0]())
        assert got[1] == ("ok", {}, [])


@pytest.mark.parametrize("batch, rows, message", [
    (None, [], "batch=NoneType on the source rank"),
    ({}, None, "rows=None"),
    ({"a": torch.zeros(3)}, [0], "column 'a' is a Tensor; give a list"),
    ({"a": [torch.zeros(3)]}, [0, 1], "column 'a' has 1 rows but rows lists 2"),
    ({"a": [torch.zeros(3, dtype=torch.float64)]}, [0], "dtype torch.float64; supported dtypes"),
    ({"a": [torch.zeros(3), torch.zeros(2, dtype=torch.int64)]}, [0, 1], "mixes dtypes"),
    ({"a": [[1, 2]]}, [0], "row 0 is a list; every row must be a 1-D tensor"),
])
def test_header_rejects_bad_batches(batch, rows, message):
    assert message in _header(batch, rows)["error"]


def test_header_describes_the_batch():
    batch = {"ids": [torch.arange(3), torch.arange(0)], "mask": [torch.ones(3, dtype=torch.bool)] * 2}
    assert _header(batch, [7, 8]) == {"columns": [("ids", "int64", [3, 0]), ("mask", "bool", [3, 3])],
                                      "rows": [7, 8]}
