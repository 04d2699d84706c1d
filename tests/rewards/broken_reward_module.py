"""Importing this module fails: the registry must report the import error."""
import mindspeed_rl_no_such_dependency

reward = mindspeed_rl_no_such_dependency.reward
