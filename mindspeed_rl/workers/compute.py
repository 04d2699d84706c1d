"""What each MFC computes on a micro-batch of rows: functions of (rows, engines), by name.

The worker's loop (`stage.py`) is the same for every MFC; only the function differs. An MFC names
its function (`MFCDef.fn`, or its interface type's default); `FUNCTIONS` says what each one reads,
what it can write and which engine it needs (each declared by `compute_step` above its
implementation class), so the plan checks an algorithm's MFCs before any worker starts. A function gets the micro-batch as `{name: [row tensors]}` (dock columns renamed by
the MFC's `input_key_remap`) plus the row indexes, and returns its outputs as `{name: [row
tensors]}` (renamed by `output_key_remap`; outputs the MFC does not list are dropped) and a dict
of metric sums.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..algorithms import (agg_loss, broadcast_to_tokens, corrected_policy_loss, gae_advantages, grpo_advantages,
                          kl_penalty, outcome_token_rewards, overlong_penalty, policy_loss, remax_advantages, truncated,
                          value_loss)
from ..dataflow.mfc import InterfaceType, MFCDef
from ..dataflow.options import uses_kl_loss
from ..engines.batching import unpad_rows


@dataclass(frozen=True)
class ComputeFn:
    """What a compute function reads and writes, for the plan's checks and the docs."""
    name: str
    impl: Any                         # its implementation (workers/impls.py): an Impl class or "module:Class"
    interface: InterfaceType
    inputs: tuple[str, ...]           # names it must get
    outputs: tuple[str, ...]          # names it can write (an MFC writes a subset)
    optional: tuple[str, ...] = ()    # names it uses when present
    engine: str = ""                  # "rollout", "policy", "value", "reward" or "" (none)
    doc: str = ""


FUNCTIONS: dict[str, ComputeFn] = {}   # name -> its declaration; the built-ins declare themselves on their
                                       # implementation classes (impls.py, reward_impls.py, agent_impls.py)


def register_function(fn: ComputeFn) -> ComputeFn:
    """Add (or replace) a compute function: an algorithm's MFC may then name it (`fn=...`). A plugin module
    (`trainer.plugins`) calls it, so the driver and every worker know the function."""
    if not isinstance(fn, ComputeFn):
        raise TypeError(f"register_function: {fn!r} is not a ComputeFn")
    FUNCTIONS[fn.name] = fn
    return fn


def compute_step(name: str, interface: InterfaceType | str, inputs: Sequence[str], outputs: Sequence[str] = (), *,
                 optional: Sequence[str] = (), engine: str = "", doc: str = "") -> Callable[[type], type]:
    """Declare the decorated implementation (a `workers.impls.Impl` subclass: its `args` from the config, its
    call on a micro-batch) as the compute function `name`, beside it, and register it: a new compute step is
    one class in one module (a `trainer.plugins` module for a user's) under this one line.

        @compute_step("neg_reward", "compute", inputs=("rm_scores",), outputs=("neg_scores",))
        class NegReward(Impl):
            def __call__(self, batch, rows):
                return Output({"neg_scores": [-s for s in batch["rm_scores"]]}, {})
    """
    def register(impl: type) -> type:
        text = doc or next(iter((impl.__doc__ or "").strip().splitlines()), "")
        register_function(ComputeFn(name, impl, InterfaceType(interface), tuple(inputs), tuple(outputs),
                                    tuple(optional), engine, text))
        return impl
    return register


DEFAULT_FN = {InterfaceType.GENERATE: "generate", InterfaceType.INFERENCE: "log_probs",
              InterfaceType.TRAIN_STEP: "policy_train"}


def fn_name(mfc: MFCDef) -> str | None:
    """The compute function an MFC runs: its own `fn`, else its interface type's default."""
    return mfc.fn or DEFAULT_FN.get(InterfaceType(mfc.interface_type))


def check_mfc(mfc: MFCDef) -> ComputeFn:
    """The MFC's function, after checking it exists, fits the interface and gets its inputs.

    Raises ValueError naming the MFC, the function and the names that do not match.
    """
    name = fn_name(mfc)
    kind = InterfaceType(mfc.interface_type)
    if name is None:
        raise ValueError(f"MFC {mfc.name!r} is a compute MFC without fn=...; name its function, one of "
                         f"{sorted(n for n, f in FUNCTIONS.items() if f.interface is kind)}")
    f = FUNCTIONS.get(name)
    if f is None:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} is not a known compute function; known: {sorted(FUNCTIONS)}")
    if f.interface is not kind:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} is a {f.interface.value} function but the MFC is "
                         f"{kind.value}; use one of {sorted(n for n, g in FUNCTIONS.items() if g.interface is kind)}")
    got = {mfc.arg_name(k) for k in mfc.input_keys}
    missing = [k for k in f.inputs if k not in got]
    if missing:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} needs {list(f.inputs)} but the MFC's input_keys "
                         f"{list(mfc.input_keys)} (after input_key_remap) lack {missing}; add them or remap a column "
                         f"onto them with input_key_remap")
    inverse = {v: k for k, v in mfc.output_key_remap.items()}
    unknown = [k for k in mfc.output_keys if inverse.get(k, k) not in f.outputs]
    if unknown:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} writes {list(f.outputs) or 'nothing'}, not "
                         f"{unknown}; map one of its outputs onto the column with output_key_remap")
    return f


@dataclass
class Output:
    columns: dict[str, list]
    metrics: dict[str, float]  # sums over rows/micro-batches; the driver turns them into means
    samples: list = field(default_factory=list)  # rows as text for people to read (trainer/samples.py)


def as_scalars(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(r).reshape(-1)[0].float() for r in rows])


def scalar_rows(values: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
    return [v.reshape(1).to(dtype) for v in values]


def rollout_seed(seed: int, step: int, row: int) -> int:
    """Sampling seed of one row: the same row at the same step samples the same tokens, whichever
    micro-batch, mode, process or backend generates it."""
    return int(np.random.SeedSequence([seed, step, row]).generate_state(1, dtype=np.uint64)[0] >> 1)


def generate(batch: dict, rows: list[int], *, engine, params, seed: int, step: int,
             drop_truncated: bool = False) -> Output:
    """One response per row. `response/truncated_fraction` counts the rows cut by max_new_tokens; with
    `drop_truncated` (rl_config.overlong_buffer) a `loss_mask` column leaves them out of the loss."""
    version = engine.weight_version
    out = engine.generate(batch["prompts"], params, [rollout_seed(seed, step, r) for r in rows])
    cut = truncated(out.responses, params.max_new_tokens, params.stop_token_ids)
    masks = [torch.full((int(r.numel()),), 0 if c and drop_truncated else 1, dtype=torch.int8)
             for r, c in zip(out.responses, cut.tolist())]
    return _rollout_output(batch, rows, engine, version, out.responses, out.log_probs, masks, cut,
                           switches=out.version_switches)


def agent_generate(batch: dict, rows: list[int], *, loop, params, seed: int, step: int,
                   drop_truncated: bool = False) -> Output:
    """Multi-turn trajectories with tool calls (`agent.AgentLoop`): the responses hold model and tool
    tokens, `loss_mask` marks the model's (and is all 0 on a truncated row with `drop_truncated`)."""
    version = loop.engine.weight_version
    out = loop.run(batch["prompts"], params, [rollout_seed(seed, step, r) for r in rows])
    cut = torch.tensor(out.truncated, dtype=torch.bool)
    masks = [m * 0 if c and drop_truncated else m for m, c in zip(out.loss_masks, out.truncated)]
    res = _rollout_output(batch, rows, engine=loop.engine, version=version, responses=out.responses,
                          log_probs=out.log_probs, masks=masks, cut=cut)
    res.metrics.update({"agent_turns_sum": float(sum(out.turns)),
                        "agent_tool_tokens_sum": float(sum(int((m == 0).sum()) for m in out.loss_masks)),
                        **{f"agent_calls_{k}": float(v) for k, v in out.calls.items()}})
    return res


def _rollout_output(batch, rows, engine, version, responses, log_probs, masks, cut, switches=None) -> Output:
    """The rollout's columns and metric sums. `version`: the weights the call started on, which its rows count
    as generated by (the oldest any of their tokens saw); with rl_config.partial_rollout the weights may have
    moved while it ran (`partial_count`: the rows whose tokens came from more than one version, by the engine's
    `version_switches` where it says; else every row of a call the weights moved under, reported only then)."""
    lengths = [int(r.numel()) for r in responses]
    weight_version = torch.tensor([version], dtype=torch.int64)
    if switches is not None:
        mixed = sum(1 for s in switches if any(k > 0 for k in s))
        moved = {"partial_count": float(mixed)} if mixed else {}
    else:
        moved = {"partial_count": float(len(rows))} if engine.weight_version != version else {}
    return Output({"responses": responses,
                   "response_length": [torch.tensor([n], dtype=torch.int64) for n in lengths],
                   "weight_version": [weight_version.clone() for _ in rows],
                   "rollout_log_prob": [lp.float() for lp in log_probs],
                   "loss_mask": masks},
                  {"response_length_sum": float(sum(lengths)), "rows": float(len(rows)),
                   "prompt_length_sum": float(sum(int(p.numel()) for p in batch["prompts"])),
                   "response_length_max": float(max(lengths) if lengths else 0),
                   "truncated_count": float(cut.sum()),
                   "weight_version_sum": float(version * len(rows)),
                   "weight_version_min": float(version), **moved})


def log_probs(batch: dict, rows: list[int], *, engine, micro_batch_size: int) -> Output:
    """Log-probs of the responses; with `rollout_log_prob` in the batch also how far they are from
    the rollout engine's own (verl's rollout_probs_diff): ~1e-6 in an on-policy float32 run proves the
    rollout serves the trainer's weights, a gap means a sync that did not arrive or a numerics gap."""
    lp = engine.log_probs(batch["prompts"], batch["responses"], micro_batch_size)
    metrics = {}
    if "rollout_log_prob" in batch:
        metrics = logprob_diff(lp, batch["rollout_log_prob"], batch.get("loss_mask"))
    return Output({"log_prob": lp}, metrics)


def logprob_diff(log_prob: Sequence[torch.Tensor], rollout_log_prob: Sequence[torch.Tensor],
                 loss_mask: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
    """|log_prob - rollout_log_prob| over response tokens: its max, and sum and count for the mean.
    With `loss_mask`, over the model's own tokens only (a tool's output has no rollout log-prob)."""
    diffs = [(torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs()
             for a, b in zip(log_prob, rollout_log_prob)]
    if loss_mask is not None:
        diffs = [d[torch.as_tensor(m).reshape(-1)[:d.numel()] > 0] for d, m in zip(diffs, loss_mask)]
    tokens = sum(int(d.numel()) for d in diffs)
    return {"logprob_diff_max": float(max((float(d.max()) for d in diffs if d.numel()), default=0.0)),
            "logprob_diff_sum": float(sum(float(d.sum()) for d in diffs)), "logprob_diff_tokens": float(tokens)}


def values(batch: dict, rows: list[int], *, engine, micro_batch_size: int) -> Output:
    v = engine.values(batch["prompts"], batch["responses"], micro_batch_size)
    n = sum(int(r.numel()) for r in v)
    return Output({"values": v}, {"values_sum": float(sum(float(r.sum()) for r in v)), "values_tokens": float(n)})


def rule_reward(batch: dict, rows: list[int], *, reward_fn: Callable, tokenizer, decode_label: Callable,
                overlong: tuple[int, int, float] | None = None) -> Output:
    """rl_config.reward_fn on the decoded responses. `overlong` = (max_new_tokens, buffer, factor): DAPO's soft
    penalty on long responses is added to rm_scores (`reward_sum` stays the function's own score; the
    penalty's sum is `overlong_penalty_sum`). A reward function with a `parts` dict (name -> function)
    also logs each part's mean (`reward/<name>_mean`)."""
    from ..rewards import score_batch

    responses = tokenizer.batch_decode([r.tolist() for r in batch["responses"]], skip_special_tokens=True)
    prompts = tokenizer.batch_decode([p.tolist() for p in batch["prompts"]], skip_special_tokens=True)
    answers = [decode_label(lbl) for lbl in batch["labels"]]
    scores = score_batch(reward_fn, responses, answers, prompts)
    t = torch.tensor(scores, dtype=torch.float32)
    metrics = {"reward_sum": float(t.sum()), "reward_rows": float(len(rows)),
               "reward_max_count": float((t >= 1.0).sum())}
    for name, part in getattr(reward_fn, "parts", {}).items():
        metrics[f"reward_part_{name}_sum"] = float(sum(score_batch(part, responses, answers, prompts)))
    if overlong is not None and overlong[1] > 0:
        penalty = overlong_penalty([int(r.numel()) for r in batch["responses"]], *overlong)
        t = t + penalty
        metrics["overlong_penalty_sum"] = float(penalty.sum())
    samples = [{"row": int(r), "prompt": p, "response": s, "answer": a, "reward": float(x)}
               for r, p, s, a, x in zip(rows, prompts, responses, answers, t.tolist())]
    return Output({"rm_scores": scalar_rows(t)}, metrics, samples)


def grpo_advantage(batch: dict, rows: list[int], *, n_samples_per_prompt: int, eps: float,
                   norm_by_std: bool) -> Output:
    scores = as_scalars(batch["rm_scores"])
    groups = torch.tensor(rows, dtype=torch.int64) // n_samples_per_prompt
    adv = grpo_advantages(scores, groups, eps=eps, norm_by_std=norm_by_std)
    return Output({"advantages": scalar_rows(adv)}, {})


def _token_matrix(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rows -> ([B, width] values, [B, width] mask)."""
    width = max(1, max(int(r.numel()) for r in rows))
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        mask[i, :int(r.numel())] = 1.0
    return _rows_to_matrix(rows, width), mask


def gae_advantage(batch: dict, rows: list[int], *, gamma: float, lam: float) -> Output:
    """GAE with the outcome reward on each response's last token; lengths come from the values rows."""
    v, mask = _token_matrix(batch["values"])
    rewards = outcome_token_rewards(as_scalars(batch["rm_scores"]), mask)
    adv, ret = gae_advantages(rewards, v, mask, gamma, lam)
    n = int(mask.sum())
    return Output({"advantages": unpad_rows(adv, mask), "returns": unpad_rows(ret, mask)},
                  {"returns_sum": float((ret * mask).sum()), "returns_tokens": float(n)})


def remax_advantage(batch: dict, rows: list[int]) -> Output:
    """Reward-to-go of the sampled response minus the greedy response's reward, per token."""
    lengths = [int(torch.as_tensor(x).reshape(-1)[0]) for x in batch["response_length"]]
    width = max(1, max(lengths))
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    baselines = as_scalars(batch["reward_baselines"])
    adv, ret = remax_advantages(outcome_token_rewards(as_scalars(batch["rm_scores"]), mask), baselines, mask)
    return Output({"advantages": unpad_rows(adv, mask), "returns": unpad_rows(ret, mask)},
                  {})


@dataclass
class PolicyLossConfig:
    clip_low: float
    clip_high: float
    clip_c: float
    agg: str
    use_kl_loss: bool
    kl_type: str
    entropy_coeff: float
    off_policy_correction: str = "none"   # algorithms.OFF_POLICY_CORRECTIONS
    tis_cap: float = 2.0


def policy_loss_fn(loss_cfg: PolicyLossConfig, kl_coef: float) -> Callable:
    """The actor's loss on one micro-batch, as a train engine calls it: (model output, micro-batch) ->
    (loss, metrics). Clipped policy loss (+ entropy bonus, + KL to the reference when the KL
    coefficient is > 0)."""
    def loss_fn(out, mb) -> tuple[torch.Tensor, dict[str, float]]:
        batch, logp = mb.data, out.log_probs
        mask = token_mask(out.response_mask, batch)
        width = mask.shape[1]
        # no old_log_prob column: an on-policy update, whose log-probs at its start are the old ones
        old = ((_rows_to_matrix(batch["old_log_prob"], width) * mask.cpu()).to(logp.device)
               if "old_log_prob" in batch else logp.detach() * mask)
        adv = advantage_matrix(batch["advantages"], mask)
        if loss_cfg.off_policy_correction != "none":  # rows from older weights: weigh by behaviour IS (docs/async.md)
            behaviour = (_rows_to_matrix(batch["rollout_log_prob"], width) * mask.cpu()).to(logp.device)
            pg_loss, pg_metrics = corrected_policy_loss(
                logp, old, behaviour, adv, mask, mode=loss_cfg.off_policy_correction, cap=loss_cfg.tis_cap,
                clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high, clip_c=loss_cfg.clip_c, agg=loss_cfg.agg)
        else:
            pg_loss, pg_metrics = policy_loss(logp, old, adv, mask, clip_low=loss_cfg.clip_low,
                                              clip_high=loss_cfg.clip_high, clip_c=loss_cfg.clip_c, agg=loss_cfg.agg)
        loss = pg_loss
        ent = agg_loss(out.entropy, mask, loss_cfg.agg)
        if loss_cfg.entropy_coeff:
            loss = loss - loss_cfg.entropy_coeff * ent
        kl_metric = {}
        if needs_reference(loss_cfg, kl_coef):
            if "ref_log_prob" not in batch:
                raise ValueError(f"the actor loss has a KL term (actor_config.use_kl_loss=true, KL coefficient "
                                 f"{kl_coef}) but the train MFC gets no ref_log_prob; build the graph with "
                                 "options_from_config(cfg) so it has the reference stage")
            ref = _rows_to_matrix(batch["ref_log_prob"], width).to(logp.device)
            kl = agg_loss(kl_penalty(logp, ref, loss_cfg.kl_type), mask, loss_cfg.agg)
            loss = loss + kl_coef * kl
            kl_metric = {"kl": float(kl.detach())}
        off_policy = {{"kl": "behaviour_kl"}.get(k.split("/", 1)[1], k.split("/", 1)[1]): float(v)
                      for k, v in pg_metrics.items() if k.startswith("off_policy/")}  # actor/is_weight_mean, ...
        return loss, {"pg_loss": float(pg_loss.detach()), **kl_metric, "entropy": float(ent.detach()),
                      "pg_clipfrac": pg_metrics["pg_clipfrac"], "ppo_kl": pg_metrics["ppo_kl"],
                      "pg_clipfrac_lower": pg_metrics["pg_clipfrac_lower"], **off_policy}
    return loss_fn


def token_mask(response_mask: torch.Tensor, batch: dict) -> torch.Tensor:
    """The [B, R] mask every per-token term of a loss is taken over: the engine's response mask (1 on
    real response tokens), times the rows' `loss_mask` column when the batch has one (verl's
    `response_mask` of multi-turn rollouts: 1 on the model's own tokens, 0 on a tool's output, and
    all 0 on a row dropped from the loss). So the policy loss, its clip fractions, the entropy, the
    KL term and the advantages all leave tool tokens out, and a trajectory's loss equals the loss
    over its model tokens alone."""
    rows = batch.get("loss_mask")
    if rows is None:
        return response_mask
    return response_mask * _rows_to_matrix(rows, response_mask.shape[1]).to(response_mask.device,
                                                                             response_mask.dtype)


def needs_reference(loss_cfg: PolicyLossConfig, kl_coef: float) -> bool:
    """Does this micro-batch's loss have a KL term? Not when the coefficient is 0: then nothing reads
    ref_log_prob, and the graph has no reference stage to write it (dataflow/options.py)."""
    return uses_kl_loss(loss_cfg.use_kl_loss, kl_coef)


def advantage_matrix(rows: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """[B, R] advantages: a one-value row (GRPO's per-response advantage) is broadcast over its
    tokens, a longer row (GAE, ReMax: one per token) is laid out along them."""
    if all(int(r.numel()) == 1 for r in rows):
        return broadcast_to_tokens(as_scalars(rows).to(mask.device), mask)
    return _rows_to_matrix(rows, mask.shape[1]).to(mask.device) * mask


@dataclass
class ValueLossConfig:
    clip_value: float
    agg: str


def value_loss_fn(loss_cfg: ValueLossConfig) -> Callable:
    """The critic's clipped value loss on one micro-batch: (model output, micro-batch) -> (loss, metrics)."""
    def loss_fn(out, mb) -> tuple[torch.Tensor, dict[str, float]]:
        mask = token_mask(out.response_mask, mb.data)
        width = mask.shape[1]
        old = _rows_to_matrix(mb.data["values"], width).to(mask.device)
        returns = _rows_to_matrix(mb.data["returns"], width).to(mask.device)
        loss, m = value_loss(out.values, returns, old, mask, loss_cfg.clip_value, loss_cfg.agg)
        return loss, {"vf_loss": float(loss.detach()), "vf_clipfrac": float(m["vf_clipfrac"]),
                      "vpred_mean": float(m["vpred_mean"])}
    return loss_fn


def _rows_to_matrix(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = min(int(r.numel()), width)
        out[i, :n] = torch.as_tensor(r[:n], dtype=torch.float32)
    return out

