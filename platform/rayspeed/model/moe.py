"""A mixture-of-experts MLP as transformers' Qwen3-MoE and Mixtral compute it, with the experts run as grouped
matrix products (no Python loop over experts): a router (experts x hidden) scores each token in fp32, the top-k
experts take it, weighted by their softmax probabilities (renormalised over the k when the shape says so), and
the weighted sum of their SwiGLU outputs is the MLP's output.

Under tensor parallelism each expert is split like the dense MLP (gate and up by rows of its width, down by
columns), so a tp rank computes a partial sum of every expert's output; the router is replicated. The tokens enter
the tp region once (the sequence all-gather under sequence parallelism), every tp rank routes all of them alike,
the weighted sum of the partial outputs leaves it once (all-reduce, or reduce-scatter under sp). Two gradients
need care: the combine weights multiply partial outputs, so theirs is summed over tp in backward (copy_to_tp), and
the router's input gradient is whole on every tp rank, so it is divided by tp before the region's entry sums it.

The load-balancing statistics (top-k assignments per expert, summed router probabilities, rows) of every MoE layer
go to the model's `RouterStats`, which pools them as transformers' load_balancing_loss_func does, and adds a
training forward's tokens per expert and balance loss to its `LoadWindow` (what moe/* metrics report).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from rayspeed.config.shape import ModelShape
from rayspeed.model.routers import SoftmaxTopK
from rayspeed.parallel.comm import SumOverTensorParallel, copy_to_tp
from rayspeed.parallel.expert_parallel import NO_EP, Dispatch, ExpertParallel, ScaleGrad
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP, enter_tp_region, leave_tp_region, sharded_parameter


class LoadWindow:
    """Training forwards since the last take(): tokens routed to each expert of each MoE layer [layers, experts],
    the sum of their balance losses, how many, and the tokens dropped (none: routing is dropless)."""

    def __init__(self):
        self.counts: Optional[torch.Tensor] = None
        self.aux: Any = 0.0
        self.forwards = 0
        self.dropped = 0

    def add(self, counts: torch.Tensor, aux: torch.Tensor) -> None:
        counts = counts.detach()
        self.counts = counts.clone() if self.counts is None else self.counts + counts
        self.aux = aux.detach() + self.aux
        self.forwards += 1

    def take(self) -> "LoadWindow":
        taken = LoadWindow()
        taken.counts, taken.aux, taken.forwards, taken.dropped = self.counts, self.aux, self.forwards, self.dropped
        self.counts, self.aux, self.forwards, self.dropped = None, 0.0, 0, 0
        return taken


def balance(counts: torch.Tensor, probs: Any, rows: Any, num_experts: int) -> torch.Tensor:
    """Switch Transformer's balance loss E * sum_e (count_e / N) (prob_e / N) of pooled statistics."""
    return num_experts * torch.sum((counts / rows) * (probs / rows))


class RouterStats:
    """The forward's router statistics over every MoE layer: aux = E * sum_e (count_e / N) (prob_e / N), N the
    rows of all layers together (transformers' pooled form, not a mean of per-layer losses)."""

    def __init__(self, num_experts: int, cp: Any = None):
        self.num_experts = num_experts
        # Under context parallelism a forward's tokens are spread over the cp ranks: the statistics are summed over
        # them (the probabilities with their gradient), so every part computes the whole sequence's balance loss.
        self.cp = cp
        self.recording = False
        self.counts: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.rows = 0
        self.windowed = False
        self.window = LoadWindow()

    def start(self, windowed: bool = False) -> None:
        """A forward begins; windowed: it trains, so its load goes to the window (evaluation's does not)."""
        self.counts, self.probs, self.rows, self.recording, self.windowed = [], [], 0, True, windowed

    def add(self, counts: torch.Tensor, probs: torch.Tensor, rows: int) -> None:
        if self.recording:  # not while a checkpointed block is recomputed in backward
            self.counts.append(counts)
            self.probs.append(probs)
            self.rows += rows

    def aux_loss(self) -> Optional[torch.Tensor]:
        self.recording = False
        if not self.counts:
            return None
        per_layer = torch.stack(self.counts)
        counts, probs, rows = per_layer.sum(0), torch.stack(self.probs).sum(0), float(self.rows)
        if self.cp is not None and self.cp.enabled:
            flat = torch.cat([counts.float(), torch.tensor([rows], device=counts.device)])
            dist.all_reduce(flat, group=self.cp.group)
            counts, rows = flat[:-1], float(flat[-1])
            probs = SumOverTensorParallel.apply(probs, self.cp)  # all-reduce forward and backward
        aux = balance(counts, probs, rows, self.num_experts)
        if self.windowed:
            self.window.add(per_layer, aux)
        return aux

    def carried(self, earlier: Optional[torch.Tensor]) -> torch.Tensor:
        """This forward's statistics added to an earlier pipeline stage's: [counts (E), router probabilities (E),
        rows] in fp32, the form that travels between stages (the probabilities keep their graph, so the last
        stage's balance loss trains every stage's routers)."""
        self.recording = False
        e = self.num_experts
        if self.windowed and self.counts:  # this stage's layers' load (the pooled balance loss is the last stage's)
            self.window.add(torch.stack(self.counts), torch.zeros((), device=self.counts[0].device))
        if self.counts:
            here = torch.cat([torch.stack(self.counts).sum(0), torch.stack(self.probs).sum(0).float(),
                              torch.tensor([float(self.rows)], device=self.counts[0].device)])
        else:  # a stage of dense layers only (the first one's output must still take a gradient in backward)
            here = torch.zeros(2 * e + 1, device=earlier.device if earlier is not None else None,
                               requires_grad=earlier is None and torch.is_grad_enabled())
        return here if earlier is None else earlier + here

    @staticmethod
    def pooled_aux(carried: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The balance loss of statistics carried through every stage (the same pooled form as aux_loss)."""
        counts, probs, rows = carried[:num_experts].detach(), carried[num_experts:2 * num_experts], carried[-1].detach()
        return balance(counts, probs, rows, num_experts)

    def load(self) -> Optional[torch.Tensor]:
        """Tokens per expert of each MoE layer of the last forward, [layers, experts] (no gradient)."""
        return torch.stack(self.counts).detach() if self.counts else None


class MoE(nn.Module):
    """Router and stacked experts of one layer: w_gate, w_up [experts, f, h], w_down [experts, h, f] (the hub's
    per-expert matrices, stacked; f / tp of each under tensor parallelism); after shard_experts(ep), this rank's
    experts only (the router stays whole). A family's MoE names its routing rule (model/routers.py)."""

    routing_rule: type = SoftmaxTopK
    expert_params: tuple[str, ...] = ("w_gate", "w_up", "w_down")
    """The per-expert stacks (experts first) expert parallelism shards; a family's MoE may add its own (biases)."""

    def __init__(self, dims: ModelShape, seed: int, name: str, stats: Optional[RouterStats] = None,
                 tp: Optional[TensorParallel] = None, sequence_parallel: bool = False):
        super().__init__()
        e, h, f = dims.num_experts, dims.hidden_size, dims.expert_ffn_hidden_size
        self.num_experts, self.top_k = e, dims.experts_per_token
        self.rule = self.routing_rule(dims)
        self.name = name  # layers.{i}.mlp: where its load goes in the moe/* metrics under a pipeline
        self.stats = stats
        self.ep = NO_EP
        self.tp = tp or NO_TP
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        std = dims.init_std
        self.router = nn.Linear(h, e, bias=False)
        self.router.weight = sharded_parameter((e, h), None, NO_TP, std=std, seed=seed, key=f"{name}.router.weight")
        tp_split = self.tp if self.tp.enabled else NO_TP
        self.w_gate = sharded_parameter((e, f, h), 1 if self.tp.enabled else None, tp_split, std=std, seed=seed,
                                        key=f"{name}.w_gate")
        self.w_up = sharded_parameter((e, f, h), 1 if self.tp.enabled else None, tp_split, std=std, seed=seed,
                                      key=f"{name}.w_up")
        self.w_down = sharded_parameter((e, h, f), 2 if self.tp.enabled else None, tp_split,
                                        std=dims.residual_init_std, seed=seed, key=f"{name}.w_down")

    def shard_experts(self, ep: ExpertParallel) -> None:
        """Keep this rank's experts of the stacks (rank j of the ep group: experts j * E/ep onward). Their parameters
        are marked `expert_parallel` (they differ over the ep group, unlike every other weight; `expert_group` is
        where the whole stack is gathered) and `model_parallel` (DeepSpeed counts every rank's in a norm)."""
        if not ep.enabled or self.ep.enabled:  # once: a pretrained load shards before it reads
            return
        held = ep.local_experts(self.num_experts)
        for name in self.expert_params:
            full = getattr(self, name)
            local = nn.Parameter(full.detach()[held.start:held.stop].clone(), requires_grad=full.requires_grad)
            # The ignores: these tags (rayspeed's and DeepSpeed's) are set at run time; torch's stubs declare none.
            if getattr(full, "tensor_model_parallel", False):  # the tp split, if any
                local.tensor_model_parallel = True  # type: ignore[attr-defined]
                local.partition_dim = full.partition_dim  # type: ignore[attr-defined]
                local.partition_stride = full.partition_stride  # type: ignore[attr-defined]
            local.expert_parallel, local.expert_group = True, ep.group  # type: ignore[attr-defined]
            local.model_parallel = True  # type: ignore[attr-defined]
            # the global id of row 0 (a checkpoint load reads only these)
            local.first_expert = held.start  # type: ignore[attr-defined]
            self.register_parameter(name, local)
        self.ep = ep

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k], experts [tokens, k]) of the flat tokens x by the routing rule; records the
        statistics."""
        weights, experts, probs = self.rule(self.router(x))
        if self.stats is not None:
            counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).float()
            self.stats.add(counts, probs.sum(0), x.shape[0])
        return weights.to(x.dtype), experts

    def experts(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (token, choice) through its expert, grouped: (outputs in the flat choice order, the order)."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x[order // self.top_k]
        tokens_per_expert = torch.bincount(flat, minlength=self.num_experts)
        if not self.ep.enabled:
            return self.grouped(rows, torch.cumsum(tokens_per_expert, 0).to(torch.int32)), order
        route = Dispatch(tokens_per_expert, self.ep)  # rows to the ranks of their experts and back
        return route.back(self.grouped(route.send(rows), route.local_offsets)), order

    def grouped(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows grouped by (this rank's) expert through their SwiGLU experts; offsets: each group's end.

        Under ep an expert's gradient gathers every ep rank's tokens while the data-parallel reduction (over the
        ranks holding the same experts) divides by dp / ep only: 1 / ep here makes it the mean over dp."""
        w_gate, w_up, w_down = self.w_gate, self.w_up, self.w_down
        if self.ep.enabled:
            w_gate, w_up, w_down = (ScaleGrad.apply(w, 1.0 / self.ep.world_size) for w in (w_gate, w_up, w_down))
        gate = F.grouped_mm(rows, w_gate.transpose(1, 2), offs=offsets)
        up = F.grouped_mm(rows, w_up.transpose(1, 2), offs=offsets)
        return F.grouped_mm((F.silu(gate) * up).contiguous(), w_down.transpose(1, 2), offs=offsets)

    def beside(self, flat: torch.Tensor) -> Optional[torch.Tensor]:
        """What a family's MoE adds for every token beside the routed experts (DeepSeek-V3's shared experts), on
        the flat tokens inside the tp region: this rank's partial sum under tp. None: nothing."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp.enabled:
            x = enter_tp_region(x, tp, self.sequence_parallel)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.route(ScaleGrad.apply(flat, 1.0 / tp.world_size) if tp.enabled else flat)
        out, order = self.experts(flat, experts)
        combined = torch.zeros(flat.shape[0] * self.top_k, shape[-1], dtype=out.dtype, device=out.device)
        combined = combined.index_copy(0, order, out).view(flat.shape[0], self.top_k, shape[-1])
        if tp.enabled:
            weights = copy_to_tp(weights, tp)
        y = (combined * weights.unsqueeze(-1)).sum(1)
        beside = self.beside(flat)
        y = (y if beside is None else y + beside).reshape(shape)
        return leave_tp_region(y, tp, self.sequence_parallel) if tp.enabled else y
