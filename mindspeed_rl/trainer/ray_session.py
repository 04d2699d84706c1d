"""The run's Ray session: started by the driver (or joined at `placement.ray_address`), checked against
the plan before any worker starts, and ended with the run, its worker actors first (`stop_workers`).

A session the driver starts itself gets a reaper first (`reaper.py`): kill -9 of the driver must not
leave Ray's processes and shared memory behind. A cluster at `placement.ray_address` is not the
driver's to end, so it is only checked (a TCP connect first: ray.init would retry for minutes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from .errors import TrainingError, first_line

RAY_CONNECT_TIMEOUT_S = 5.0  # placement.ray_address: a TCP connect to it, before ray.init retries for minutes
CLOSE_TIMEOUT_S = 30.0  # shutdown: how long engine-split rollout actors get to close their engines (vLLM: ~7 s)


@dataclass
class RaySession:
    started: bool = False        # this driver called ray.init (and so ends the session)
    reaper: Any = None           # reaper.py Reaper while a session this driver started runs

    def start(self, cfg, plan) -> None:
        """Start (or join) Ray, then check that the cluster can hold the plan's groups and meshes."""
        import ray

        from ..planning import check_cluster
        p = cfg.placement
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                                      "logging_level": "ERROR", "configure_logging": True}
            token = None
            if p.ray_address:
                check_ray_address(p.ray_address)
                kwargs["address"] = p.ray_address
                token = use_auth_token()
            elif p.ray_num_cpus is not None:
                kwargs["num_cpus"] = int(p.ray_num_cpus)
            self.started = True  # before ray.init: an interrupted ray.init is shut down too
            from .reaper import start_reaper
            self.reaper = start_reaper()
            try:
                ray.init(**kwargs)
            except Exception as e:  # e.g. "The current node timed out during startup" on an overloaded machine
                if p.ray_address:
                    raise ConfigError(join_error(p.ray_address, e, token)) from None
                raise TrainingError(f"Ray did not start ({type(e).__name__}: {first_line(e)}); is the machine "
                                    "overloaded or /tmp full? see /tmp/ray/session_latest/logs") from None
        check_cluster(plan, ray.available_resources())
        if plan.placement is not None:
            try:
                plan.placement.check_cluster(ray.cluster_resources(), cfg.placement.cpus_per_device,
                                             n_ray_nodes=sum(1 for n in ray.nodes() if n.get("Alive")))
            except ValueError as e:
                raise ConfigError(f"placement.mfcs: {e}") from None

    def stop(self) -> None:
        """End the session this driver started, then its reaper (a joined cluster stays up)."""
        import ray
        if self.started:
            ray.shutdown()
            self.started = False
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None


def stop_workers(workers: dict[str, list], plan, worker_info: dict, placement_groups: dict,
                 started_after: float, group_placement_groups: dict | None = None) -> None:
    """End the run's worker actors and free what they held outside themselves: an engine-split rollout
    closes its engines first (vLLM's worker processes end with the actor, but only a close removes their
    /dev/shm queues), what vLLM's tensor-parallel engines on the driver's node recorded in /dev/shm is removed
    (also when they died; on other nodes of a joined cluster their node's sweeper does it), and the placement
    groups (the mesh's and the other groups') go. Never raises: a shutdown must not hide the run's own error."""
    import sys

    import ray
    split = [w for name, ws in workers.items() if plan.groups[name].rollout_backend for w in ws]
    if split:
        try:
            ray.wait([w.close_rollout.remote() for w in split], num_returns=len(split), timeout=CLOSE_TIMEOUT_S)
        except Exception:
            pass
    for ws in workers.values():
        for w in ws:
            try:
                ray.kill(w)
            except Exception:
                pass
    from ..engines.sync.shm_cleanup import remove_vllm_shm
    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception:   # Ray is gone: every pid, as for a session on this host alone
        here = None
    try:
        remove_vllm_shm(pids_on_node(worker_info, here), started_after=started_after)
    except Exception as e:
        print(f"warning: removing vLLM's shared memory failed: {type(e).__name__}: {e}", file=sys.stderr)
    if placement_groups:
        from ..parallel import remove_placement_groups
        try:
            remove_placement_groups(placement_groups)
        except Exception:
            pass
    for pg in {id(pg): pg for pg in (group_placement_groups or {}).values()}.values():   # groups may share one
        try:
            ray.util.remove_placement_group(pg)
        except Exception:
            pass


def auth_token_source() -> str | None:
    """Where Ray would read its authentication token from (its own order), or None where there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH={path}" if os.path.isfile(path) else None
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if os.path.isfile(default) else None


def use_auth_token() -> str | None:
    """Joining a cluster: token authentication on when a token is at hand and RAY_AUTH_MODE is unset, as Ray
    does for a cluster it starts itself (`ray start --head` of Ray 2.60 turns it on, and a client without it is
    refused with a bare ConnectionError). Returns where the token comes from, None when it is not used."""
    mode = os.environ.get("RAY_AUTH_MODE")
    source = auth_token_source()
    if mode is None and source is not None:
        os.environ["RAY_AUTH_MODE"] = "token"   # this process and the workers it starts
        try:   # Ray caches its config at import: refresh it as Ray does for a cluster it starts itself
            from ray._private.authentication.authentication_token_setup import _enable_token_auth
            _enable_token_auth()
        except ImportError:
            pass
        return source
    return source if (mode or "").lower() == "token" else None


def join_error(address: str, error: BaseException, token: str | None) -> str:
    """One line for a cluster that answers at `address` but would not be joined: a Ray or Python version that is
    not the cluster's, or (what Ray reports only as a ConnectionError) an authentication token missing or wrong."""
    text = str(error)
    if "Version mismatch" in text:
        versions = " ".join(line.strip() for line in text.splitlines()[1:] if line.strip())
        return (f"placement.ray_address={address!r}: the cluster runs another Ray or Python ({versions}); install "
                "the cluster's Ray and Python versions where the trainer runs")
    if token is None:
        return (f"placement.ray_address={address!r}: the cluster refused to connect, and this machine has no Ray "
                "authentication token (Ray 2.60's `ray start --head` turns token authentication on): copy the "
                "head's token (`ray get-auth-token` there) to ~/.ray/auth_token or RAY_AUTH_TOKEN, or start the "
                f"head with RAY_AUTH_MODE=disabled ({type(error).__name__}: {first_line(error)})")
    return (f"placement.ray_address={address!r}: the cluster refused to connect with the authentication token from "
            f"{token}: use the head's token (`ray get-auth-token` there), or check the Ray logs of the head "
            f"({type(error).__name__}: {first_line(error)})")


def check_ray_address(address: str) -> None:
    """Fail fast (ConfigError, exit 2) when nothing listens at `placement.ray_address`; ray.init would
    retry for minutes. `auto` and `local` are Ray's own words and are left to it."""
    import socket
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"placement.ray_address={address!r}: expected host:port (the head's GCS address, e.g. "
                          "10.0.0.1:6379), 'auto', or null to start a local Ray")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConfigError(f"placement.ray_address={address!r}: nothing answers there ({e.strerror or e}); start the "
                          "cluster's head (`ray start --head`), fix the address, or set placement.ray_address=null to "
                          "start a local Ray") from None


def pids_on_node(worker_info: dict, node_id: str | None) -> list[int]:
    """The workers' pids on node `node_id` (None: all): another node's pid names another process here, and
    that node's sweeper (node_sweeper.py) cleans up after its own."""
    return [info["pid"] for info in worker_info.values()
            if "pid" in info and (node_id is None or info.get("node_id", node_id) == node_id)]
