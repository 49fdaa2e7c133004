"""What every rank must agree on: how a logged number combines over ranks, stated by its type where it is made
(Sum, Max, Min, Mean with its weight; a plain number is a mean), so that it means one thing at any rank count; the
invariants that would otherwise hang the next collective, checked with an error that names them; and the
requests a vLLM tensor-parallel group submits together.
"""
import hashlib
import os

import torch
import torch.distributed as dist


def local_world(default):
    """The ranks on this node: DeepSpeed's per-node launcher sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE."""
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", default)))


class Sum(float):
    """A logged count: summed over ranks (m["dynamic/dropped_count"] = ranks.Sum(n))."""


class Max(float):
    """A logged worst case: the max over ranks (the slowest rank's time, the most memory, the largest gap)."""


class Min(float):
    """A logged worst case the other way: the min over ranks (the least free memory, the smallest ratio)."""


class Mean(float):
    """A logged mean over `weight` items (completions, tokens), combined over ranks as the mean of all their items,
    not of the ranks' means (m["reward/mean"] = ranks.Mean(mean, count)). A plain number is a Mean of weight 1."""
    def __new__(cls, value, weight=1.0):
        x = super().__new__(cls, value)
        x.weight = float(weight)
        return x


def reduction(value):
    return {Sum: "sum", Max: "max", Min: "min"}.get(type(value), "mean")


def reduce_metrics(m, device):
    """All-reduce a flat dict of numbers over ranks in place, each by its reduction() -> m, plain floats, the same
    keys on every rank; a rank without a key holds none of it. The collectives are the same every step (one
    gather, one SUM, one MAX); a key two ranks reduce differently raises."""
    mine = {k: reduction(v) for k, v in m.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine.items()))
    how = {}
    for r, part in enumerate(everyone):
        for k, h in part:
            if how.setdefault(k, h) != h:
                raise RuntimeError(f"distributed invariant broken: the logged metrics and how each combines over "
                                   f"ranks must agree on every rank; {k!r} is a {how[k]} on one rank and a {h} "
                                   f"on rank {r}")
    keys = sorted(how)
    summed = [k for k in keys if how[k] in ("sum", "mean")]
    peaks = [k for k in keys if how[k] in ("max", "min")]
    sign = lambda k: -1.0 if how[k] == "min" else 1.0   # noqa: E731  (a min is the max of the negated values)
    weight = lambda k: getattr(m[k], "weight", 1.0) if how[k] == "mean" else 1.0   # noqa: E731
    t = torch.tensor([float(m[k]) * weight(k) if k in m else 0.0 for k in summed] +
                     [weight(k) if k in m else 0.0 for k in summed], dtype=torch.float64, device=device)
    peak = torch.tensor([sign(k) * float(m[k]) if k in m else float("-inf") for k in peaks], dtype=torch.float64,
                        device=device)
    dist.all_reduce(t)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    total, weights = t[:len(summed)].tolist(), t[len(summed):].tolist()
    out = {k: v / w if how[k] == "mean" else v for k, v, w in zip(summed, total, weights)
           if how[k] == "sum" or w > 0}   # a mean over no items at all is not a number: not logged
    out.update((k, sign(k) * v) for k, v in zip(peaks, peak.tolist()))
    m.clear()
    m.update(sorted(out.items()))
    return m


def check_same(name, values, device, group=None):
    """Raise on every rank when the ints `values` differ over `group` (default all ranks), instead of hanging
    the next collective."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise RuntimeError(f"distributed invariant broken: {name} must be the same on every rank"
                           f"{' of the vLLM tensor-parallel group' if group is not None else ''}; "
                           f"rank {dist.get_rank()} has {values}, the ranks range from {lo.tolist()} to {hi.tolist()}")


def refuse_together(why, error=RuntimeError, group=None):
    """Raise `error` on every rank of `group` (default all) when any rank has a reason `why` (a string; None: it has
    none), naming the ranks that refused; a rank that raised alone would leave the others in the next collective until
    its timeout. Without torch.distributed: raise when `why` is set."""
    if not dist.is_initialized():
        if why:
            raise error(why)
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    refused = torch.tensor([int(why is not None)], device=device)
    dist.all_reduce(refused, group=group)
    if refused.item():   # every rank is here: the reasons, gathered
        said = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, why, group=group)
        who = [r for r, w in enumerate(said) if w is not None]
        raise error(f"{said[who[0]]} (refused on rank {', '.join(map(str, who))} of {len(said)}; every rank stops)")


def digest(obj):
    """A stable 63-bit fingerprint of a picklable-by-repr structure."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 1


def tp_gather(items, group, tp):
    """-> (the `items` of every rank in `group`, in rank order; this rank's offset)."""
    if tp == 1:
        return items, 0
    got = [None] * tp
    dist.all_gather_object(got, items, group=group)
    me = dist.get_rank(group)
    return [x for part in got for x in part], sum(len(part) for part in got[:me])
