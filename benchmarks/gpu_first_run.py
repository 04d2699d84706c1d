"""The first GPU run's checks in one script: what only a GPU can show about the CUDA paths, in under 5 minutes.

    python benchmarks/gpu_first_run.py [--json gpu_first_run.json]          # on one GPU: every check
    python benchmarks/gpu_first_run.py --device cpu --layers 2 --rows 8     # here: what runs without CUDA

No vLLM and no Ray. Each check prints one line and a JSON record; a check that needs CUDA on a machine without it
says `skipped: needs CUDA` and is not counted as passed. The exit code is 1 when a check that ran failed.

1. `static_decode`: the hf engine's static decode (engines/rollout/static_decode.py) against its eager loop on the
   Qwen2.5-0.5B architecture (random weights, `--layers` of its 24), greedy and sampled, with stop tokens taken from
   the greedy run's own output so that rows end at different times: the same tokens, the batch and width bucket
   moves that happened, and on CUDA the seconds per decode step with the buffers 384 and 3,072 columns long (the
   step's work should follow the sequence, not the buffer).
2. `updated_weights`: the weights changed in place (as a weight sync writes them) and the same call again: the
   static engine's tokens equal the eager engine's on the new weights (on CUDA: replayed graphs read the new
   weights where they were captured).
3. `concurrent_capture`: two threads generating with fresh static decoders (each captures its graphs) while a
   third calls `device.empty_cache` in a loop (device/capture.py): no error, and the tokens are those of one
   thread alone.
4. `fsdp_one_rank_memory`: the fsdp train engine on one rank (its own process group: nccl, gloo without CUDA),
   one train step of two micro-batches on the 0.5B architecture cut to `--layers`: on CUDA the peak allocated
   memory beside the memory plan's estimate for the same shapes (the plan's own code, `planning/memory.py`'s
   load of a trained actor at dp 1: the larger of the step's terms and the optimizer step's) and their ratio;
   elsewhere the estimate alone, the measurement skipped. The plan models a one-rank fsdp engine as the plain
   module under autocast, while the engine, given a process group, runs FSDP2 on a one-rank mesh with a bf16
   MixedPrecisionPolicy, so the ratio reflects that difference as well as the terms.
5. `cuda_ipc_sync`: the colocated weight sync's CUDA IPC path, the check `tests/engines/test_ipc_sync.py` runs on
   a GPU (`test_cuda_ipc_two_processes_packed_and_zero_copy`, called here as it is): two processes on one GPU,
   the packed path through CUDA IPC staging buffers, then zero copy from the sender's registered parameters;
   the reader's weights equal the sender's bit for bit both times. Skipped without CUDA.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG_05B = REPO / "mindspeed_rl" / "models" / "configs" / "qwen2_5_0_5b.json"
NEEDS_CUDA = "skipped: needs CUDA"


def qwen05b(layers: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = json.loads(CONFIG_05B.read_text())
    cfg.update(num_hidden_layers=layers, max_window_layers=layers)
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**cfg)).to(dtype=dtype, device=device).eval()


def prompts_of(rows: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 150000, (int(n),), generator=g) for n in torch.randint(length // 2, length + 1, (rows,),
                                                                                    generator=g)]


def common_stops(rollout, share: float = 0.75, most: int = 16) -> tuple[int, ...]:
    """Stop ids from a greedy run's own output (a random model's greedy output repeats itself): the tokens the
    most rows produced after their first, taken until `share` of the rows hold one (at most `most` ids), so most
    rows end, at different steps."""
    rows = [set(r[1:].tolist()) for r in rollout.responses]
    stops: list[int] = []
    while len(stops) < most:
        left = [r for r in rows if not r & set(stops)]
        if len(left) <= (1 - share) * len(rows):
            break
        counts: dict[int, int] = {}
        for r in left:
            for t in r:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        stops.append(max(counts, key=lambda t: (counts[t], -t)))
    return tuple(stops)


def same(a, b) -> bool:
    return [r.tolist() for r in a.responses] == [r.tolist() for r in b.responses]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- checks
def check_static_decode(a, device, dtype) -> dict:
    from mindspeed_rl.engines.base import SamplingParams
    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
    model = qwen05b(a.layers, dtype, device)
    eager = HFRolloutEngine(model, 0, device, cuda_graphs=False)
    static = HFRolloutEngine(copy.deepcopy(model), 0, device, cuda_graphs=True, max_seq_len=a.prompt + a.new)
    static.width_step = a.width_step
    prompts, seeds = prompts_of(a.rows, a.prompt), list(range(a.rows))
    greedy = eager.generate(prompts, SamplingParams(max_new_tokens=a.new, greedy=True), seeds)
    stops = common_stops(greedy)
    out: dict = {"stops": list(stops), "settings": {}}
    ok = True
    for name, params in (("greedy", SamplingParams(max_new_tokens=a.new, greedy=True, stop_token_ids=stops)),
                         ("sampled", SamplingParams(max_new_tokens=a.new, temperature=0.8, top_k=50, top_p=0.9,
                                                    stop_token_ids=stops))):
        want = eager.generate(prompts, params, seeds)
        got = static.generate(prompts, params, seeds)
        [decoder] = [d for free in static._decoders._free.values() for d in free][-1:]
        lengths = sorted({len(r) for r in want.responses})
        equal = same(want, got)
        # greedy rows end where the stops came from: the batch must have moved down its buckets
        ok &= equal and (name != "greedy" or (len(lengths) > 1 and bool(decoder.moves)))
        out["settings"][name] = {"tokens_equal": equal, "lengths": lengths, "batch_moves": decoder.moves,
                                 "width_moves": decoder.widened}
    if device.type == "cuda":
        out["s_per_step"] = {}
        for length in (384, 3072):
            eng = HFRolloutEngine(static.model, 0, device, cuda_graphs=True, max_seq_len=length)
            params = SamplingParams(max_new_tokens=a.new)
            eng.generate(prompts, params, seeds)   # captures
            sync(device)
            t0 = time.perf_counter()
            eng.generate(prompts, params, seeds)
            sync(device)
            out["s_per_step"][str(length)] = round((time.perf_counter() - t0) / a.new, 5)
    else:
        out["s_per_step"] = NEEDS_CUDA
    out["passed"] = ok
    return out


def check_updated_weights(a, device, dtype) -> dict:
    from mindspeed_rl.engines.base import SamplingParams
    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
    model = qwen05b(a.layers, dtype, device)
    eager = HFRolloutEngine(model, 0, device, cuda_graphs=False)
    static = HFRolloutEngine(copy.deepcopy(model), 0, device, cuda_graphs=True, max_seq_len=a.prompt + a.new)
    prompts, seeds = prompts_of(a.rows, a.prompt, seed=1), list(range(a.rows))
    params = SamplingParams(max_new_tokens=a.new, greedy=True)
    before = static.generate(prompts, params, seeds)   # captured against the first weights
    g = torch.Generator(device="cpu").manual_seed(1)
    new = {n: p.detach().cpu() + 0.02 * torch.randn(p.shape, generator=g).to(p.dtype)
           for n, p in model.named_parameters()}
    eager.update_weights(list(new.items()), 1)
    static.update_weights(list(new.items()), 1)   # in place, where the graphs read them
    want, got = eager.generate(prompts, params, seeds), static.generate(prompts, params, seeds)
    changed = not same(before, got)
    equal = same(want, got)
    return {"tokens_equal_after_update": equal, "tokens_changed_by_update": changed, "passed": equal and changed}


def check_concurrent_capture(a, device, dtype) -> dict:
    if device.type != "cuda":
        return {"passed": None, "note": NEEDS_CUDA}
    from mindspeed_rl.device import empty_cache
    from mindspeed_rl.engines.base import SamplingParams
    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
    model = qwen05b(a.layers, dtype, device)
    prompts, seeds = prompts_of(a.rows, a.prompt, seed=2), list(range(a.rows))
    params = SamplingParams(max_new_tokens=a.new, temperature=0.8)
    alone = HFRolloutEngine(model, 0, device, cuda_graphs=True, max_seq_len=a.prompt + a.new).generate(
        prompts, params, seeds)
    results, errors, stop = [None, None], [], threading.Event()

    def generate(k: int) -> None:
        try:
            eng = HFRolloutEngine(model, 0, device, cuda_graphs=True, max_seq_len=a.prompt + a.new)
            results[k] = eng.generate(prompts, params, seeds)
        except Exception as e:  # noqa: BLE001 - reported in the record
            errors.append(f"generate {k}: {type(e).__name__}: {e}")

    def release() -> None:
        while not stop.is_set():
            try:
                empty_cache(device)
            except Exception as e:  # noqa: BLE001
                errors.append(f"empty_cache: {type(e).__name__}: {e}")
                return

    threads = [threading.Thread(target=generate, args=(k,)) for k in (0, 1)]
    releaser = threading.Thread(target=release)
    releaser.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    stop.set()
    releaser.join(30)
    equal = all(r is not None and same(alone, r) for r in results)
    return {"errors": errors, "tokens_equal_to_alone": equal, "passed": not errors and equal}


def plan_estimate(a, device) -> dict:
    """The memory plan's estimate for the step `_fsdp_step_memory` runs: `planning/memory.py`'s load of a trained
    actor on the fsdp backend at dp 1 (the code `trainer.dry_run` runs), for the 0.5B architecture cut to
    `--layers`, `--rows` rows of `--prompt` + `--new` tokens in two micro-batches, no checkpointing, in the
    engine's dtype. The peak is the larger of the train step's terms and the optimizer step's; the plan's
    per-process CUDA context allowance is left out (`max_memory_allocated` does not see it)."""
    from mindspeed_rl.config import ActorConfig, DataConfig, GenerateConfig, RLConfig
    from mindspeed_rl.config.schema import CriticConfig, RefConfig, RewardModelConfig
    from mindspeed_rl.dataflow import MFCDef
    from mindspeed_rl.engines.registry import train_backend
    from mindspeed_rl.planning import memory as PM
    from mindspeed_rl.planning.memory_terms import GB, Layout, ModelDims
    from mindspeed_rl.planning.models import ModelSections
    cfg = json.loads(CONFIG_05B.read_text())
    cfg.update(num_hidden_layers=a.layers)
    dims = ModelDims.from_config(cfg)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    actor = ActorConfig(backend="fsdp", dtype=dtype, ppo_mini_batch_size=a.rows,
                        ppo_micro_batch_size_per_device=a.rows // 2)
    models = ModelSections(actor, RefConfig(), CriticConfig(), RewardModelConfig())
    lay = Layout("fsdp", train_backend("fsdp").memory, 1, kind="gpu" if device.type == "cuda" else "cpu",
                 dtype=dtype)
    train = MFCDef("actor_train", "actor", "train_step", ("prompts", "responses"), ())
    load = PM.model_load(models, GenerateConfig(max_new_tokens=a.new), RLConfig(prompts_per_step=a.rows,
                          n_samples_per_prompt=1), DataConfig(max_prompt_length=a.prompt), dims, lay, "actor",
                          "policy", [train], True, a.rows, False)
    phase, terms = max(load.busy.items(), key=lambda kv: sum(t.bytes for t in kv[1]))
    return {"estimate_gb": round(sum(t.bytes for t in terms) / GB, 3), "phase": phase,
            "terms_gb": {t.name: round(t.bytes / GB, 3) for t in terms if t.bytes}}


def check_fsdp_memory(a, device, dtype) -> dict:
    """On CUDA the peak allocated memory of one step beside the plan's estimate; elsewhere the estimate and that
    the step runs (gloo)."""
    import torch.distributed as dist

    from mindspeed_rl.engines.sync.weight_sync import free_port
    own_group = not dist.is_initialized()
    if own_group:   # a one-rank group of its own, gone again when the check ends
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        rec = _fsdp_step_memory(a, device)
    finally:
        if own_group:
            dist.destroy_process_group()
    plan = plan_estimate(a, device)
    measured = rec["peak_allocated_gb"]
    ratio = round(plan["estimate_gb"] / measured, 3) if isinstance(measured, float) and measured > 0 else NEEDS_CUDA
    return {**rec, "plan": plan, "plan_over_measured": ratio}


def _fsdp_step_memory(a, device) -> dict:
    import torch.distributed as dist

    from mindspeed_rl.engines import OptimConfig, TrainSpec
    from mindspeed_rl.engines.base import MicroBatch
    from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
    with tempfile.TemporaryDirectory() as d:
        qwen05b(a.layers, torch.float32, torch.device("cpu")).save_pretrained(d)
        engine = FSDPTrainEngine.build(TrainSpec(model_path=d, dtype="bfloat16" if device.type == "cuda" else "float32",
                                                 device=str(device), optim=OptimConfig(lr=1e-6),
                                                 process_group=dist.group.WORLD))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        g = torch.Generator().manual_seed(3)
        data = {"prompts": [torch.randint(3, 150000, (a.prompt,), generator=g) for _ in range(a.rows)],
                "responses": [torch.randint(3, 150000, (a.new,), generator=g) for _ in range(a.rows)]}

        def loss_fn(out, mb):
            m = out.response_mask
            return -(out.log_probs * m).sum() / m.sum().clamp(min=1), {}

        half = a.rows // 2   # two micro-batches: each one's gradients reduce-scattered
        stats = engine.train_step([MicroBatch({k: v[:half] for k, v in data.items()}, 0.5),
                                   MicroBatch({k: v[half:] for k, v in data.items()}, 0.5, last=True)], loss_fn)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        engine.close()
    return {"peak_allocated_gb": round(peak / 1e9, 3) if peak is not None else NEEDS_CUDA,
            "grad_norm": stats["grad_norm"], "passed": bool(torch.isfinite(torch.tensor(stats["grad_norm"])))}


def check_cuda_ipc(a, device, dtype) -> dict:
    """The CUDA IPC weight sync between two processes on this GPU: the suite's own GPU check, run as it is (its
    assertions are the check; it spawns the two processes and bounds every wait)."""
    test = "tests/engines/test_ipc_sync.py::test_cuda_ipc_two_processes_packed_and_zero_copy"
    if device.type != "cuda":
        return {"passed": None, "note": f"{NEEDS_CUDA} (CUDA IPC between two processes on one GPU)", "test": test}
    from tests.engines.test_ipc_sync import test_cuda_ipc_two_processes_packed_and_zero_copy
    test_cuda_ipc_two_processes_packed_and_zero_copy()
    return {"passed": True, "test": test}


CHECKS = {"static_decode": check_static_decode, "updated_weights": check_updated_weights,
          "concurrent_capture": check_concurrent_capture, "fsdp_one_rank_memory": check_fsdp_memory,
          "cuda_ipc_sync": check_cuda_ipc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers of the 0.5B architecture (24: all)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--width-step", type=int, default=None, help="the static decode's width buckets (default: "
                    "the engine's; small values make the CPU run move widths)")
    ap.add_argument("--only", action="append", choices=list(CHECKS), help="run these checks only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from mindspeed_rl.engines.rollout.static_decode import WIDTH_STEP
    a.width_step = a.width_step or WIDTH_STEP
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    records: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "args": vars(a), "checks": {}}
    failed = False
    for name in a.only or list(CHECKS):
        t0 = time.perf_counter()
        try:
            rec = CHECKS[name](a, device, dtype)
        except Exception as e:  # noqa: BLE001 - one check's crash is its result
            rec = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        records["checks"][name] = rec
        failed |= rec["passed"] is False
        state = {True: "passed", False: "FAILED", None: rec.get("note", "skipped")}[rec["passed"]]
        print(f"{name}: {state} ({rec['seconds']} s) {json.dumps({k: v for k, v in rec.items() if k != 'seconds'})}",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
