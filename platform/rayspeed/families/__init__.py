"""The model families rayspeed runs: one record per family (`Family`, a module each), and their registry.

    by_architecture("Qwen2ForCausalLM").qkv_bias   # True
    by_model_type("mistral").architecture          # what a config.json without `architectures` names
    names()                                        # every supported architecture, in module order

Torch-free, below the config: the config's validation and Hugging Face reader/writer, the planner's shape, the
weight loader, the export and the consolidation all read the record instead of comparing names.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Optional

from rayspeed.families.family import ROPE_TYPES, Family, TensorNames
from rayspeed.families.vision import VisionLanguage

__all__ = ["DEFAULT", "FAMILIES", "ROPE_TYPES", "Family", "TensorNames", "by_architecture", "by_model_type",
           "find", "names", "records_of", "text_family", "vision_language", "VisionLanguage"]


def records_of(path: Any, package: str, attribute: str, kind: type) -> tuple[Any, ...]:
    """The `attribute` of every module of a package that is a `kind`, by module name: adding one is adding its
    module (the family records here, their decoders' compositions in rayspeed.model.families)."""
    found = []
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        record = getattr(importlib.import_module(f"{package}.{info.name}"), attribute, None)
        if isinstance(record, kind):
            found.append(record)
    return tuple(found)


def discover() -> tuple[Family, ...]:
    """The FAMILY of every module of this package: adding a family is adding its module."""
    return records_of(__path__, __name__, "FAMILY", Family)


FAMILIES: tuple[Family, ...] = discover()
DEFAULT: Family = next(f for f in FAMILIES if f.model_type == "llama")
"""The family of a model section that names none."""

VISION_LANGUAGE: tuple[VisionLanguage, ...] = records_of(__path__, __name__, "VISION", VisionLanguage)
"""The VISION of every module of this package: the vision-language architectures (an image path before a text
model of any family)."""


def vision_language(architecture: Optional[str]) -> Optional[VisionLanguage]:
    """The vision-language record of a Hugging Face architecture name, or None."""
    for record in VISION_LANGUAGE:
        if architecture in record.architectures:
            return record
    return None


def find(architecture: Optional[str]) -> Optional[Family]:
    """The family of a Hugging Face architecture name, or None when rayspeed does not run it."""
    for fam in FAMILIES:
        if architecture in fam.architectures:
            return fam
    return None


def text_family(architecture: Optional[str]) -> Optional[Family]:
    """The family whose text model a multimodal architecture nests under config.json's text_config, or None."""
    for fam in FAMILIES:
        if architecture in fam.multimodal:
            return fam
    return None


def by_architecture(name: str) -> Family:
    """The family of a Hugging Face architecture name (KeyError naming the supported ones)."""
    fam = find(name)
    if fam is None:
        raise KeyError(f"architecture {name!r} is not supported; supported: {', '.join(names())}")
    return fam


def by_model_type(model_type: str) -> Family:
    """The family of a config.json `model_type` (KeyError when none has it)."""
    for fam in FAMILIES:
        if fam.model_type == model_type:
            return fam
    raise KeyError(f"model_type {model_type!r} is not supported")


def names() -> tuple[str, ...]:
    """Every supported architecture name, in the registry's order."""
    return tuple(a for fam in FAMILIES for a in fam.architectures)
