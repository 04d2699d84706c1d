"""Code that runs in worker processes of the multi-process engine tests.

Processes come from a `forkserver` that imports this module (torch, transformers, the engines)
once; each worker is then a cheap fork of it instead of a fresh interpreter paying those imports
again. A worker writes what its function returned, or its traceback, to a file the test reads.

Workers are NOT daemonic: a daemonic process may not start children, and megatron's async checkpoint
writer starts a multiprocessing Manager (the one-GPU megatron engine tests failed for that alone on an
H100). `run_procs` cleans them up itself instead: each worker leads its own process group (so what it
started goes with it) and dies with the fork server (PR_SET_PDEATHSIG), and in a `finally` every worker
still alive at the deadline, on a failure or on an interrupt is terminated, then killed, then joined.
"""
from __future__ import annotations

import faulthandler
import importlib
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.nn.parallel  # noqa: F401  (imported once by the fork server, as is the model code below)

from mindspeed_rl.engines import OptimConfig
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

from ._common import PAD, tiny_qwen2, token_mean_nll

HOST = "127.0.0.1"
importlib.import_module("transformers.models.qwen2.modeling_qwen2")  # lazy in transformers: load it here


def context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def start_forkserver() -> None:
    """Start the fork server now so its imports overlap with the tests that run before the
    multi-process ones (idempotent)."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


def _own_group_and_parent_death() -> None:
    """Lead a process group of our own (children we start join it: `_reap` ends them with us), and
    be killed when our parent, the fork server, dies (it does when the test process ends, however)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        ppid = os.getppid()
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG (Linux); elsewhere this is skipped
        if os.getppid() != ppid:        # the parent died before prctl took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass


def _entry(fn, args, out: str) -> None:
    _own_group_and_parent_death()
    torch.set_num_threads(1)
    # a hung worker's stacks, on SIGUSR1 from run_procs: a hang is then a diagnosis, not a mystery
    faulthandler.register(signal.SIGUSR1, file=open(out + ".stack", "w"), all_threads=True)
    # a worker that dies (an abort in gloo, a segfault) leaves its stderr and Python stacks behind
    err = open(out + ".stderr", "w")
    os.dup2(err.fileno(), 2)
    faulthandler.enable(file=err, all_threads=True)
    try:
        result = {"ok": True, "value": fn(*args)}
    except BaseException:  # noqa: BLE001 - reported to the test, whatever it is
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, out)


def run_procs(jobs, tmp_path: Path, timeout_s: float = 120.0) -> list:
    """Run `jobs` (a list of (fn, args)) in parallel worker processes; their return values, in order.

    Fails (and kills what is left) if any worker raised, died or outlived `timeout_s`. The workers
    are not daemonic (they may start processes of their own); whatever happens here, every worker
    and its process group is gone when this returns or raises."""
    ctx = context()
    outs = [tmp_path / f"worker{i}.pt" for i in range(len(jobs))]
    procs = [ctx.Process(target=_entry, args=(fn, tuple(args), str(out)), daemon=False)
             for (fn, args), out in zip(jobs, outs)]
    started = []
    try:
        for p in procs:
            p.start()
            started.append(p)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        if hung:
            for i in hung:
                _signal(procs[i].pid, signal.SIGUSR1)
            time.sleep(1.0)
            stacks = "\n".join(f"--- worker {i} stacks:\n{_read(str(outs[i]) + '.stack')}" for i in hung)
            others = "\n".join(f"--- worker {i}: exit code {p.exitcode}, "
                               + (_outcome(outs[i]) if outs[i].is_file() else "no result")
                               for i, p in enumerate(procs) if i not in hung)
            raise AssertionError(f"workers {hung} still running after {timeout_s}s\n{others}\n{stacks}")
    finally:
        _reap(started)
    results, errors = [], []
    for i, (p, out) in enumerate(zip(procs, outs)):
        if not out.is_file():
            errors.append(f"worker {i} exited with code {p.exitcode} and no result; its stderr ends:\n"
                          + _read(str(out) + ".stderr")[-4000:])
            continue
        r = torch.load(out, weights_only=False)
        if not r["ok"]:
            errors.append(f"worker {i} raised:\n{r['error']}")
        results.append(r.get("value"))
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(procs, grace_s: float = 5.0) -> None:
    """Terminate, then kill, then join every worker still alive, and kill what is left of each
    worker's process group (processes it started, e.g. a multiprocessing Manager, that outlived it).
    A process group lives on while any member does, so its id (the worker's pid) cannot be reused
    meanwhile: killing it never reaches a stranger."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        _signal(p.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(grace_s)
        try:
            os.killpg(p.pid, signal.SIGKILL)   # the worker's own group (it called setpgid(0, 0))
        except (ProcessLookupError, PermissionError):
            pass


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"(unreadable: {e})"


def _outcome(out: Path) -> str:
    r = torch.load(out, weights_only=False)
    return "returned" if r["ok"] else f"raised:\n{r['error']}"


# ---------------------------------------------------------------------------- DDP

def as_process_group(group):
    """A c10d `ProcessGroup` around a `stateless_group`'s gloo backend (what vLLM's
    `init_gloo_process_group` does): DDP takes only a `ProcessGroup`, and `stateless_group(...).pg`
    is the bare `ProcessGroupGloo` backend, which DDP rejects (see test_stateless_pg_works_with_ddp)."""
    import torch.distributed as dist

    pg = dist.ProcessGroup(group.store, group.rank, group.world_size)
    gloo = dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(gloo)
    group.pg._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), gloo, group.pg)
    return pg


def ddp_construct_with_stateless_pg(rank: int, world: int, port: int) -> str:
    from mindspeed_rl.engines.sync.weight_sync import stateless_group
    group = stateless_group(HOST, port, rank, world, timeout_s=60)
    engine = TorchTrainEngine(tiny_qwen2(seed=rank), PAD, OptimConfig(), process_group=group.pg)
    return type(engine.model).__name__

def ddp_train(rank: int, world: int, port: int, rows: tuple, micro_batch_size: int, optim: OptimConfig) -> dict:
    """One `train_step` of a DDP TorchTrainEngine on this rank's rows, accumulated over micro-batches.

    Rank r starts from a model with seed r: DDP must broadcast rank 0's weights at construction."""
    from mindspeed_rl.engines import MicroBatch
    from mindspeed_rl.engines.base import hf_named_weights
    from mindspeed_rl.engines.sync.weight_sync import checksum, stateless_group

    from ._common import flat_params, nll_loss_fn
    prompts, responses = rows
    group = stateless_group(HOST, port, rank, world, timeout_s=60)
    engine = TorchTrainEngine(tiny_qwen2(seed=rank), PAD, optim, process_group=as_process_group(group))
    grads = []  # the reduced gradients, as the optimizer sees them
    engine.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(
        torch.cat([p.grad.detach().reshape(-1).clone() for p in engine.module.parameters()])))
    starts = list(range(0, len(prompts), micro_batch_size))
    stats = engine.train_step((MicroBatch({"prompts": prompts[s:s + micro_batch_size],
                                           "responses": responses[s:s + micro_batch_size]}, 1 / len(starts),
                                          last=i == len(starts) - 1) for i, s in enumerate(starts)), nll_loss_fn)
    return {"grads": grads[0], "params": flat_params(engine.module), "grad_norm": stats["grad_norm"],
            "version": engine.version, "checksum": checksum(hf_named_weights(engine.module))}
