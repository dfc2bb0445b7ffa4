"""The DeepSpeed engine: config generation from the plan, optimizer/schedule, engine construction."""
