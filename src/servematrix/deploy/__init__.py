"""Deployments: recipes (command lines as data), process supervision, GPU locks, warm reuse.

``recipes`` turns a cell into a :class:`~servematrix.deploy.processes.Plan` (processes in start
order); ``supervise`` starts and stops one plan's processes; ``gpulock`` serialises cells on
the GPUs they pin; ``warm`` keeps a started deployment for the next cell that needs it.
"""

from servematrix.deploy.processes import Plan, Process
from servematrix.deploy.recipes import RECIPES, plan

__all__ = ["RECIPES", "Plan", "Process", "plan"]
