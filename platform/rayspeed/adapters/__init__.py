"""Adapter fine-tuning: low-rank adapters beside the frozen linear layers of a built (and sharded) model
(lora.py), the transform that adds them (transform.py) and the PEFT files they are exported to (peft_files.py)."""
