"""rayspeed: plan, run and track distributed LLM training on Ray Train + DeepSpeed."""

__version__ = "0.1.0"
