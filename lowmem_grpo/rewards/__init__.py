"""Rewards: TRL's reward-function signature, loading what a recipe names, calling and checking.

    base.py      RewardError, RewardFunction, completion_text (shared by everything below)
    builtins.py  the built-in reward functions a recipe names (numeric_answer, exact_match, ...)
    loading.py   load_reward_functions: built-ins, module:function, path/file.py:function, callables, models
    model.py     RewardModel: a sequence-classification model as a reward function (placed gpu | stream | cpu)
    calling.py   compute_rewards (weighted total + per-function table), reward_metrics, scorable_totals,
                 RewardLogs (TRL's log_metric / log_extra)

Imports nothing of lowmem_grpo outside this package but the layer streaming of policy/streaming.py.
"""

from .base import RewardError, RewardFunction, completion_text
from .builtins import BUILTINS
from .calling import RewardLogs, compute_rewards, nan_std, reward_metrics, scorable_totals
from .loading import load_reward_functions
from .model import ModelSettings, RewardModel, load_reward_model

__all__ = ["RewardError", "RewardFunction", "completion_text", "BUILTINS", "compute_rewards", "reward_metrics",
           "load_reward_functions", "RewardLogs", "nan_std", "scorable_totals", "ModelSettings", "RewardModel",
           "load_reward_model"]
