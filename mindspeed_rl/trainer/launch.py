"""Starting a plan's worker groups: each deployment's actors, their process groups and weight-sync groups.

The plan says per worker group what its backends' deployment is (engines/deployment.py): how many
actors, on which devices, whether they share torch's default group; `worker_specs.py` says what each
actor runs. This module turns that into Ray actors, then connects them: the default group where the
deployment asks for one, and per trained model a weight-sync group (or IPC) from the trainer's rank 0
to every worker that reads the model elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..config import Config
from ..device import ACCELERATOR_OPTION_KEYS, group_actor_options, group_resources
from ..planning import Plan
from .worker_specs import worker_specs
from ..workers.worker import Worker
from .landing import landing_errors
from .shared_dir import check_seen, write_token


class LaunchError(RuntimeError):
    """The workers cannot be started as planned (the message names the key and the fix)."""


@dataclass
class Launched:
    workers: dict[str, list[Any]] = field(default_factory=dict)        # group -> its actors, rank order
    worker_nodes: dict[str, list[str]] = field(default_factory=dict)   # group -> each rank's Ray node id
    worker_info: dict[tuple[str, int], dict] = field(default_factory=dict)  # (group, rank) -> pid, host, actor id
    sync_members: dict[str, list[Any]] = field(default_factory=dict)   # model -> the actors of its weight sync
    run_id: str = ""       # this run's token in output_dir (shared_dir.py), also the id its checkpoints carry


def group_bundles(plan: Plan) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """What to reserve for the worker groups outside a mesh: Ray resource bundles by reservation, and each
    group's reservation (actor k of a group runs on bundle k of its reservation).

    A group holding whole accelerators, or only CPUs, has a reservation of its own, a bundle per actor. The
    groups holding a fraction of an accelerator share one, named after them: its bundle k holds actor k of
    each, so Ray gives actor k of every such group the same device, the one the memory plan counts them on
    (planning/memory.py). Reserved apart, Ray could put them on different devices of a node."""
    from ..planning.groups import device_sharing_groups
    bundles: dict[str, list[dict]] = {}
    member_of: dict[str, str] = {}
    fractional = device_sharing_groups(plan.groups)
    shared: list[dict] = []
    for name in fractional:
        res = group_resources(plan.groups[name].resources)
        for k in range(plan.groups[name].world):
            if k == len(shared):
                shared.append({})
            shared[k] = {key: round(shared[k].get(key, 0) + res.get(key, 0), 4) for key in {*shared[k], *res}}
    if shared:
        reservation = "+".join(fractional)
        bundles[reservation] = shared
        member_of.update({name: reservation for name in fractional})
    for name, gp in plan.groups.items():
        if not gp.devices and name not in member_of:
            bundles[name] = [group_resources(gp.resources)] * gp.world
            member_of[name] = name
    return bundles, member_of


def launch_workers(cfg: Config, plan: Plan, docks: list, placement_groups: Mapping, group_placement_groups: Mapping,
                   env: dict, get: Callable) -> Launched:
    """Start every group's actors, build their engines and connect them; `get` is the driver's bounded,
    interruptible ray.get. `placement_groups`: mode mesh's, by device; `group_placement_groups`: the other
    groups', by group (actor k on bundle k)."""
    workers = {name: _start_group(cfg, plan, gp, docks, placement_groups, group_placement_groups.get(name), env)
               for name, gp in plan.groups.items()}
    all_workers = [w for ws in workers.values() for w in ws]
    infos = get([w.ping.remote() for w in all_workers], "starting workers")
    info_of = {id(w): info for w, info in zip(all_workers, infos)}
    # before any model loads: every node sees the run's directory (trainer/shared_dir.py)
    token = write_token(cfg.trainer.output_dir)
    named = [(f"{name}/{rank}", w) for name, ws in workers.items() for rank, w in enumerate(ws)]
    seen = get([w.sees_output_dir.remote(cfg.trainer.output_dir, token) for _, w in named],
               "checking that every node sees trainer.output_dir")
    check_seen(cfg.trainer.output_dir, [(who, {**info_of[id(w)], "seen": s}) for (who, w), s in zip(named, seen)])
    if cfg.placement.ray_address:   # a cluster the driver joined: no reaper of its own (trainer/node_sweeper.py)
        _sweep_nodes(all_workers, infos, docks, get)
    worker_nodes: dict[str, list[str]] = {}
    worker_info: dict[tuple[str, int], dict] = {}
    for name, ws in workers.items():
        worker_nodes[name] = [info_of[id(w)]["node_id"] for w in ws]
        for rank, w in enumerate(ws):  # named in the message if it dies
            worker_info[(name, rank)] = {**info_of[id(w)], "actor_id": _actor_id(w)}
    from ..parallel import placement_group_nodes
    errors = landing_errors(plan, worker_info, placement_group_nodes(placement_groups) if placement_groups else {})
    if errors:
        raise LaunchError("the workers did not land where the plan put them: " + "; ".join(errors))
    for name, ws in workers.items():
        if plan.groups[name].deployment.joins_default_process_group:
            # the default group over a model's ranks, where its deployment says so (DDP, FSDP; all dp*tp*pp of
            # a model-parallel group, generating ones too); never in a rollout-only data-parallel group, whose
            # engine (vLLM) may take torch's default group for itself.
            # Its collectives may wait for a reader waiting on the dock: a timeout beyond the stage's own
            host = info_of[id(ws[0])]["host"]
            port = get([ws[0].free_port.remote()], f"default process group port of '{name}'")[0]
            timeout = max(60.0, 2 * cfg.trainer.stage_timeout_s + 60.0)
            get([w.init_process_group.remote(host, port, timeout) for w in ws], f"default process group of '{name}'")
    get([w.setup.remote() for w in all_workers], "loading models")
    # weight sync groups: the trainer's rank 0 + every worker hosting a reader without the trainer
    sync_members: dict[str, list[Any]] = {}
    for model, train_mfc in plan.trained.items():
        train_group = plan.group_of(train_mfc)
        reader_groups = {plan.group_of(r) for r in plan.sync_targets.get(model, [])}
        remote = [w for g in reader_groups if g != train_group for w in workers[g]]
        sync_members[model] = list(workers[train_group]) + remote
        if remote:
            _connect_weight_sync(cfg, model, workers[train_group][0], remote, info_of, get)
    return Launched(workers, worker_nodes, worker_info, sync_members, token)


def _sweep_nodes(workers: list, infos: list[dict], docks: list, get: Callable) -> None:
    """A /dev/shm sweeper on each node of the workers and docks, for their pids, started by one of them there."""
    from .node_sweeper import start_node_sweepers
    on_node: dict[str, tuple[Any, list[int]]] = {}
    for w, info in zip(workers, infos):
        on_node.setdefault(info["node_id"], (w, []))[1].append(info["pid"])
    for d, (node, pid) in zip(docks, get([d.actor.__ray_call__.remote(_where) for d in docks], "locating the docks")):
        on_node.setdefault(node, (d.actor, []))[1].append(pid)
    start_node_sweepers(on_node, get)


def _where(_actor) -> tuple[str, int]:
    import os

    import ray
    return ray.get_runtime_context().get_node_id(), os.getpid()


def _start_group(cfg: Config, plan: Plan, gp, docks: list, placement_groups: Mapping, group_pg: Any,
                 env: dict) -> list[Any]:
    """The actors of one worker group, in rank order (started, not yet answering)."""
    import ray
    r = gp.resources
    # threaded: colocated stages run at once; +4 for sync, checkpoint and ping calls beside them
    # (x the steps in flight: with max_weight_staleness k, stages of k + 1 steps may run at once);
    # +3 for an IPC weight sync's deliveries (ipc_deliver) waiting beside its sync_weights call
    opts: dict[str, Any] = {**group_actor_options(r),  # num_cpus, num_gpus, resources={NPU: ...}
                            "max_concurrency": len(gp.mfcs) * (cfg.rl_config.max_weight_staleness + 1) + 4 + 3}

    # mode mesh: the deployment's actors, actor k on its devices (one, or a replica's for an engine that
    # starts its own ranks there)
    def pinned(k: int):
        devices = gp.actor_devices(k)
        if not devices and group_pg is None:
            return ray.remote(Worker).options(**opts)
        if not devices:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            return ray.remote(Worker).options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group_pg, placement_group_bundle_index=k))
        if len(devices) > 1:
            return ray.remote(Worker).options(**multi_device_actor_options(placement_groups, devices, opts))
        from ..parallel import scheduling_strategy
        return ray.remote(Worker).options(
            **opts, scheduling_strategy=scheduling_strategy(placement_groups, devices[0]))

    def env_of(k: int) -> dict:
        devices = gp.actor_devices(k)
        if len(devices) > 1 and gp.rollout_row is not None:
            return {**env, **gp.rollout_row.actor_env(
                [placement_groups[d][1] for d in devices], gp.resources)}
        return env
    return [pinned(k).remote(spec) for k, spec in enumerate(worker_specs(cfg, plan, gp, docks, env_of))]


def _connect_weight_sync(cfg: Config, model: str, src, remote: list, info_of: dict, get: Callable) -> None:
    """Connect the trainer's rank 0 (`src`) of `model` to the workers that read it elsewhere: by IPC when
    they share one device, else by a weight-sync group of their own."""
    # IPC (engines/sync/ipc_sync.py, shared memory, no group): weight_sync.backend ipc, or auto when
    # rank 0 and every remote reader compute on one GPU (same CUDA uuid; NCCL refuses that)
    keys = (get([w.device_key.remote() for w in [src] + remote], f"devices of '{model}'")
            if cfg.weight_sync.backend in ("ipc", "auto") else [])
    same = len(set(keys)) == 1
    if cfg.weight_sync.backend == "ipc" and not (same and keys[0].startswith(("cuda:", "cpu:"))):
        raise LaunchError(
            f"weight_sync.backend=ipc: the trainer of '{model}' and its readers are not on one device "
            f"({sorted(set(keys))}); IPC weight sync needs them all on one GPU (or all on the CPU of one "
            "host): place them together, or set weight_sync.backend=auto (NCCL/HCCL) or gloo")
    if cfg.weight_sync.backend == "ipc" or (same and keys[0].startswith("cuda:")):
        get([src.init_ipc_sync.remote(model, "send", remote)]
            + [w.init_ipc_sync.remote(model, "read") for w in remote], f"IPC weight sync of '{model}'")
        return
    host = info_of[id(src)]["host"]
    port = get([src.free_port.remote()], "sync port")[0]
    world = 1 + len(remote)
    get([w.init_sync_group.remote(model, host, port, i, world)
         for i, w in enumerate([src] + remote)], f"weight-sync group of '{model}'")


def multi_device_actor_options(placement_groups: Mapping, devices: list[int], opts: dict) -> dict:
    """Ray options of an actor that holds several devices (an engine that starts its own ranks there, as vLLM's
    tensor parallelism does: one actor per DP replica; engines/deployment.py).

    An actor can take resources from one placement-group bundle (one device) only, so it is pinned to
    its replica's first device; the replica's other devices stay reserved for it (the plan pins no
    other rank of its group there). On CPU the actor keeps that bundle's CPU share and vLLM's worker
    processes, children of the actor, run on the replica's CPU slots outside Ray's accounting. With
    accelerators the actor takes no GPU/NPU: vLLM's Ray executor starts one worker per device on the
    replica's bundles (the backend's `actor_env` names them; child tasks are captured by the placement
    group). That path is written against Ray's and vLLM's public API and has not been run (no GPU here).
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    groups = {placement_groups[d][0].id for d in devices}
    if len(groups) > 1:
        raise LaunchError(f"placement.mfcs: an engine-split rollout replica spans devices {devices} on more than "
                            "one node; vLLM's tensor parallelism runs within a node: give the rollout MFC a mesh whose "
                            "tp devices share a node")
    pg, index = placement_groups[devices[0]]
    accelerated = any(opts.get(k) for k in ACCELERATOR_OPTION_KEYS)
    out = {k: v for k, v in opts.items() if k not in ACCELERATOR_OPTION_KEYS}
    return {**out, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=accelerated)}


def _actor_id(handle) -> str | None:
    """A Ray actor handle's id, for messages (Ray keeps it on a private attribute)."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else None


