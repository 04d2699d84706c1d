"""The critic's value step: per-token values of the responses by the value model's engine (PPO's GAE reads
them). Its declaration, its micro-batch size from critic_config and its call sit in this one module.
"""
from __future__ import annotations

from ..compute import Output, compute_step
from ..impls import Forward, rows_per_get


def values(batch: dict, rows: list[int], *, engine, micro_batch_size: int) -> Output:
    v = engine.values(batch["prompts"], batch["responses"], micro_batch_size)
    n = sum(int(r.numel()) for r in v)
    return Output({"values": v}, {"values_sum": float(sum(float(r.sum()) for r in v)), "values_tokens": float(n)})


@compute_step("values", "inference", ("prompts", "responses"), ("values",), engine="value",
              doc="a critic's per-token values of the responses")
class Values(Forward):
    """A critic's per-token values."""
    method = "values"

    @staticmethod
    def args(cfg, mfc, info):
        return {"count": rows_per_get(mfc, cfg.critic_config.forward_micro_batch_size_per_device,
                                cfg.rl_config.n_samples_per_prompt)}

    def compute(self, batch, rows, engine):
        return values(batch, rows, engine=engine, micro_batch_size=self.count)
