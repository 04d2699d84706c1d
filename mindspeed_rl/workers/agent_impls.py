"""The agent rollout as an MFC implementation (`fn="agent_generate"`, workers/impls.py's registry).

The driver hands it generate_config's sampling keys and generate_config.agent; per step it wraps
the MFC's rollout engine in an `agent.AgentLoop` with the worker's tokenizer. The MFC is the
algorithm's generate MFC: `dataflow/rollout_options.py` switches it to this function when
`generate_config.agent.enable` is on.
"""
from __future__ import annotations

from . import compute as C
from .impls import Generate


@C.compute_step("agent_generate", "generate", ("prompts",), ("responses", "response_length", "weight_version",
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
        from ..agent import AgentLoop, get_syntax, get_tools
        a = self.args["agent"]
        self.loop = AgentLoop(self.engine, ctx.host.tokenizer, get_tools(a["tools"]), get_syntax(a["syntax"]),
                              a["max_turns"], a["tool_timeout_s"], tool_choice=a["tool_choice"],
                              return_direct=a["return_direct"])

    def __call__(self, batch, rows):
        with self.lock.reading() if self.engine.concurrent_generate else self.lock.writing():
            return C.agent_generate(batch, rows, loop=self.loop, params=self.params, seed=self.args["seed"],
                                    step=self.ctx.step, drop_truncated=self.args.get("drop_truncated", False))
