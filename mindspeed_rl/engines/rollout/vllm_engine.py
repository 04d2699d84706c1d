"""The vLLM rollout backend's class as the registry names it. Which of its two engines a run gets is the `serve`
option's choice (`generate_config.vllm.serve`), made here so that neither engine's module imports the other:
the offline `vllm.LLM` (`vllm_rollout.py`, one call per micro-batch) or the server (`vllm_serving.py`,
AsyncLLM, rows of several micro-batches sharing its slots)."""
from __future__ import annotations

from ..base import RolloutEngine, RolloutSpec
from .vllm_rollout import VLLMRolloutEngine
from .vllm_serving import VLLMServingEngine


def engine_class(options: dict) -> type[VLLMRolloutEngine]:
    return VLLMServingEngine if options.get("serve") else VLLMRolloutEngine


class VLLMEngine(VLLMRolloutEngine):
    """The offline engine's class to whoever asks what the backend is; building, refusing and taking partial
    rollouts go to the engine class the options choose (it is never built itself)."""

    @classmethod
    def build(cls, spec: RolloutSpec) -> RolloutEngine:
        return engine_class(spec.options).build(spec)

    @classmethod
    def refusal(cls, options: dict, tp: int) -> str | None:
        return engine_class(options).refusal(options, tp)

    @classmethod
    def takes_partial_rollout(cls, options: dict) -> bool:
        return engine_class(options).takes_partial_rollout(options)
