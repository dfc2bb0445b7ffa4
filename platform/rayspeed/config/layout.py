"""One parallel layout, resolved: the type the planner searches, the manifest records, resume compares, the
worker builds and the environment profile and doctor read. Torch-free.

Modelled on torchtitan's ParallelDims: the degrees are validated once, when the layout is made, and a layout
that cannot exist never travels further. Whether it fits a given world is `check_world` (the whole equation in
the message); whether a given model splits that way is the planner's and the config checks' business.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

CHECKPOINT_MODES = ("none", "selective", "full")
LAYOUT_KEYS = ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum", "sequence_parallel",
               "activation_checkpointing", "cp", "ep")
# The keys a ZeRO partition is tied to: a checkpoint written under other values needs a universal conversion.
# cp belongs here: ZeRO partitions over dp x cp (a manifest without it was written at cp 1); ep too: experts split
# over it, and ZeRO partitions over dp / ep.
PARTITION_KEYS = ("dp", "tp", "pp", "zero_stage", "cp", "ep")
# What a manifest and a run result record (the integer degrees and batch split).
RECORD_KEYS = ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum", "cp", "ep")
# What a key reads as in a record written before it existed.
RECORD_DEFAULTS = {"cp": 1, "ep": 1}


class LayoutError(ValueError):
    """A layout that cannot exist (a degree below 1, an unknown ZeRO stage, a stage split that does not add up)."""


@dataclass(frozen=True)
class Layout:
    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline stages."""
    zero_stage: int
    """DeepSpeed ZeRO stage 0..3."""
    micro_batch_size: int
    """Sequences per rank per forward pass."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    sequence_parallel: bool = False
    """Norm and residual regions split along the sequence over the tp group (tp > 1 only)."""
    activation_checkpointing: str = "none"
    """none | selective | full."""
    hpz: int = 1
    """ZeRO++ hierarchical partitioning (zero_hpz_partition_size): ZeRO-3 keeps a secondary copy of the weights
    partitioned over this many ranks of a node, so backward all-gathers stay on NVLink. 1 = off. Not a job key:
    the communication rule for 64+ GPUs turns it on when it fits."""
    stage_layers: Optional[tuple[int, ...]] = None
    """Transformer blocks per pipeline stage, first to last (None: as even as the engine splits them)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks (rayspeed.parallel.context_parallel)."""
    ep: int = 1
    """Expert-parallel degree: a mixture of experts' experts split over this many data-parallel ranks (ep divides
    dp; rayspeed.parallel.expert_parallel)."""

    def __post_init__(self) -> None:
        degrees = (self.dp, self.tp, self.pp, self.micro_batch_size, self.grad_accum, self.hpz, self.cp, self.ep)
        if not all(type(v) is int and v >= 1 for v in degrees):  # the common case checked cheaply (planner search)
            names = ("dp", "tp", "pp", "micro_batch_size", "grad_accum", "hpz", "cp", "ep")
            bad = [f"{k} {getattr(self, k)}" for k in names
                   if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        else:
            bad = []
        if bad:
            raise LayoutError(f"layout degrees must be integers >= 1: {', '.join(bad)}")
        if self.dp % self.ep:
            raise LayoutError(f"ep ({self.ep}) must divide dp ({self.dp}): experts are split over data-parallel ranks")
        if self.zero_stage not in (0, 1, 2, 3):
            raise LayoutError(f"zero_stage {self.zero_stage!r} is not 0, 1, 2 or 3")
        if self.activation_checkpointing not in CHECKPOINT_MODES:
            raise LayoutError(f"activation_checkpointing {self.activation_checkpointing!r} is not one of "
                              f"{', '.join(CHECKPOINT_MODES)}")
        if self.stage_layers is not None:
            if not isinstance(self.stage_layers, tuple):
                object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
            split = self.stage_layers
            if len(split) != self.pp or any(int(n) < 1 for n in split):
                raise LayoutError(f"stage_layers {list(split)} must give pp ({self.pp}) stages of at least one "
                                  f"layer each")

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica spans: tp x pp."""
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def zero_ranks(self) -> int:
        """Ranks a ZeRO partition and the gradient reduction span: dp x cp (cp ranks hold the same weights and
        their gradients add up), divided by ep: under expert parallelism DeepSpeed partitions over the ranks holding
        the same experts (the weights every ep rank holds alike are averaged over ep first)."""
        return self.dp * self.cp // self.ep

    def check_world(self, world_size: int) -> None:
        """Raise LayoutError unless dp x cp x tp x pp is exactly the world."""
        if self.world_size != world_size:
            cp = f" x cp ({self.cp})" if self.cp > 1 else ""
            raise LayoutError(f"dp ({self.dp}){cp} x tp ({self.tp}) x pp ({self.pp}) = {self.world_size} != "
                              f"world size ({world_size})")

    def check_layers(self, num_layers: int) -> None:
        """Raise LayoutError when the stage split does not place every layer (or pp exceeds the layers)."""
        if self.pp > num_layers:
            raise LayoutError(f"pp ({self.pp}) exceeds the model's {num_layers} layers: every stage needs one")
        if self.stage_layers is not None and sum(self.stage_layers) != num_layers:
            raise LayoutError(f"stage_layers {list(self.stage_layers)} add up to {sum(self.stage_layers)}, "
                              f"not the model's {num_layers} layers")

    def as_dict(self) -> dict[str, Any]:
        """The public plan fields (LAYOUT_KEYS), plus stage_layers when the split is explicit."""
        d: dict[str, Any] = {k: getattr(self, k) for k in LAYOUT_KEYS}
        if self.stage_layers is not None:
            d["stage_layers"] = list(self.stage_layers)
        return d

    def record(self) -> dict[str, Any]:
        """What a manifest and a run result keep: the integer degrees and batch split (and the stage split)."""
        d: dict[str, Any] = {k: getattr(self, k) for k in RECORD_KEYS}
        if self.stage_layers is not None:
            d["stage_layers"] = list(self.stage_layers)
        return d

    def partition(self) -> dict[str, int]:
        """The keys a ZeRO checkpoint's partitions depend on."""
        return {k: int(getattr(self, k)) for k in PARTITION_KEYS}

    def short(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        cp += f" ep{self.ep}" if self.ep > 1 else ""
        hpz = f" hpz{self.hpz}" if self.hpz > 1 else ""
        split = f" stages={'/'.join(map(str, self.stage_layers))}" if self.stage_layers is not None else ""
        return (f"dp{self.dp}{cp} tp{self.tp}{sp} pp{self.pp}{split} zero{self.zero_stage}{hpz} "
                f"mb{self.micro_batch_size} ga{self.grad_accum} ckpt={self.activation_checkpointing}")

    @classmethod
    def from_parallel(cls, par: Any) -> "Layout":
        """From a resolved `parallel` config section (no auto left)."""
        split = getattr(par, "stage_layers", None)
        return cls(int(par.dp), int(par.tp), int(par.pp), int(par.zero_stage), int(par.micro_batch_size),
                   int(par.grad_accum), bool(par.sequence_parallel), str(par.activation_checkpointing),
                   stage_layers=tuple(split) if split else None, cp=int(getattr(par, "cp", 1)),
                   ep=int(getattr(par, "ep", 1)))

    @classmethod
    def from_record(cls, d: Mapping[str, Any]) -> "Layout":
        """From a manifest's or result's `layout` (older manifests carry neither stage_layers nor sp/ac nor cp)."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for key, default in RECORD_DEFAULTS.items():
            if kw.get(key) is None:
                kw[key] = default
        if kw.get("stage_layers") is not None:
            kw["stage_layers"] = tuple(int(n) for n in kw["stage_layers"])
        return cls(**kw)
