"""The layout planner: pure Python (no torch, Ray or DeepSpeed import), answers in well under a second.

plan_job(cfg, world_size=None, top_k=5) -> PlanResult   search every valid layout, rank by predicted speed
resolve(cfg, world_size=None) -> (JobConfig, PlanResult)  fill every auto in parallel/train (and cluster.gpu)
evaluate_layout(cfg, layout, world_size=None) -> dict   one plan object for a given layout
"""

from rayspeed.planner.plan import PlanResult, evaluate_layout, plan_job, resolve

__all__ = ["PlanResult", "evaluate_layout", "plan_job", "resolve"]
