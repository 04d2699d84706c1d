"""DeviceMesh: the spec forms a config may use, and the whole-hosts-or-aligned-slice rule."""
import pytest

from mindspeed_rl.parallel import DeviceMesh, format_ids


def mesh(spec, n_nodes=2, per=8):
    return DeviceMesh.from_spec(spec, n_nodes, per)


@pytest.mark.parametrize("spec, devices", [
    ("all", list(range(16))),
    (" ALL ", list(range(16))),
    ([0, 1], [0, 1]),
    ((3, 2), [2, 3]),
    (5, [5]),
    ("4-7", [4, 5, 6, 7]),
    ("0,1,2,3", [0, 1, 2, 3]),
    ("8-11", [8, 9, 10, 11]),
    ("node1:0-3", [8, 9, 10, 11]),
    ("node1:4,5", [12, 13]),
    ("NODE0:6-7", [6, 7]),
    ("node1", list(range(8, 16))),
    ("node0-1", list(range(16))),
    ("0-7,8-15", list(range(16))),
])
def test_spec_forms(spec, devices):
    m = mesh(spec)
    assert m.devices == devices
    assert m.size == len(devices)
    assert DeviceMesh.from_spec(m.spec, 2, 8) == m  # the readable form reads back


def test_whole_and_properties():
    m = DeviceMesh.whole(2, 8)
    assert m.devices == list(range(16)) and m.nodes == [0, 1] and m.whole_hosts and m.spec == "all"
    part = mesh("node1:2-3")
    assert part.nodes == [1] and part.local_devices(1) == [2, 3] and not part.whole_hosts
    assert str(part) == "node1:2-3 (devices 10-11)"
    assert str(mesh("node1")) == "node1 (devices 8-15)"
    assert 10 in part and 9 not in part
    assert DeviceMesh.from_spec(part, 2, 8) is part


def test_overlaps():
    a, b, c = mesh("0-3"), mesh("2-3"), mesh("4-7")
    assert a.overlaps(b) and b.overlaps(a)
    assert not a.overlaps(c)
    assert mesh("all").overlaps(mesh("node1:6-7"))
    with pytest.raises(ValueError, match="same cluster"):
        a.overlaps(DeviceMesh.from_spec("0-3", 1, 4))


def test_whole_hosts_with_a_gap_round_trip():
    m = DeviceMesh.from_spec(list(range(0, 4)) + list(range(8, 12)), 3, 4)
    assert m.nodes == [0, 2] and m.spec == "0-3,8-11"
    assert DeviceMesh.from_spec(m.spec, 3, 4) == m


def test_every_aligned_slice_of_an_8_device_host_is_valid():
    for size in (1, 2, 4, 8):
        for start in range(0, 8, size):
            assert mesh(list(range(start, start + size)), 1, 8).size == size


@pytest.mark.parametrize("spec, message", [
    ([1, 2], r"start at local device 1, which is not a multiple of the mesh size 2.*node0:0-1 or node0:2-3"),
    ([0, 1, 2], r"size 3 does not divide the 8 devices.*\(1, 2, 4, 8\)"),
    ([6, 7, 8, 9], r"cross hosts.*nodes 0-1.*whole hosts \(e.g. 'node0-1'\)"),
    ([0, 2], r"not consecutive"),
    ([0, 16], r"\[16\] are outside the cluster of 2 node\(s\) x 8 devices \(global ids 0-15\)"),
    ([-1], r"outside the cluster"),
    ([3, 3], r"\[3\] are listed more than once"),
    ([], r"no devices"),
    ("node2", r"node 2 is outside the cluster of 2 node\(s\)"),
    ("node1:6-9", r"local devices \[8, 9\] do not exist on a host of 8 devices"),
    ("node0-1:0-3", r"local devices can follow one node only"),
    ("node1-0", r"runs backwards"),
    ("7-4", r"runs backwards"),
    ("gpus", r"cannot read 'gpus'.*'node1:0-3'"),
    ("", r"empty"),
    (True, r"boolean"),
    (2.5, r"type float"),
    (["0", 1], r"not integers"),
])
def test_invalid_meshes_say_which_rule_and_how_to_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        mesh(spec)


def test_bad_cluster_shape():
    with pytest.raises(ValueError, match="n_devices_per_node=0 must be an integer >= 1"):
        DeviceMesh.whole(1, 0)
    with pytest.raises(ValueError, match="belongs to a 2x8 cluster, not 1x8"):
        DeviceMesh.from_spec(mesh("0-1"), 1, 8)


def test_format_ids():
    assert format_ids([3, 0, 1, 2, 7, 6, 9]) == "0-3,6-7,9"
    assert format_ids([5]) == "5"
    assert format_ids([]) == ""
