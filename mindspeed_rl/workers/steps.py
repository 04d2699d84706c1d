"""The built-in compute steps, by the modules whose classes declare them (`compute.compute_step`): importing
this one list registers every one in `compute.FUNCTIONS`. The package imports it (`workers/__init__.py`), so
whatever reads FUNCTIONS through a module of this package finds the built-ins there; a user's steps register
the same way from a `trainer.plugins` module."""
from . import impls, agent_impls, reward_impls  # noqa: F401  (impls first: the other two build on its classes)

BUILTIN_STEP_MODULES = (impls, agent_impls, reward_impls)
