"""Our GRPO step against TRL's GRPOTrainer on the same real model and work, alternated in one run.

    pip install trl==1.16.0          # a benchmark-only dependency, not in the package's requirements
    python benchmarks/trl_side_by_side.py                       # 2 rounds x 8 steps each, ~28 min here
    python benchmarks/trl_side_by_side.py --rounds 1 --steps 6 --json docs/benchmarks/trl_side_by_side.json

Both train SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`, the same converted checkpoint) on
`builtin:arith` with the same prompts in the same order (the same `steps x prompts` records drawn with the
round's seed, no shuffling), prompts x samples a step, new tokens,
sampling (temperature, top-p), learning rate, compute dtype (bf16 autocast over fp32 weights where the config
says bfloat16: TRL's `bf16=True`), clipped loss without a KL term (TRL `beta=0`), advantages
normalized within each prompt's group, token-mean loss over the step's tokens (TRL `loss_type="dapo"`), one
optimizer step per step, and the same reward (`gsm8k_flexible`). Ours runs `configs/grpo_smollm2_arith.yaml`
through `cli/train_grpo.py`; TRL runs in a process of its own with all of this machine's cores (torch's
default threads). The two alternate round by round (ours, TRL, ours, TRL, ...), each a fresh process, so drift
in the machine's load hits both. Round k runs both with seed `--seed` + k (its own prompts and samples), so
several rounds give held-out accuracy over several trajectories of each, not one repeated.

Reported per trainer: seconds per steady step (the median after the first two steps of each round: the first
pays for warm-up), where the time goes (generation, log-prob forwards without grad, the update, the rest),
and held-out greedy accuracy after the same number of steps, both measured by `cli/evaluate.py` on the saved
policy (the same 128 held-out questions, greedy, so the two are judged by one yardstick).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "builtin:smollm2-135m-instruct"
WARMUP_STEPS = 2


def config_defaults() -> dict:
    """The work both trainers do, from configs/grpo_smollm2_arith.yaml (the command line overrides it)."""
    import yaml
    c = yaml.safe_load((REPO / "configs" / "grpo_smollm2_arith.yaml").read_text())
    return {"prompts": c["rl_config"]["prompts_per_step"], "samples": c["rl_config"]["n_samples_per_prompt"],
            "max_new_tokens": c["generate_config"]["max_new_tokens"],
            "temperature": c["generate_config"]["temperature"], "top_p": c["generate_config"]["top_p"],
            "lr": c["actor_config"]["lr"], "max_prompt_length": c["data"]["max_prompt_length"],
            "num_digits": c["data"]["num_digits"], "bf16": c["actor_config"]["dtype"] == "bfloat16"}


def shared_settings(args) -> dict:
    s = config_defaults()
    s.update({k: v for k, v in (("prompts", args.prompts), ("samples", args.samples),
                                ("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature),
                                ("lr", args.lr)) if v is not None})
    return {**s, "seed": args.seed, "steps": args.steps}


# ---------------------------------------------------------------------------------------------- ours
def run_ours(s: dict, out: Path) -> dict:
    cmd = [sys.executable, str(REPO / "cli" / "train_grpo.py"), "--config-name", "grpo_smollm2_arith",
           f"trainer.output_dir={out}", f"trainer.total_steps={s['steps']}", f"trainer.seed={s['seed']}",
           "trainer.val_before_train=false", "trainer.val_interval=0", "trainer.save_interval=0",
           "trainer.dashboard=false", "trainer.progress=false", "trainer.plot=false", "trainer.report=false",
           "trainer.overwrite=true", "data.shuffle=false", f"data.size={s['steps'] * s['prompts']}",
           f"rl_config.prompts_per_step={s['prompts']}", f"rl_config.n_samples_per_prompt={s['samples']}",
           f"actor_config.ppo_mini_batch_size={s['prompts']}", f"actor_config.lr={s['lr']}",
           f"generate_config.max_new_tokens={s['max_new_tokens']}", f"generate_config.temperature={s['temperature']}",
           f"generate_config.top_p={s['top_p']}", f"data.max_prompt_length={s['max_prompt_length']}"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for r in rows:
        if "timing/step" not in r:
            continue
        busy = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("busy/")}
        steps.append({"step": r["timing/step"], "generation": busy.get("actor_rollout", 0.0),
                      "logprob": busy.get("actor_log_prob", 0.0) + busy.get("ref_log_prob", 0.0),
                      "update": busy.get("actor_train", 0.0), "reward": r.get("reward/mean")})
    return {"steps": steps, "policy": str(out / "hf" / "final")}


# ---------------------------------------------------------------------------------------------- TRL
def run_trl(s: dict, out: Path) -> dict:
    """TRL in this process: called by the child `--worker trl`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mindspeed_rl.data import SyntheticPromptDataset
    from mindspeed_rl.models import resolve_model_path
    from mindspeed_rl.rewards.gsm8k import gsm8k_flexible

    path = str(resolve_model_path(MODEL))
    size = s["steps"] * s["prompts"]
    records = SyntheticPromptDataset("arith", size=size, seed=s["seed"], num_digits=s["num_digits"]).records
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in records])

    def reward(completions, answer, **_):
        return [gsm8k_flexible(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    rows = s["prompts"] * s["samples"]
    config = GRPOConfig(output_dir=str(out), learning_rate=s["lr"], beta=0.0, loss_type="dapo", epsilon=0.2,
                        num_generations=s["samples"], per_device_train_batch_size=rows, gradient_accumulation_steps=1,
                        max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                        max_steps=s["steps"], num_iterations=1, shuffle_dataset=False, seed=s["seed"],
                        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=s["bf16"],
                        scale_rewards="group", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                        max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, dataloader_num_workers=0,
                        disable_tqdm=True, log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = GRPOTrainer(model=model, args=config, reward_funcs=[reward], train_dataset=data,
                          processing_class=tokenizer)
    spent = {"generation": 0.0, "logprob": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if name != "logprob" or not torch.is_grad_enabled():  # the forward with grad is the update's
                    spent[name] += time.perf_counter() - t
        return wrapper

    trainer._generate_single_turn = timed("generation", trainer._generate_single_turn)
    trainer._get_per_token_logps_and_entropies = timed("logprob", trainer._get_per_token_logps_and_entropies)
    steps: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t = time.perf_counter()
            spent.update(generation=0.0, logprob=0.0)

        def on_step_end(self, *a, **kw):
            total = time.perf_counter() - self.t
            steps.append({"step": total, "generation": spent["generation"], "logprob": spent["logprob"],
                          "update": total - spent["generation"] - spent["logprob"]})

    trainer.add_callback(StepClock())
    trainer.train()
    policy = out / "final"
    trainer.save_model(str(policy))
    tokenizer.save_pretrained(str(policy))
    return {"steps": steps, "policy": str(policy)}


# ---------------------------------------------------------------------------------------------- judged alike
def held_out_accuracy(policy: str, s: dict) -> float:
    """`cli/evaluate.py` on a saved policy: greedy, the config's 128 held-out questions."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, str(REPO / "cli" / "evaluate.py"), "--config-name", "grpo_smollm2_arith",
                        f"model_path={policy}", f"out={d}", f"trainer.seed={s['seed']}"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        result = json.loads((Path(d) / "evaluation.json").read_text())
    return float(result["metrics"]["val/pass@1"])


def steady(steps: list[dict]) -> list[dict]:
    return steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps


def summarize(rounds: list[dict]) -> dict:
    rows = [st for r in rounds for st in steady(r["steps"])]
    out = {k: statistics.median(st[k] for st in rows) for k in ("step", "generation", "logprob", "update")}
    out["rest"] = max(0.0, out["step"] - out["generation"] - out["logprob"] - out["update"])
    out["steady_steps"] = len(rows)
    out["held_out_pass@1"] = [r["held_out_pass@1"] for r in rounds]
    out["held_out_pass@1_mean"] = statistics.mean(out["held_out_pass@1"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per round of each trainer")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the config's)")
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt (default: the config's)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=1, help="round k's seed is this + k (prompts and sampling)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", choices=["trl"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    s = shared_settings(args)
    if args.worker == "trl":
        result = run_trl(s, Path(args.out))
        (Path(args.out) / "trl_steps.json").write_text(json.dumps(result))
        return
    results: dict[str, list] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            sk = {**s, "seed": s["seed"] + k}   # each round its own seed: its own prompts and samples, for both
            for name in ("ours", "trl"):
                out = Path(tmp) / f"{name}{k}"
                t = time.time()
                if name == "ours":
                    r = run_ours(sk, out)
                else:
                    out.mkdir(parents=True)
                    subprocess.run([sys.executable, __file__, *sys.argv[1:], "--seed", str(sk["seed"]),
                                    "--worker", "trl", "--out", str(out)], check=True, cwd=REPO)
                    r = json.loads((out / "trl_steps.json").read_text())
                r["seed"] = sk["seed"]
                r["held_out_pass@1"] = held_out_accuracy(r["policy"], sk)
                r["wall_s"] = time.time() - t
                results[name].append(r)
                print(f"round {k} {name}: steady step {statistics.median(x['step'] for x in steady(r['steps'])):.2f} s, "
                      f"held-out pass@1 {r['held_out_pass@1']:.3f}", flush=True)
    ours, trl = summarize(results["ours"]), summarize(results["trl"])
    print(f"\n{'':10s} {'step s':>8s} {'generate':>9s} {'logprob':>8s} {'update':>8s} {'rest':>6s}  held-out pass@1")
    for name, m in (("ours", ours), ("trl", trl)):
        print(f"{name:10s} {m['step']:8.2f} {m['generation']:9.2f} {m['logprob']:8.2f} {m['update']:8.2f} "
              f"{m['rest']:6.2f}  {m['held_out_pass@1']}")
    ratio = ours["step"] / trl["step"]
    print(f"\nours / TRL steady step: {ratio:.2f}x (goal <= 0.8)")
    if args.json:
        import torch
        import trl as trl_pkg
        Path(args.json).write_text(json.dumps({
            "command": "python benchmarks/" + " ".join([Path(__file__).name, *sys.argv[1:]]),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=REPO).stdout.strip(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "trl": trl_pkg.__version__},
            "settings": s, "ours": ours, "trl": trl, "ratio_ours_over_trl": ratio,
            "rounds": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
