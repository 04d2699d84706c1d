"""The agent rollout step (`fn="agent_generate"`): multi-turn trajectories with tool calls.

The driver hands it generate_config's sampling keys and generate_config.agent; per step it wraps the MFC's
rollout engine in an `agent.AgentLoop` with the worker's tokenizer. The MFC is the algorithm's generate MFC:
`dataflow/rollout_options.py` switches it to this function when `generate_config.agent.enable` is on. It is
the rollout step (generate.py) with another loop inside, so it subclasses `Generate` and writes its columns
with the same `rollout_output`.
"""
from __future__ import annotations

import torch

from ..compute import Output, compute_step, rollout_seed
from .generate import Generate, rollout_output


def agent_generate(batch: dict, rows: list[int], *, loop, params, seed: int, step: int,
                   drop_truncated: bool = False) -> Output:
    """Multi-turn trajectories with tool calls (`agent.AgentLoop`): the responses hold model and tool
    tokens, `loss_mask` marks the model's (and is all 0 on a truncated row with `drop_truncated`)."""
    version = loop.engine.weight_version
    out = loop.run(batch["prompts"], params, [rollout_seed(seed, step, r) for r in rows])
    cut = torch.tensor(out.truncated, dtype=torch.bool)
    masks = [m * 0 if c and drop_truncated else m for m, c in zip(out.loss_masks, out.truncated)]
    res = rollout_output(batch, rows, engine=loop.engine, version=version, responses=out.responses,
                         log_probs=out.log_probs, masks=masks, cut=cut)
    res.metrics.update({"agent_turns_sum": float(sum(out.turns)),
                        "agent_tool_tokens_sum": float(sum(int((m == 0).sum()) for m in out.loss_masks)),
                        **{f"agent_calls_{k}": float(v) for k, v in out.calls.items()}})
    return res


@compute_step("agent_generate", "generate", ("prompts",), ("responses", "response_length", "weight_version",
              "rollout_log_prob", "loss_mask"), engine="rollout",
              doc="multi-turn trajectories with tool calls (generate_config.agent); loss_mask: 1 on the model's "
                  "tokens, 0 on the tools'")
class AgentGenerate(Generate):
    """Multi-turn trajectories with tool calls; writes loss_mask beside the responses."""

    @staticmethod
    def args(cfg, mfc, info):
        ag = cfg.generate_config.agent
        return {**Generate.args(cfg, mfc, info),
                "agent": {"tools": list(ag.tools), "max_turns": ag.max_turns, "syntax": ag.syntax,
                          "tool_timeout_s": ag.tool_timeout_s, "tool_choice": ag.tool_choice,
                          "return_direct": list(ag.return_direct)}}

    def __init__(self, ctx):
        super().__init__(ctx)
        from ...agent import AgentLoop, get_syntax, get_tools
        a = self.args["agent"]
        self.loop = AgentLoop(self.engine, ctx.host.tokenizer, get_tools(a["tools"]), get_syntax(a["syntax"]),
                              a["max_turns"], a["tool_timeout_s"], tool_choice=a["tool_choice"],
                              return_direct=a["return_direct"])

    def __call__(self, batch, rows):
        with self.lock.reading() if self.engine.concurrent_generate else self.lock.writing():
            return agent_generate(batch, rows, loop=self.loop, params=self.params, seed=self.args["seed"],
                                  step=self.ctx.step, drop_truncated=self.args.get("drop_truncated", False))
