"""Per-MFC placement: the ReaLHF PPO example on 1 node x 8 devices, the YAML entry, the checks."""
import pytest

from mindspeed_rl.parallel import ClusterSpec, DeviceMesh, MFCPlacement, plan_placement

# ReaLHF's PPO allocation example: generation on the whole node, the smaller calls on slices of it
PPO_MFCS = {
    "actor_gen": {"mesh": "all", "dp": 4, "tp": 1, "pp": 2},
    "critic_inf": {"mesh": [0, 1], "dp": 2},
    "rew_inf": {"mesh": "2-3", "dp": 2},
    "ref_inf": {"mesh": "node0:4-7", "dp": 4},
    "critic_train": {"mesh": "4-7", "dp": 2, "pp": 2},
    "actor_train": {"mesh": "0,1,2,3", "dp": 4},
}
PPO_ROLES = {"actor_gen": "actor", "critic_inf": "critic", "rew_inf": "reward", "ref_inf": "ref",
             "critic_train": "critic", "actor_train": "actor", "advantages": "compute"}
ONE_BY_EIGHT = ClusterSpec(1, 8, "gpu")


@pytest.fixture
def ppo():
    return plan_placement(PPO_MFCS, PPO_ROLES, ONE_BY_EIGHT)


def test_ppo_device_map(ppo):
    dmap = ppo.device_map()
    assert dmap[0] == dmap[1] == ["actor_gen", "critic_inf", "actor_train"]
    assert dmap[2] == dmap[3] == ["actor_gen", "rew_inf", "actor_train"]
    for d in (4, 5, 6, 7):
        assert dmap[d] == ["actor_gen", "ref_inf", "critic_train"]
    assert sorted(dmap) == list(range(8))
    assert ppo.roles == {k: v for k, v in PPO_ROLES.items() if k in PPO_MFCS}  # unplaced MFCs dropped


def test_ppo_placements_and_groups(ppo):
    gen = ppo.placements["actor_gen"]
    assert (gen.dp, gen.tp, gen.pp, gen.mesh.devices) == (4, 1, 2, list(range(8)))
    assert ppo.groups["actor_gen"]["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ppo.groups["actor_gen"]["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ppo.groups["critic_train"]["pp"] == [[4, 6], [5, 7]]
    assert ppo.groups["critic_train"]["dp"] == [[4, 5], [6, 7]]
    assert ppo.groups["ref_inf"]["dp"] == [[4, 5, 6, 7]]
    assert ppo.groups["critic_inf"]["mapping"] == {0: 0, 1: 1}
    assert ppo.placements["rew_inf"].mesh == DeviceMesh.from_spec("node0:2-3", 1, 8)


def test_ppo_table(ppo):
    table = ppo.format_table()
    lines = table.splitlines()
    assert lines[0].split() == ["MFC", "role", "mesh", "DP/TP/PP", "devices"]
    rows = {line.split()[0]: line.split() for line in lines[2:8]}
    assert rows["actor_gen"] == ["actor_gen", "actor", "all", "4/1/2", "0-7"]
    assert rows["critic_inf"] == ["critic_inf", "critic", "node0:0-1", "2/1/1", "0-1"]
    assert rows["rew_inf"] == ["rew_inf", "reward", "node0:2-3", "2/1/1", "2-3"]
    assert rows["ref_inf"] == ["ref_inf", "ref", "node0:4-7", "4/1/1", "4-7"]
    assert rows["critic_train"] == ["critic_train", "critic", "node0:4-7", "2/1/2", "4-7"]
    assert rows["actor_train"] == ["actor_train", "actor", "node0:0-3", "4/1/1", "0-3"]
    assert "0       0:0   actor_gen, critic_inf, actor_train" in table
    assert "4       0:4   actor_gen, ref_inf, critic_train" in table
    assert "8 of 8 devices used, 24 MFC ranks on them" in table


def test_idle_devices_and_two_nodes():
    plan = plan_placement({"gen": {"mesh": "node1", "tp": 4}, "train": {"mesh": "node0:2-3"}},
                          {"gen": "actor", "train": "actor"}, ClusterSpec(2, 4, "npu"))
    assert plan.placements["gen"].dp == 1 and plan.placements["train"].dp == 2  # dp defaults to what is left
    assert plan.device_map() == {2: ["train"], 3: ["train"], 4: ["gen"], 5: ["gen"], 6: ["gen"], 7: ["gen"]}
    assert plan.bundle_devices() == {0: [2, 3], 1: [4, 5, 6, 7]}
    assert plan.bundles() == {0: [{"NPU": 1.0}] * 2, 1: [{"NPU": 1.0}] * 4}
    assert plan.bundles(cpus_per_device=2) == {0: [{"NPU": 1.0, "CPU": 2.0}] * 2, 1: [{"NPU": 1.0, "CPU": 2.0}] * 4}
    table = plan.format_table()
    assert "0       0:0   (idle)" in table and "7       1:3   gen" in table
    assert "6 of 8 devices used" in table


def test_cpu_bundles():
    plan = plan_placement({"a": {"mesh": "all", "dp": 4}}, {"a": "actor"}, ClusterSpec(1, 4, "cpu"))
    assert plan.bundles(cpus_per_device=0.5) == {0: [{"CPU": 0.5}] * 4}
    assert plan.bundles() == {0: [{"CPU": 1.0}] * 4}
    assert plan.resource_needs(0.5) == {"CPU": 2.0}
    with pytest.raises(ValueError, match="must be > 0"):
        plan.bundles(cpus_per_device=0)


def test_from_dict_defaults():
    cluster = ClusterSpec(1, 8, "cuda")
    assert cluster.device_kind == "gpu" and cluster.resource == "GPU"
    p = MFCPlacement.from_dict("x", {}, cluster)
    assert (p.dp, p.tp, p.pp, p.mesh.size) == (8, 1, 1, 8)
    p = MFCPlacement.from_dict("x", {"mesh": "4-7", "tp": 2}, cluster)
    assert (p.dp, p.tp, p.pp) == (2, 2, 1) and p.strategy == "2/2/1"
    assert p.topology.world_size == 4


@pytest.mark.parametrize("mfcs, message", [
    ({"actor_gen": {"mesh": "0-15", "dp": 16}},
     r"MFC 'actor_gen': mesh='0-15': .*\[8, 9, 10, 11, 12, 13, 14, 15\] are outside the cluster of 1 node\(s\) x 8"),
    ({"actor_gen": {"mesh": "node1"}}, r"MFC 'actor_gen': mesh='node1': .*node 1 is outside the cluster"),
    ({"ref_inf": {"mesh": "4-7", "dp": 2}},
     r"MFC 'ref_inf': dp\*tp\*pp = 2\*1\*1 = 2 but its mesh node0:4-7 \(devices 4-7\) has 4 device\(s\).*"
     r"e.g. dp=4, tp=1, pp=1"),
    ({"ref_inf": {"mesh": "all", "dp": 2, "tp": 3}}, r"dp\*tp\*pp = 2\*3\*1 = 6 but .* has 8.*e.g. dp=8, tp=1, pp=1"),
    ({"rew_inf": {"mesh": [1, 2], "dp": 2}}, r"MFC 'rew_inf': mesh=\[1, 2\]: .*not a multiple of the mesh size 2"),
    ({"rew_inf": {"mesh": "0-2"}}, r"MFC 'rew_inf': mesh='0-2': .*size 3 does not divide"),
    ({"x": {"mesh": "all", "tp": 3}}, r"MFC 'x': .* tp\*pp = 3\*1 does not divide"),
    ({"x": {"mesh": "all", "dp": 0}}, r"MFC 'x': dp=0 must be an integer >= 1"),
    ({"x": {"mesh": "all", "tp": "2"}}, r"MFC 'x': tp='2' must be an integer >= 1"),
    ({"x": {"devices": "all"}}, r"MFC 'x': unknown placement key\(s\) \['devices'\]; the keys are \['mesh', 'dp', 'tp', 'pp'\]"),
    ({"x": "all"}, r"MFC 'x': placement 'all' is not a mapping"),
    ({}, r"no MFCs given"),
])
def test_placement_errors(mfcs, message):
    with pytest.raises(ValueError, match=message):
        plan_placement(mfcs, {name: "actor" for name in mfcs}, ONE_BY_EIGHT)


def test_missing_role():
    with pytest.raises(ValueError, match=r"MFC\(s\) \['critic_inf'\] have no role; give roles="):
        plan_placement({"critic_inf": {"mesh": "0-1"}}, {}, ONE_BY_EIGHT)


def test_cluster_spec_errors():
    with pytest.raises(ValueError, match=r"device_kind='tpu'; use one of \['cpu', 'gpu', 'npu'\]"):
        ClusterSpec(1, 8, "tpu")
    with pytest.raises(ValueError, match="n_nodes=0 must be an integer >= 1"):
        ClusterSpec(0, 8, "gpu")


def test_check_cluster(ppo):
    ppo.check_cluster({"GPU": 8.0, "CPU": 2.0})
    with pytest.raises(ValueError, match=r"needs 8 GPU \(8 devices x 1\) but the Ray cluster reports 4 GPU; "
                                         r"MFC\(s\) actor_gen \(8 devices x 1 = 8 GPU\) alone need more"):
        ppo.check_cluster({"GPU": 4.0, "CPU": 64.0})
    with pytest.raises(ValueError, match=r"reports 0 GPU"):
        ppo.check_cluster({"CPU": 64.0})
    with pytest.raises(ValueError, match=r"needs 8 CPU .* reports 4 CPU; .*lower placement.cpus_per_device"):
        ppo.check_cluster({"GPU": 8.0, "CPU": 4.0}, cpus_per_device=1)


def test_check_cluster_names_meshes_that_only_fail_together():
    plan = plan_placement({"a": {"mesh": "0-3"}, "b": {"mesh": "4-7"}}, {"a": "actor", "b": "ref"}, ONE_BY_EIGHT)
    with pytest.raises(ValueError, match=r"reports 6 GPU; the meshes together cover 8 devices \(a: 4 on 0-3, b: 4 on 4-7\)"):
        plan.check_cluster({"GPU": 6})


def test_check_cluster_counts_ray_nodes():
    plan = plan_placement({"a": {"mesh": "all"}}, {"a": "actor"}, ClusterSpec(2, 4, "gpu"))
    plan.check_cluster({"GPU": 8, "node:10.0.0.1": 1, "node:10.0.0.2": 1, "node:__internal_head__": 1})
    with pytest.raises(ValueError, match=r"uses 2 nodes \(node0: \['a'\], node1: \['a'\]\) but the Ray cluster has 1"):
        plan.check_cluster({"GPU": 8, "node:10.0.0.1": 1, "node:__internal_head__": 1})
