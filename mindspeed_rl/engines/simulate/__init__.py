"""The `simulate` backend: every model and compute function of a run replaced by a sleep per row.

Why: to measure the pipeline itself (the dock, the stage loops, the driver, weight sync's
bookkeeping, cross-step asynchrony) against what a cost model says is possible, without the
machine's cores limiting the result. Sleeping stages do not compete for CPU, so on a 2-core
machine six stages can still run "at once", as they would on six accelerators.

`trainer.simulate_cost_s_per_row` (stage -> seconds per row) chooses it for both kinds
(`registry.chosen_backends`). Its registry rows name `stand_in.py` (`Backend.stand_in`), which
says what the run's engines and compute MFCs become:
- `engines.py`: rollout and train engines that load no model; rollout, log-prob, value and train
  calls sleep per row and return placeholders, weight sync moves one placeholder tensor;
- `stand_in.py`: their options (the cost of each call), and the compute MFCs without an engine
  (rewards, advantages) sleeping per row and pushing placeholders instead of running their function;
- `ideal.py`: the step times the same cost model allows (`ideal_pipeline`).

Every MFC runs the real stage loop against the real dock, with its real micro-batch size, input
columns and consumer, so downstream stages see their inputs appear exactly as in a real step; a
train step is the real mini-batch loop and weight sync the real bucketed path. Everything else
(graph, placement, dock, blocking order, the driver's step) is the real code path.
`benchmarks/pipeline_efficiency.py` and `benchmarks/async_speedup.py` run it.
"""
from .engines import SimulatedRolloutEngine, SimulatedTrainEngine
from .ideal import IdealPipeline, ideal_pipeline
from .stand_in import PLACEHOLDER, simulated_compute

__all__ = ["IdealPipeline", "PLACEHOLDER", "SimulatedRolloutEngine", "SimulatedTrainEngine", "ideal_pipeline",
           "simulated_compute"]
