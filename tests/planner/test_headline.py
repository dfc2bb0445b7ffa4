"""`rayspeed plan --explain` on a job at the memory edge starts with where it stands and the nearest ways out,
each planned (rayspeed.planner.headline); a comfortable job's explanation starts as before."""

from pathlib import Path

from rayspeed.config.load import load
from rayspeed.planner import plan_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_job_at_the_memory_edge_leads_with_the_recommendation():
    job = load(str(CONFIGS / "llama-70b-64xh100.yaml"), [])
    edge = plan_job(job, world_size=20)
    first = edge.explain.splitlines()[0]
    assert first.startswith("full training of this model on 20 x h100-sxm-80gb (80 GiB) is at the memory edge: the "
                            "chosen layout needs ")
    assert "; LoRA (model.adapter.type: lora) fits at " in first and "; 40 GPUs fits at " in first
    lora_gib = float(first.split("LoRA (model.adapter.type: lora) fits at ")[1].split(" GiB")[0])
    assert lora_gib < edge.best["memory_gib_per_gpu"]  # the way out needs less than the chosen layout
    comfortable = plan_job(job, world_size=64)
    assert comfortable.explain.startswith("rayspeed plan: llama-70b-64xh100:")
