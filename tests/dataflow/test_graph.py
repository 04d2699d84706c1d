"""build_graph: edges, derived views, and every error path."""
import networkx as nx
import pytest

from mindspeed_rl.dataflow import (MFCDef, build_graph, data_graph, dataset_readers, describe, dock_columns,
                                   dock_consumers, same_step_readers, topological_order, trained_models,
                                   version_edges, weight_sync_targets, worker_groups)


def M(name, model, kind, ins, outs, **kw):
    return MFCDef(name, model, kind, ins, outs, **kw)


def _err(mfcs, dataset_keys=("prompts",)):
    with pytest.raises(ValueError) as e:
        build_graph(mfcs, dataset_keys)
    return str(e.value)


def test_empty_list():
    assert "empty" in _err([])


def test_not_an_mfc():
    with pytest.raises(TypeError, match="item 1"):
        build_graph([M("a", "actor", "generate", ["prompts"], ["r"]), ("b",)])


def test_duplicate_mfc_names():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["r"]),
                M("gen", "actor", "inference", ["r"], ["lp"])])
    assert "'gen'" in msg and "unique" in msg and "positions 0 and 1" in msg


def test_mfc_with_no_inputs():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["r"]), M("const", "x", "compute", [], ["c"])])
    assert "'const'" in msg and "no input_keys" in msg


def test_key_produced_by_two_mfcs():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["r"]),
                M("gen2", "actor", "generate", ["prompts"], ["r"])])
    assert "'r'" in msg and "'gen'" in msg and "'gen2'" in msg


def test_key_produced_by_mfc_and_dataset():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["labels"])], ("prompts", "labels"))
    assert "'labels'" in msg and "'gen'" in msg and "dataset key" in msg


def test_duplicate_dataset_keys_and_string_dataset_keys():
    assert "'prompts'" in _err([M("gen", "actor", "generate", ["prompts"], ["r"])], ("prompts", "prompts"))
    assert "('prompts',)" in _err([M("gen", "actor", "generate", ["prompts"], ["r"])], "prompts")


def test_unproduced_key_names_consumers_and_key():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["r"]),
                M("a", "actor", "inference", ["r", "scores"], ["x"]),
                M("b", "critic", "inference", ["scores"], ["y"])])
    assert "'scores'" in msg and "'a'" in msg and "'b'" in msg and "'gen'" not in msg
    assert "dataset keys: 'prompts'" in msg


def test_cycle_names_mfcs_and_keys():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["r"]),
                M("a", "x", "compute", ["r", "y"], ["x"]),
                M("b", "y", "compute", ["x"], ["y"])])
    assert "cycle" in msg
    assert "a -> b -> a" in msg or "b -> a -> b" in msg
    assert "'x'" in msg and "'y'" in msg and "'gen'" not in msg and "gen ->" not in msg


def test_two_train_steps_for_one_model():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["r"]),
                M("t1", "actor", "train_step", ["r"], []),
                M("t2", "actor", "train_step", ["r"], [])])
    assert "'actor'" in msg and "'t1'" in msg and "'t2'" in msg


def test_worker_group_dp_size_conflict():
    msg = _err([M("gen", "actor", "generate", ["prompts"], ["r"], worker_group="g", dp_size=2),
                M("lp", "actor", "inference", ["r"], ["lp"], worker_group="g", dp_size=4)])
    assert "'g'" in msg and "'gen' dp_size=2" in msg and "'lp' dp_size=4" in msg


def test_data_edges_carry_keys_and_form_a_dag():
    g = build_graph([M("gen", "actor", "generate", ["prompts"], ["r", "len", "unused"]),
                     M("score", "reward", "compute", ["len", "r", "prompts"], ["s"]),
                     M("train", "actor", "train_step", ["r", "s"], [])])
    assert g.edges["gen", "score"] == {"kind": "data", "keys": ("len", "r")}
    assert g.edges["gen", "train"] == {"kind": "data", "keys": ("r",)}
    assert g.edges["score", "train"] == {"kind": "data", "keys": ("s",)}
    assert g.edges["train", "gen"] == {"kind": "version", "model": "actor"}
    assert nx.is_directed_acyclic_graph(data_graph(g))
    assert not nx.is_directed_acyclic_graph(g)
    assert g.nodes["score"]["mfc"].model_name == "reward"
    assert [m.name for m in g.graph["mfcs"]] == ["gen", "score", "train"]
    assert g.graph["dataset_keys"] == ("prompts",)
    assert dataset_readers(g) == {"gen": ("prompts",), "score": ("prompts",)}
    assert dock_columns(g) == ["prompts", "r", "len", "unused", "s"]


def test_topological_ties_follow_listing_order():
    mfcs = [M("gen", "actor", "generate", ["prompts"], ["r"]),
            M("z", "z", "compute", ["r"], ["zz"]),
            M("a", "a", "compute", ["r"], ["aa"]),
            M("m", "m", "compute", ["prompts"], ["mm"]),
            M("end", "e", "compute", ["aa", "zz", "mm"], ["ee"])]
    assert [m.name for m in topological_order(build_graph(mfcs))] == ["gen", "z", "a", "m", "end"]
    swapped = [mfcs[0], mfcs[2], mfcs[1], mfcs[3], mfcs[4]]
    assert dock_consumers(build_graph(swapped)) == ["gen", "a", "z", "m", "end"]
    # a later-listed MFC waits for its producer even if listed first
    assert dock_consumers(build_graph([mfcs[1], mfcs[0], mfcs[3]])) == ["gen", "z", "m"]


def test_self_loop_version_edge():
    g = build_graph([M("sft", "policy", "train_step", ["prompts"], [])])
    assert g.edges["sft", "sft"] == {"kind": "version", "model": "policy"}
    assert version_edges(g) == [("sft", "sft", "policy")]
    assert trained_models(g) == {"policy": "sft"}
    assert weight_sync_targets(g) == {"policy": []}
    assert same_step_readers(g, "sft") == []
    assert "self-loop" in describe(g)


def test_frozen_model_has_no_version_edge():
    g = build_graph([M("gen", "actor", "generate", ["prompts"], ["r"]),
                     M("ref1", "ref", "inference", ["r"], ["a"]),
                     M("ref2", "ref", "inference", ["r"], ["b"]),
                     M("train", "actor", "train_step", ["a", "b"], [])])
    assert version_edges(g) == [("train", "gen", "actor")]
    assert all(d.get("model") != "ref" for _, _, d in g.edges(data=True))
    assert "ref" not in trained_models(g) and "ref" not in weight_sync_targets(g)


def test_no_trained_model():
    g = build_graph([M("gen", "actor", "generate", ["prompts"], ["r"])])
    assert version_edges(g) == [] and trained_models(g) == {} and weight_sync_targets(g) == {}
    assert "none (no model is trained)" in describe(g)


def test_mfc_after_train_reads_new_weights():
    g = build_graph([M("gen", "actor", "generate", ["prompts"], ["r"]),
                     M("train", "actor", "train_step", ["r"], ["loss"]),
                     M("eval", "actor", "inference", ["r", "loss"], ["new_lp"])])
    assert version_edges(g) == [("eval", "gen", "actor")]
    assert weight_sync_targets(g) == {"actor": ["gen", "eval"]}
    assert same_step_readers(g, "train") == ["gen"]


def test_same_step_readers_errors():
    g = build_graph([M("gen", "actor", "generate", ["prompts"], ["r"]),
                     M("train", "actor", "train_step", ["r"], [])])
    with pytest.raises(ValueError, match="'nope'"):
        same_step_readers(g, "nope")
    with pytest.raises(ValueError, match="'gen' is 'generate'.*'train'"):
        same_step_readers(g, "gen")


def test_trained_models_rejects_two_train_steps_on_a_hand_built_graph():
    g = build_graph([M("gen", "actor", "generate", ["prompts"], ["r"]),
                     M("t1", "actor", "train_step", ["r"], [])])
    t2 = M("t2", "actor", "train_step", ["r"], [])
    g.add_node("t2", mfc=t2)
    g.graph["mfcs"] = g.graph["mfcs"] + [t2]
    with pytest.raises(ValueError, match="'t1' and 't2'"):
        trained_models(g)


def test_worker_groups():
    g = build_graph([M("gen", "actor", "generate", ["prompts"], ["r"], worker_group="actor", dp_size=2),
                     M("ref", "ref", "inference", ["r"], ["a"]),
                     M("train", "actor", "train_step", ["a"], [], worker_group="actor", dp_size=2)])
    assert worker_groups(g) == {"actor": ["gen", "train"], "ref": ["ref"]}


def test_train_time_mfcs_read_trained_weights_or_depend_on_what_does():
    """What may run ahead of its step's training with stale weights, and what must wait for it."""
    from mindspeed_rl.dataflow import build_graph, get_algorithm, train_time_mfcs
    from mindspeed_rl.dataflow.options import AlgorithmOptions
    from mindspeed_rl.dataflow.ppo import ppo_mfcs

    def of(name):
        mfcs, keys = get_algorithm(name)
        return train_time_mfcs(build_graph(mfcs, keys))
    assert of("grpo") == ["actor_log_prob", "actor_train"]  # the frozen reference and the rewards run ahead
    assert of("remax") == ["actor_log_prob", "actor_train"]  # the greedy rollout is a rollout: ahead
    # the critic is trained, so its values are read at train time, and GAE, which reads them, too
    assert of("ppo") == ["actor_log_prob", "critic_values", "compute_advantage", "actor_train", "critic_train"]
    no_ref = build_graph(ppo_mfcs(AlgorithmOptions(use_reference=False)), ("prompts", "prompt_length", "labels"))
    assert "ref_log_prob" not in train_time_mfcs(no_ref)
