"""Training across processes: which micro-batches this process runs, and the gradients summed over all.

A job started under ``torchrun`` (``training.processes`` > 1) runs in every process; each runs its share
of every step's micro-batches (``share``), and ``reduce_gradients`` sums the LoRA gradients over the
processes before the optimizer steps, so every process takes the same update as one process over the
whole batch would. Only the main process (``is_main``) writes checkpoints, the adapter and the run's
metrics. Outside ``torchrun`` this is one process of one: every function is the identity.

The train step starts such a job with ``pipeline.training.torchrun.launch``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.training.memory import micro_batches

__all__ = [
    "World",
    "broadcast_parameters",
    "is_main",
    "least",
    "reduce_gradients",
    "share",
    "split",
    "sum_over",
    "world",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` processes of one job."""

    rank: int = 0
    size: int = 1


def world() -> World:
    """The job's processes: ``torch.distributed``'s group when one is initialised, else one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return World(rank=dist.get_rank(), size=dist.get_world_size())
    return World()


def share(groups: Sequence[list[int]], where: World) -> list[list[int]]:
    """This process's micro-batches of a step: every ``size``-th one, starting at its rank (counted in
    ``RAN``: each process's total is reported when a launched job ends)."""
    mine = [list(g) for g in groups[where.rank :: where.size]]
    RAN[0] += len(mine)
    return mine


RAN = [0]
"""Micro-batches this process ran (``share``) since it started: ``launch`` reports each process's."""


def split(lengths: Sequence[int], budget: int | None, where: World) -> list[list[int]]:
    """A step's micro-batches (``memory.micro_batches`` over the examples' token lengths), cut further when
    there are fewer than processes: with ``budget`` None (no split, the CPU default) or a batch that fits
    one budget, the batch is cut by ``ceil(total / size)`` tokens, so that every process gets work."""
    groups = micro_batches(lengths, budget)
    if where.size > 1 and len(groups) < where.size and len(lengths) > 1:
        even = max(1, math.ceil(sum(lengths) / where.size))
        groups = micro_batches(lengths, even if budget is None else min(budget, even))
    return groups


def least(value: int | None, where: World) -> int | None:
    """The smallest ``value`` over the processes (None: no limit), so every process cuts a step's
    micro-batches alike (each derives its token budget from its own free memory)."""
    if where.size == 1:
        return value
    import torch
    import torch.distributed as dist

    none = 2**62
    t = torch.tensor([none if value is None else value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return None if int(t) == none else int(t)


def is_main(where: World) -> bool:
    """Whether this process writes the job's files and metrics (rank 0)."""
    return where.rank == 0


def reduce_gradients(params: Sequence[Any], where: World) -> None:
    """Sum every parameter's gradient over the processes (a process that ran no micro-batch adds zeros)."""
    if where.size == 1:
        return
    import torch
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def sum_over(value: float, where: World) -> float:
    """``value`` summed over the processes (a step's loss: each process has the part of its micro-batches)."""
    if where.size == 1:
        return value
    import torch
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        total = total.cuda()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total.item())


def broadcast_parameters(params: Sequence[Any], where: World) -> None:
    """Every process starts from rank 0's trainable weights (they are seeded alike; this makes it certain)."""
    if where.size == 1:
        return
    import torch.distributed as dist

    for p in params:
        dist.broadcast(p.data, src=0)
