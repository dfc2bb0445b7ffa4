"""Job configuration: schema (dataclasses) and loading (YAML, --set overrides, checks)."""

from rayspeed.config.load import check, describe_keys, flatten, load, parse, to_dict, to_yaml
from rayspeed.config.schema import AUTO, JobConfig

__all__ = ["AUTO", "JobConfig", "check", "describe_keys", "flatten", "load", "parse", "to_dict", "to_yaml"]
