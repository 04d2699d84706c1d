"""What runs where, decided once before any worker starts: the plan.

The plan is built in stages, each a module with a typed result that reads only its own config sections: the
dataflow graph (graph.py), the backends (backends.py), the worker groups (groups.py, with their row sizes in
sizes.py), the groups' deployments (deployments.py, with the models' features in features.py), the run's inputs
(models.py, inputs.py) and the memory estimate (memory.py, memory_terms.py); each worker's spec is built from
the plan at launch (trainer/worker_specs.py). plan.py's `make_plan` is the one place that reads the whole
config and hands each stage its sections; format.py shows the result as the dry run's table and plan.json.
"""
from .format import format_plan, landed_dict, plan_dict, write_plan_json
from .groups import GroupPlan
from .plan import Plan, check_cluster, make_plan

__all__ = ["GroupPlan", "Plan", "check_cluster", "format_plan", "landed_dict", "make_plan", "plan_dict",
           "write_plan_json"]
