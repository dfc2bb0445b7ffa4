"""The layout planner: pure Python (no torch, Ray or DeepSpeed import), answers in well under a second.

plan_job(cfg, world_size=None, top_k=5, profile=None) -> PlanResult   search every valid layout, rank by speed
resolve(cfg, world_size=None, profile=None) -> (JobConfig, PlanResult)  fill every auto in parallel/train (and
                                                        cluster.gpu, parallel.stage_layers)
evaluate_layout(cfg, layout, world_size=None, profile=None) -> dict   one plan object for a given layout
profile: a hardware profile from `rayspeed calibrate` (path or dict); default: the job's cluster.profile
"""

from rayspeed.planner.plan import PlanResult, evaluate_layout, plan_job, resolve

__all__ = ["PlanResult", "evaluate_layout", "plan_job", "resolve"]
