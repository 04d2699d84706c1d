"""mindspeed_rl: asynchronous RL post-training of language models around a central TransferDock."""
__version__ = "0.1.0"
