"""What every rank must agree on: how a logged number combines over ranks (so it means one thing
at any rank count; stated by the code that makes it: Sum, Max, Min, else a mean), the invariants that would otherwise hang the next collective (checked, with
an error that names them), and the requests a vLLM tensor-parallel group submits together."""
import hashlib

import torch
import torch.distributed as dist


class Sum(float):
    """A logged count: summed over ranks (m["dynamic/dropped_count"] = ranks.Sum(n))."""


class Max(float):
    """A logged worst case: the max over ranks (the slowest rank's time, the most memory, the largest gap)."""


class Min(float):
    """A logged worst case the other way: the min over ranks (the least free memory, the smallest ratio)."""


def reduction(value):
    """How a logged number combines over ranks, stated where it is made by its type: Sum, Max, Min;
    a plain number is a mean (each rank holds an equal share of the batch). -> "sum", "max", "min", "mean"."""
    return {Sum: "sum", Max: "max", Min: "min"}.get(type(value), "mean")


def reduce_metrics(m, device):
    """All-reduce a flat dict of numbers over ranks, each by its reduction(); -> m, plain floats."""
    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    how = {k: reduction(v) for k, v in m.items()}
    check_same("the logged metrics and how each combines over ranks", [digest(sorted(how.items()))], device)
    for name, op in ops.items():
        ks = [k for k in sorted(m) if how[k] == name]
        if ks:   # every rank has the same keys (checked above), so the same collectives
            t = torch.tensor([float(m[k]) for k in ks], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=op)
            for k, v in zip(ks, t.tolist()):
                m[k] = v / dist.get_world_size() if name == "mean" else v
    return m


def check_same(name, values, device, group=None):
    """Raise on every rank when `values` (ints) differ between the ranks of `group` (all ranks by
    default). A broken invariant then names itself instead of hanging the next collective."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise RuntimeError(f"distributed invariant broken: {name} must be the same on every rank"
                           f"{' of the vLLM tensor-parallel group' if group is not None else ''}; rank {dist.get_rank()} has "
                           f"{values}, the ranks range from {lo.tolist()} to {hi.tolist()}")


def digest(obj):
    """A stable 63-bit fingerprint of a picklable-by-repr structure."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 1


def tp_gather(items, group, tp):
    """vLLM tensor parallel: every rank of a TP group must submit the same requests. -> (the group's
    items in rank order, this rank's offset in them); ranks may hold different numbers of items."""
    if tp == 1:
        return items, 0
    got = [None] * tp
    dist.all_gather_object(got, items, group=group)
    me = dist.get_rank(group)
    return [x for part in got for x in part], sum(len(part) for part in got[:me])
