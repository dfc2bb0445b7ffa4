"""Training objectives past next-token prediction (rayspeed.objectives.dpo)."""
