"""GRPO for vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5) with DeepSpeed ZeRO-3 and a colocated vLLM.

Every rank holds a ZeRO-3 shard of the policy and its own in-process vLLM engine. `main()` is a
short loop over the step's named phases; each phase is a function below that a test can call
with small fakes (tests/test_step.py). One step, every rank:

    select_prompts (hook) -> sync (+ offload) -> rollout -> score -> filter_groups (hook) -> sleep (+ reload)
    -> micro_batches -> old_ref_logps -> advantages -> update -> log -> validate -> checkpoint

Per prompt, one `Group` record (its sample) holds one `Completion` record per completion, which every
phase reads and writes (token ids, sampler / old / reference log-probs, rewards, advantage); micro-batches
are a layout that points at them. `Run` holds what the run owns (startup.setup builds it), `run.sampling` the
sampled distribution.

    deepspeed train.py --num_generations 7                        # embedded tiny model + task
    deepspeed --num_gpus 8 train.py --model Qwen/Qwen2.5-VL-7B-Instruct \
        --train_data data/train.jsonl --val_data data/val.jsonl --bf16 --num_generations 7

The set-up: startup.py. Flags: flags.py. The model and its DeepSpeed config: model.py. Reductions over ranks
and the checked invariants: ranks.py. Data, images and videos: data.py. The math: grpo.py. vLLM and the weight
sync: rollout.py. Memory: memory.py, and the plan before launch: planner.py (`--plan`). Checkpoints and resume:
checkpoint.py; the job's lifetime (its folder, kills, preemption): job.py. metrics.jsonl, wandb and the plot:
logs.py. Multi-turn rollouts with tools (--tools): trajectories(), the loop in toolbox.py. Left out on purpose: a
trainer class, callbacks, a vLLM server mode.
"""
import dataclasses
import itertools
import os
import sys
import time
import warnings

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))  # this venv's own JIT ops
import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

# DeepSpeed 0.19.8 calls torch.distributed.all_gather_into_tensor, deprecated in torch 2.13: one warning per gather
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

import checkpoint  # noqa: E402
import data
import grpo
import job
import logs
import memory
import model
import ranks
import reward
import rollout
import startup
import toolbox
from flags import check_args, grad_accumulation_steps, inert_flags, micro_batch, parse_args  # noqa: F401  (train.parse_args)


# ----------------------------------------------------------------------------- records
@dataclasses.dataclass
class Completion:
    """One completion of a group: groups[i].completions[k] is completion k of the step's group i. Every value
    of it that the step computes lives here, in the order the step computes it; micro-batches only point at
    these records (batch["completions"]). A paper's per-completion quantity is one more field."""
    index: int                       # its place in the group, 0 .. num_generations - 1
    token_ids: list                  # (n,) what the model wrote (--tools: and the tool messages between its turns)
    sampler_logps: list              # (n,) vLLM's log-prob of each token, of the distribution it drew from (0: not its)
    text: str                        # the model's (last) answer: what the rewards score
    finish_reason: str               # "stop" or "length"
    mask: list = None                # --tools: (n,) 1 where the model wrote the token (trained), 0 a template's or tool's
    mm: dict = None                  # --tools: its tool images for the training forward (data.collate), or None
    calls: list = dataclasses.field(default_factory=list)    # --tools: (the turn's text, error or None) per call
    images: list = dataclasses.field(default_factory=list)   # --tools: the images the tools returned
    routed_experts: object = None    # --routing_replay: (P + n - 1, layers, k) vLLM's experts for its prompt and tokens
    rewards: dict = dataclasses.field(default_factory=dict)   # {reward function: score}
    failed: dict = dataclasses.field(default_factory=dict)    # {reward function: True if it raised or gave None/NaN}
    total: float = None              # weighted sum of the rewards (score)
    old_logps: torch.Tensor = None   # (n,) the trainer's log-probs at the sampler's weights, pi_old (0 outside the loss)
    ref_logps: torch.Tensor = None   # (n,) the reference model's (beta > 0)
    is_weights: torch.Tensor = None  # (n,) the sampler correction's weight per token (per sequence: repeated)
    kl_penalty: float = None         # --kl_in_reward: beta x the summed per-token KL to the reference, off the total
    advantage: float = None

    @property
    def scored(self):
        """Every reward function scored it: it counts in its group's statistics and in the loss."""
        return not any(self.failed.values())

    @property
    def length(self):
        """The tokens the model wrote (a trajectory's tool messages not counted): --max_completion_length's count."""
        return len(self.token_ids) if self.mask is None else sum(self.mask)


@dataclasses.dataclass
class Group:
    """One prompt and its num_generations completions, as it flows through the step's phases."""
    sample: dict                     # data.prepare(): images, vllm_ids, hf, columns, where
    completions: list                # (G,) Completion records

    @property
    def totals(self):
        return [c.total for c in self.completions]


def completion_logps(engine, batch, run, with_entropy=False, with_kept=False):
    """Per-token statistics of one micro-batch's completions (policy or reference engine) under run.sampling,
    from one pass over the vocabulary -> grpo.TokenStats, each (B, C): logps; with `with_kept` (and top-k or
    top-p) the log of the mass the sampler's truncation keeps; with `with_entropy` the entropy, with a gradient only
    where the loss takes it (--entropy_coef; a logged one with its graph held 9 B per token and vocabulary entry)."""
    return engine(**{k: v.to(run.device) for k, v in batch["inputs"].items()}, sampling=run.sampling,
                  chunks=batch["chunks"], vision_calls=batch.get("vision_calls", 1), with_entropy=with_entropy,
                  with_kept=with_kept, entropy_grad=bool(run.args.entropy_coef))


def to_rows(values, device):
    """Per-completion values of one micro-batch, [(n_i,)], -> (B, C) right-aligned as data.collate lays
    completions out (C: the longest n_i); 0 where a row has no token."""
    C = max(max((len(v) for v in values), default=1), 1)
    out = torch.zeros(len(values), C, device=device)
    for j, v in enumerate(values):
        if len(v):
            out[j, C - len(v):] = torch.as_tensor(v, dtype=torch.float32, device=device)
    return out


def from_rows(batch, name, t):
    """(B, C) right-aligned values -> each completion's record of the micro-batch, as `name` ((n,), on the CPU)."""
    C = t.shape[1]
    for j, c in enumerate(batch["completions"]):
        setattr(c, name, t[j, C - len(c.token_ids):].detach().float().cpu())


def run_vllm(run, samples, sps):
    """Generate for this rank's samples (via the whole TP group), return this rank's outputs."""
    tp = run.args.vllm_tensor_parallel_size
    requests = [data.vllm_request(s) for s in samples]
    reqs, offset = ranks.tp_gather(requests, run.tp_group, tp)
    params, _ = ranks.tp_gather(sps, run.tp_group, tp)
    if not reqs:   # the whole TP group is done (multi-turn: its trajectories ended before the busiest rank's)
        return []
    if tp > 1:   # vLLM would mix up outputs (or hang) if the group's ranks submitted different requests
        sizes = lambda r: [im.size for im in r.get("multi_modal_data", {}).get("image", [])] + [  # noqa: E731
            (f.shape, m["frames_indices"]) for f, m in r.get("multi_modal_data", {}).get("video", [])]
        ranks.check_same("the vLLM requests (prompt ids, image and video sizes, sampling params)",
                         [ranks.digest([(r["prompt_token_ids"], sizes(r)) for r in reqs] + [repr(sp) for sp in params])],
                         run.device, run.tp_group)
    outs = rollout.generate(run.llm, reqs, params, run.lora_request)
    return outs[offset:offset + len(samples)]


# ----------------------------------------------------------------------------- the step's phases
def sync(run, m):
    """vLLM wakes and gets the trainer's weights (skipped when no optimizer step happened since the
    last sync, unless --sleep_level 2 dropped them; frozen units only the first time); then the trainer states leave the GPU (the
    sync needed them, generation does not) and vLLM's KV cache comes back."""
    args = run.args
    with memory.phase("sync", m):
        rollout.wake(run.llm, args.sleep_level, ["weights"])
        if run.synced_at != run.updates or args.sleep_level == 2:
            adapter = args.use_peft and args.lora_sync == "adapter"   # the base once (level 2: each time), then the adapter
            whole = run.synced_at is None or args.sleep_level == 2   # else vLLM holds the frozen weights already
            if not adapter or whole:
                largest, sent = rollout.sync_weights(run.llm, run.engine.module, args.sync_bucket_mb, run.tied,
                                                     merge=not adapter, changed_only=not whole)
                m["sync/largest_bucket_mb"], m["sync/sent_mb"] = largest / 2 ** 20, sent / 2 ** 20
            if adapter:
                run.lora_request = rollout.sync_adapter(run.llm, run.engine.module, version=run.updates + 1)
            run.synced_at = run.updates
    if run.offload:
        with memory.phase("offload", m):
            run.engine.offload_states(include=run.offload)
            if args.gc_collect_after_offload:
                m["offload/freed_gb"] = memory.free() / 2 ** 30
    rollout.wake(run.llm, args.sleep_level, ["kv_cache"])


def rollout_groups(run, samples, step, round=0):
    """num_generations completions per sample from vLLM (awake and synced) -> one Group per sample.
    `round` > 0: dynamic sampling's further rollouts in the same step (other seeds)."""
    args = run.args
    if args.tools:
        return trajectories(run, samples, step, round)
    sps = [rollout.sampling_params(run.sampling, n=args.num_generations, max_tokens=args.max_completion_length, logprobs=0,
                                   seed=hash((args.seed, step, run.rank, i) + ((round,) if round else ())) % 2 ** 31)
           for i in range(len(samples))]
    groups = []
    for s, out in zip(samples, run_vllm(run, samples, sps)):
        ids = [list(c.token_ids) for c in out.outputs]
        texts = run.processor.tokenizer.batch_decode(ids, skip_special_tokens=True)
        groups.append(Group(sample=s, completions=[
            Completion(index=k, token_ids=ids[k], sampler_logps=[next(iter(d.values())).logprob for d in c.logprobs],
                       text=texts[k], finish_reason=c.finish_reason,
                       routed_experts=c.routed_experts if args.routing_replay else None)   # rollout.generate's
            for k, c in enumerate(out.outputs)]))
    if not all(np.isfinite(c.sampler_logps).all() for g in groups for c in g.completions):
        raise RuntimeError("vLLM returned non-finite logprobs after the weight sync: the synced weights are broken")
    if args.routing_replay and any(c.routed_experts is None for g in groups for c in g.completions):
        raise RuntimeError("--routing_replay: vLLM returned a completion without its routed_experts")
    return groups


def trajectories(run, samples, step, round=0, greedy=False):
    """--tools: num_generations multi-turn trajectories per sample (toolbox.rollout: every live one a turn per
    generate call, tools run between turns), or one greedy one (validation) -> one Group per sample."""
    args = run.args
    sampling = dataclasses.replace(run.sampling, temperature=0.0) if greedy else run.sampling

    def generate(requests, keys, budgets, stops, n):   # n > 1: vLLM seeds the k-th of them with seed + k
        sps = [rollout.sampling_params(sampling, n=n, max_tokens=b, logprobs=0, stop_token_ids=stop,
                                       seed=hash((args.seed, step, run.rank, round) + key) % 2 ** 31)
               for key, b, stop in zip(keys, budgets, stops)]
        return run_vllm(run, requests, sps)

    def any_live(count):   # every rank takes as many turns as the busiest (a TP group generates together)
        most = torch.tensor(count, device=run.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return most.item() > 0
    trajs = toolbox.rollout(samples, 1 if greedy else args.num_generations, run.processor, args, generate, any_live)
    groups = [Group(sample=s, completions=[
        Completion(index=k, token_ids=t["ids"], sampler_logps=t["logps"], text=t["turns"][-1] if t["turns"] else "",
                   finish_reason=t["finish_reason"] or "length", mask=t["mask"], calls=t["calls"], images=t["images"],
                   mm={"mm_token_type_ids": t["mm_types"],
                       **{k2: torch.cat([m[k2] for m in t["mm"]]) for k2 in ("pixel_values", "image_grid_thw")}}
                   if t["mm"] else None)
        for k, t in enumerate(ts)]) for s, ts in zip(samples, trajs)]
    return groups


def select_prompts(run, step):
    """The hook before the rollout: this rank's prompts for the step, run.per_rank of them on every
    rank. A curriculum goes here: run.stream.history maps a sample's id (sample["id"], its stable identity:
    the row's own "id" field, else a hash of its content) to its group's rewards the last time it was rolled out, on any rank. Skipping the
    prompts the policy already solves, for example (README, "A paper change in one place"):

        out = []
        while len(out) < run.per_rank:
            s = run.stream.next(1)[0]
            if min(run.stream.history.get(s["id"], [0.0])) < 1.0:
                out.append(s)
        return out
    """
    return run.stream.next(run.per_rank)


def reward_inputs(run, samples, comps):
    """The columns a reward function reads, {field: [value per completion]}, in training (score) and validation
    alike: the samples' own fields, each completion's length in tokens (the model's own) and the limit; with
    --tools also the whole trajectory's text (`trajectory`), its calls (`tool_calls`) and failed calls
    (`tool_failures`)."""
    cols = data.reward_columns(samples)
    cols.update(completion_length=[c.length for c in comps], max_completion_length=[run.args.max_completion_length] * len(comps))
    if run.args.tools:
        cols.update(trajectory=run.processor.tokenizer.batch_decode([c.token_ids for c in comps], skip_special_tokens=True),
                    tool_calls=[len(c.calls) for c in comps], tool_failures=[sum(e is not None for _, e in c.calls) for c in comps])
    return cols


def score(run, groups):
    """Rewards per completion, per function, with failure flags, onto each completion's record; every rank's
    groups' rewards into run.stream.history (a collective: all ranks score together)."""
    args = run.args
    pairs = [(g.sample, c) for g in groups for c in g.completions]
    total, scores, failed = reward.compute_rewards(args.reward_funcs, args.reward_weights, [c.text for _, c in pairs],
                                                   reward_inputs(run, [s for s, _ in pairs], [c for _, c in pairs]))
    for i, (_, c) in enumerate(pairs):
        c.total, c.rewards, c.failed = total[i], {n: v[i] for n, v in scores.items()}, {n: v[i] for n, v in failed.items()}
    everyone = [None] * run.world
    dist.all_gather_object(everyone, [(g.sample.get("id"), g.totals) for g in groups])
    run.stream.history.update((i, r) for part in everyone for i, r in part if i is not None)


def filter_groups(run, groups, step, m):
    """The hook between scoring and advantages, while vLLM is still awake: return the groups to
    train on. A filter (a curriculum, ...) goes here; it may generate and score more groups. Every
    rank must return the same number of groups (checked in micro_batches).

    --dynamic_sampling (DAPO, Yu et al. 2025): a group whose rewards are all equal has zero
    advantages, no signal; it is dropped and more prompts are rolled out, up to
    --max_num_gen_batches rounds. The rounds are collective (all ranks loop until every rank has
    enough: vLLM TP groups generate together), each rank keeps exactly rollout_batch_size / world
    groups, and a shortfall after the last round is filled with dropped groups (no policy gradient;
    only the KL term acts on them), counted in dynamic/filled_count."""
    if not run.args.dynamic_sampling:
        return groups
    t0 = time.perf_counter()
    spread = lambda g: max(g.totals) > min(g.totals)   # noqa: E731
    keep, dropped, rounds = [g for g in groups if spread(g)], [g for g in groups if not spread(g)], 1
    while rounds < run.args.max_num_gen_batches:
        have = torch.tensor(len(keep), device=run.device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item() >= run.per_rank:
            break
        with memory.phase("data", m):
            samples = select_prompts(run, step)
        with memory.phase("rollout", m):
            more = rollout_groups(run, samples, step, round=rounds)
        with memory.phase("reward", m):
            score(run, more)
        keep += [g for g in more if spread(g)]
        dropped += [g for g in more if not spread(g)]
        rounds += 1
    filled = max(0, run.per_rank - len(keep))
    m.update({"dynamic/dropped_count": ranks.Sum(len(dropped)), "dynamic/filled_count": ranks.Sum(filled),
              "dynamic/rounds_max": ranks.Max(rounds), "time/dynamic_sampling": ranks.Max(time.perf_counter() - t0)})
    return (keep + dropped[:filled])[:run.per_rank]


def sleep(run, m):
    """vLLM sleeps (frees its GPU memory) and the trainer states come back to the GPU."""
    args = run.args
    with memory.phase("sleep", m):   # level 1 pins a host copy of the weights here: an OOM names this phase
        m["sleep/freed_gb"] = rollout.sleep(run.llm, args.sleep_level, args.gc_collect_after_offload) / 2 ** 30
    if run.offload:
        with memory.phase("reload", m):
            run.engine.reload_states()


def micro_batches(run, groups):
    """The rollout batch as micro-batches of per_device_train_batch_size sequences (or, with
    --micro_batch_tokens, as many as fit the budget), sorted by length so that similar lengths share
    one, each padded to its own longest prompt and completion (not the step's: one long answer no
    longer widens every micro-batch); with --shared_prefix, groups sorted by length, each group (or its
    part in a micro-batch) one row with its prompt once (data.collate_prefix). A micro-batch is a layout:
    its collated inputs and the completions it holds (batch["completions"], the records every value lives
    on). A completion that no reward function could score stays in its place with its loss mask zeroed.
    Under ZeRO-3 every rank must make the same number of forward and lm_head calls (each gathers
    parameters): a rank with fewer budget micro-batches splits its largest, the count is checked here,
    before it could hang, and each micro-batch takes the most log-prob chunks any rank needs for its
    position (grpo.token_logps splits fewer tokens as many times) and the most vision-tower runs (images and
    videos each run it once; model.logps_forward makes up the rest with dummy runs)."""
    args = run.args
    seqs = [(g, c) for g in groups for c in g.completions]
    prompt = lambda g: g.sample["hf"]["input_ids"].shape[1]   # noqa: E731
    size = lambda s: prompt(s[0]) + max(len(s[1].token_ids), 1)   # noqa: E731  (tokens, padded alone)
    extras = lambda cs: dict(masks=[c.mask for c in cs], mms=[c.mm for c in cs])   # noqa: E731  (--tools' trajectories)
    if args.shared_prefix:   # a group's completions stay together, one row (data.collate_prefix); longer rows last
        rows = {id(g): prompt(g) + sum(len(c.token_ids) for c in g.completions) for g in groups}
        seqs.sort(key=lambda s: rows[id(s[0])])
    else:
        seqs.sort(key=size)   # stable: a group stays in order; a micro-batch is as wide as its longest (data.collate)
    if not args.micro_batch_tokens:
        parts = [seqs[i:i + args.per_device_train_batch_size] for i in range(0, len(seqs), args.per_device_train_batch_size)]
    else:
        parts = [[]]
        for s in seqs:   # ascending: the newest sequence is its micro-batch's longest
            if parts[-1] and (len(parts[-1]) + 1) * size(s) > args.micro_batch_tokens:
                parts.append([])
            parts[-1].append(s)
        most = torch.tensor(len(parts), device=run.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        while len(parts) < most:   # every rank has as many sequences: one of >= 2 is there to split
            k = max((i for i, p in enumerate(parts) if len(p) > 1), key=lambda i: len(parts[i]) * size(parts[i][-1]))
            parts[k:k + 1] = [parts[k][:len(parts[k]) // 2], parts[k][len(parts[k]) // 2:]]
    batches, banned = [], run.sampling.banned
    for part in parts:
        if args.shared_prefix:   # each group (or the part of it in this micro-batch) one row: its prompt once
            rows_ = [list(r) for _, r in itertools.groupby(part, key=lambda s: id(s[0]))]
            inputs = data.collate_prefix([(r[0][0].sample, [c.token_ids for _, c in r], *extras([c for _, c in r]).values())
                                          for r in rows_], run.pad_id, banned)
        else:
            inputs = data.collate([g.sample for g, _ in part], [c.token_ids for _, c in part], run.pad_id, banned,
                                  **extras([c for _, c in part]))
        inputs["completion_mask"] *= torch.tensor([[float(c.scored)] for _, c in part])   # (B, C): unscored, out of the loss
        batches.append(dict(inputs=inputs, completions=[c for _, c in part]))
    ranks.check_same("micro-batches per step", [len(batches)], run.device)
    # and as many vision-tower runs as the busiest rank's (model.logps_forward: one for images, one for videos)
    chunks = torch.tensor([[-(-b["inputs"]["completion_mask"].numel() // args.logprob_chunk_tokens),
                            max(1, ("pixel_values" in b["inputs"]) + ("pixel_values_videos" in b["inputs"]))]
                           for b in batches], device=run.device)
    dist.all_reduce(chunks, op=dist.ReduceOp.MAX)
    for b, (n, calls) in zip(batches, chunks.tolist()):
        b["chunks"], b["vision_calls"] = n, calls
    return batches


def old_ref_logps(run, batches):
    """Before the update, without grad, onto each completion's record: pi_old (the trainer at the sampler's
    weights) where it is needed before the first optimizer step (--num_iterations > 1; --kl_in_reward), and
    the reference model's log-probs (beta > 0; under LoRA the policy with its adapter off). With one
    iteration and no --kl_in_reward, update's own first forward is pi_old: no extra pass."""
    args = run.args
    with torch.no_grad():
        for b in batches:
            if args.num_iterations > 1 or args.kl_in_reward:
                from_rows(b, "old_logps", completion_logps(run.engine, b, run).logps)
            if run.ref_engine is not None:
                from_rows(b, "ref_logps", completion_logps(run.ref_engine, b, run).logps)
            elif args.beta > 0:   # LoRA: the base model is the policy with its adapter off
                with model.adapter_off(run.engine):
                    from_rows(b, "ref_logps", completion_logps(run.engine, b, run).logps)


def advantages(run, groups, m):
    """Each completion's advantage, by --advantage_estimator over its group (grpo.group_advantages); every
    rank's rewards are gathered here, once, for an estimator that needs a std over the whole batch (all
    ranks hold as many). A completion no reward could score counts in no statistic (advantage 0).
    --kl_in_reward (REINFORCE++, and PPO's RLHF set-up): beta x the completion's summed per-token KL to the
    reference (k1: log pi_old - log pi_ref) comes off its total first, and the loss then has no KL term."""
    args, comps = run.args, [c for g in groups for c in g.completions]
    if args.kl_in_reward:
        for c in comps:
            c.kl_penalty = args.beta * (c.old_logps - c.ref_logps).sum().item()
        m["reward/kl_penalty"] = ranks.Mean(np.mean([c.kl_penalty for c in comps]), len(comps))
    rewards = torch.tensor([c.total - (c.kl_penalty or 0.0) if c.scored else float("nan") for c in comps])   # (N,)
    everyone = None
    if grpo.needs_everyone(args.advantage_estimator, args.scale_rewards):
        everyone = [torch.zeros_like(rewards, device=run.device) for _ in range(run.world)]
        dist.all_gather(everyone, rewards.to(run.device))
        everyone = torch.cat(everyone).cpu()                                                 # (world x N,)
    adv, zero_spread = grpo.group_advantages(rewards, args.num_generations, args.advantage_estimator, args.scale_rewards,
                                             everyone)
    for c, a in zip(comps, adv.tolist()):
        c.advantage = a
    m["reward/zero_spread_groups"] = ranks.Mean(zero_spread, len(groups))


def sampler_gap(run, b, ts, cmask, m, add):
    """The first update iteration runs at the sampler's weights: the trainer's log-probs of the distribution
    the sampler drew from (truncated as it was: logps - log_kept) against vLLM's. Logged as
    rollout/logp_diff_*; the sampler correction's weights go onto each completion's record."""
    args = run.args
    sampled = ts.logps.detach() - (ts.log_kept if ts.log_kept is not None else 0.0)                 # (B, C)
    sampler = to_rows([c.sampler_logps for c in b["completions"]], run.device)                    # (B, C)
    diff = (sampled - sampler).abs() * cmask
    m["rollout/logp_diff_max"] = ranks.Max(max(m.get("rollout/logp_diff_max", 0.0), diff.max().item()))
    add("rollout/logp_diff_mean", diff.sum().item() / max(cmask.sum().item(), 1), cmask.sum().item())
    weights, im = grpo.sampler_correction(sampled, sampler, cmask, args.vllm_importance_sampling_correction,
                                          args.vllm_importance_sampling_cap)
    if weights is not None:
        from_rows(b, "is_weights", weights.expand_as(cmask))
    if im:
        m["sampling/is_ratio_min"] = ranks.Min(min(m.get("sampling/is_ratio_min", im["is_ratio_min"]), im["is_ratio_min"]))
        m["sampling/is_ratio_max"] = ranks.Max(max(m.get("sampling/is_ratio_max", im["is_ratio_max"]), im["is_ratio_max"]))
        add("sampling/is_ratio_mean", im["is_ratio_mean"], im["is_count"])
        add("sampling/is_capped_frac", im["is_capped_frac"], im["is_count"])


def router_loss(run, ts, n_batches, add, loads):
    """A mixture-of-experts forward (ts.router, model.RouterStats): run.aux_loss_coef x its router's load-balancing
    loss, scaled so that over the step's micro-batches (DeepSpeed divides each loss by gas) it adds the coefficient x
    their mean; train/aux_loss, that mean, is logged whether or not it trains, and the tokens per expert go to
    `loads`. 0 for a dense model."""
    if ts.router is None:
        return 0.0
    add("train/aux_loss", ts.router.aux_loss.item(), 1)
    loads.append(ts.router.load)
    return run.aux_loss_coef * run.gas / n_batches * ts.router.aux_loss if run.aux_loss_coef else 0.0


def expert_shares(loads):
    """The experts' load balance of this rank's update: each sparse layer's share of top-k assignments per expert
    (1/E each when even), the largest and the smallest over layers and experts, reduced over ranks as such."""
    if not loads:
        return {}
    share = sum(loads) / sum(loads).sum(dim=-1, keepdim=True)                             # (L, E)
    return {"train/expert_share_max": ranks.Max(share.max().item()),
            "train/expert_share_min": ranks.Min(share.min().item())}


def update(run, batches, m):
    """num_iterations optimizer steps over the rollout batch, micro-batch by micro-batch, reading each
    completion's values from its record. -> stats, each a weighted mean over the whole rollout batch and all
    ranks (ranks.Mean: the same number at any micro-batch size or rank count), except loss (the objective
    DeepSpeed differentiates) and lr. Every per-token mean grpo_loss reports is logged as train/<name>,
    token-weighted (a new one is one line in grpo_loss's metrics)."""
    args, engine = run.args, run.engine
    counts = torch.tensor([sum(b["inputs"]["completion_mask"].sum().item() for b in batches),
                           sum(c.scored for b in batches for c in b["completions"])], dtype=torch.float64, device=run.device)
    dist.all_reduce(counts)
    n_tokens, n_seqs = counts.tolist()   # over all ranks, in the loss
    # Per micro-batch normaliser: DeepSpeed divides each micro-batch loss by gas and averages ranks,
    # so the sum over micro-batches is the whole batch's objective.
    norm = {"token": n_tokens, "sequence": n_seqs, "dr_grpo": n_seqs * args.max_completion_length}[args.loss_agg]
    norm = norm / (run.world * run.gas)   # gas: DeepSpeed's constant divisor, however many micro-batches there are
    beta = 0.0 if args.kl_in_reward else args.beta   # --kl_in_reward: the KL is in the advantages already
    engine.train()
    loss_sum, lrs = 0.0, []
    sums, weights = {}, {}   # {logged name: sum of value x weight}, {logged name: sum of weights}
    loads = []               # mixture-of-experts: each forward's tokens per expert and layer

    def add(name, value, weight):
        sums[name], weights[name] = sums.get(name, 0.0) + value * weight, weights.get(name, 0.0) + weight
    for it in range(args.num_iterations):
        for j, b in enumerate(batches):
            comps = b["completions"]
            b["inputs"].update(model.routing_replay_inputs(b["inputs"], [c.routed_experts for c in comps]))   # replay
            ts = completion_logps(engine, b, run, with_entropy=True, with_kept=it == 0)   # (B, C) each
            cmask = b["inputs"]["completion_mask"].to(run.device)                       # (B, C)
            if it == 0:   # the sampler's weights (no optimizer step yet)
                attn = b["inputs"]["attention_mask"]
                add("update/padded_frac", 1 - attn.sum().item() / attn.numel(), attn.numel())   # of the tokens processed
                if comps[0].old_logps is None:   # one iteration: this forward is pi_old
                    from_rows(b, "old_logps", ts.logps)
                sampler_gap(run, b, ts, cmask, m, add)
            rows = lambda name: to_rows([getattr(c, name) for c in comps], run.device)   # noqa: E731  (B, C)
            loss, lm = grpo.grpo_loss(
                logps=ts.logps, old_logps=rows("old_logps"), advantages=torch.tensor([c.advantage for c in comps], device=run.device),
                mask=cmask, epsilon=args.epsilon, epsilon_high=args.epsilon_high, beta=beta,
                ref_logps=rows("ref_logps") if beta > 0 else None, loss_agg=args.loss_agg, norm=norm,
                importance_sampling_level=args.importance_sampling_level,
                is_weights=rows("is_weights") if comps[0].is_weights is not None else None,
                entropy=ts.entropy, entropy_coef=args.entropy_coef)
            loss = loss + router_loss(run, ts, len(batches), add, loads)   # mixture-of-experts; 0 for a dense model
            engine.set_gradient_accumulation_boundary(j == len(batches) - 1)   # the step's micro-batch count, not gas
            engine.backward(loss)
            if j == len(batches) - 1:
                lrs.append(engine.get_lr()[0])   # the rate of the optimizer step the next call takes
            engine.step()   # DeepSpeed steps the optimizer only at the gradient accumulation boundary
            loss_sum += loss.item() / (run.gas * args.num_iterations)   # micro-batch losses / gas, summed
            for k, v in lm.items():
                if k != "tokens":
                    add(f"train/{k}", v, lm["tokens"])
    grad_norm = engine.get_global_grad_norm()
    stats = {k: ranks.Mean(sums[k] / weights[k] if weights[k] else 0.0, weights[k]) for k in sorted(sums)}
    stats.update({"train/loss": loss_sum, "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                  "train/lr": lrs[-1], **expert_shares(loads)})
    return stats


def log_step(run, step, m, groups, stats):
    """Everything the step measured, reduced over ranks by the rule each number states (ranks.py); rank 0
    writes metrics.jsonl and wandb."""
    args = run.args
    comps = [c for g in groups for c in g.completions]
    scored = [c.total for c in comps if c.scored]
    source = lambda g: g.sample["columns"].get("source")   # noqa: E731  (a data row's "source" field, if it has one)
    m.update({"reward/mean": ranks.Mean(np.mean(scored) if scored else 0.0, len(scored)),
              "reward/std": ranks.Mean(float(np.std(scored, ddof=1)) if len(scored) > 1 else 0.0, len(scored)),
              "completion/length": ranks.Mean(np.mean([c.length for c in comps]), len(comps)),
              "completion/truncated": ranks.Mean(np.mean([c.finish_reason == "length" for c in comps]), len(comps)),
              "data/skipped": ranks.Sum(run.stream.skipped), "data/empty_images": ranks.Sum(run.stream.empty_images),
              **stats})
    for name in args.reward_funcs:
        ok = [c.rewards[name] for c in comps if not c.failed[name]]
        m[f"reward/{name}"] = ranks.Mean(np.mean(ok) if ok else 0.0, len(ok))
        m[f"reward/{name}_failures"] = ranks.Sum(sum(c.failed[name] for c in comps))
    if args.tools:   # calls per trajectory, the share that failed; the most turns a trajectory took: on any rank, on
        calls = [e for c in comps for _, e in c.calls]   # the rank that needed fewest (every rank ran turns_max)
        turns = max(1 + len(c.calls) for c in comps)
        m.update({"tools/calls_mean": ranks.Mean(len(calls) / len(comps), len(comps)),
                  "tools/failure_frac": ranks.Mean(np.mean([e is not None for e in calls]) if calls else 0.0, len(calls)),
                  "tools/turns_max": ranks.Max(turns), "tools/turns_min": ranks.Min(turns)})
    for name in {source(g) for g in groups} - {None}:   # the mean reward of each data source, over every rank's rows
        vals = [c.total for g in groups if source(g) == name for c in g.completions if c.scored]
        m[f"reward/source/{name}"] = ranks.Mean(np.mean(vals) if vals else 0.0, len(vals))
    ranks.reduce_metrics(m, run.device)
    logs.write_metrics(run, m, step)
    logs.log_completions(run, groups, step)


def validate(run, step, m):
    """Greedy decoding on every rank's share of the validation set, scored as training scores (reward_inputs);
    metrics reduced over ranks, logged. Every rank takes part (the sync is a collective), with or without
    samples of its own. The trainer states leave the GPU around it as around a rollout: it is no longer the
    run's peak."""
    args = run.args
    sync(run, m)
    if args.tools:   # the same loop as training's, greedy
        comps = [g.completions[0] for g in trajectories(run, run.val_samples, step, greedy=True)]
    else:
        sp = rollout.sampling_params(dataclasses.replace(run.sampling, temperature=0.0), n=1, max_tokens=args.max_completion_length)
        comps = [Completion(index=0, token_ids=list(o.outputs[0].token_ids), sampler_logps=[], text=o.outputs[0].text,
                            finish_reason=o.outputs[0].finish_reason) for o in run_vllm(run, run.val_samples, [sp] * len(run.val_samples))]
    sleep(run, m)
    texts = [c.text for c in comps]
    total, scores, _ = reward.compute_rewards(args.reward_funcs, args.reward_weights, texts,
                                              reward_inputs(run, run.val_samples, comps))
    n = len(total)
    m = {"val/reward": ranks.Mean(np.mean(total) if n else 0.0, n),
         **{f"val/{k}": ranks.Mean(np.mean(scores[k]) if n else 0.0, n) for k in args.reward_funcs}}
    ranks.reduce_metrics(m, run.device)
    if run.master:
        print(f"[val] step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in m.items()))
        for s, c, r in list(zip(run.val_samples, comps, total))[:args.log_completions]:
            calls = "".join(f" [call {t!r}: {e or 'ok'}]" for t, e in c.calls)   # --tools: each call and how it went
            print(f"    {s['where']}:{calls} {c.text!r} -> {r:.2f}")
    logs.write_metrics(run, m, step)
    return m


def save(run, step):
    checkpoint.save_checkpoint(run.engine, run.args, step, run.stream, run.wandb.id, run.rank)


def finish(run, export=True):
    """Export the final model, close wandb, plot."""
    if export and run.args.save_final_model and not run.args.val_only:
        checkpoint.export_model(run.engine, run.processor, os.path.join(run.args.output_dir, "final_model"), run.master,
                                merged=run.args.export_merged)
    logs.wandb_call(run, run.wandb.finish)
    if run.master:
        print(f"[done] metrics: {run.metrics_path}  plot: {logs.plot_rewards(run.metrics_path)}")
    dist.barrier()
    if run.master:
        job.release_output_dir(run.args.output_dir)   # the next launch into it may start


# ----------------------------------------------------------------------------- main


def train_step(run, step, m):
    """One step on every rank, its phases in the order they run. -> (groups, update stats)."""
    with memory.phase("data", m):
        samples = select_prompts(run, step)             # the hook; images loaded and downscaled once, here
    sync(run, m)                                        # vLLM gets the new weights
    with memory.phase("rollout", m):
        groups = rollout_groups(run, samples, step)     # num_generations completions per prompt
    with memory.phase("reward", m):
        score(run, groups)
    groups = filter_groups(run, groups, step, m)        # the hook: dynamic sampling, curricula
    sleep(run, m)                                       # vLLM frees the GPU for training
    batches = micro_batches(run, groups)                # a layout over the completions' records
    with memory.phase("old_ref_logps", m):
        old_ref_logps(run, batches)                     # onto the records, before the advantages may read them
    advantages(run, groups, m)
    with memory.phase("update", m):
        stats = update(run, batches, m)
    run.updates += 1
    return groups, stats


def main(argv=None):
    args = parse_args(argv)
    if args.plan:
        return startup.print_plan(args)
    run = startup.setup(args)
    if run.val_samples is not None and (args.val_only or args.val_before_train and run.start == 0):
        validate(run, run.start, {})
    bar = tqdm(range(run.start + 1, args.max_steps + 1) if not args.val_only else [], disable=not run.master,
               desc="grpo", dynamic_ncols=True, initial=run.start, total=args.max_steps)
    m, carry = {}, {}   # validation and checkpoint run after the step's row is written: they go in the next row
    with memory.oom_report(lambda: {**m, **carry}):   # an OOM anywhere: say where and what to change
        for step in bar:
            m, carry = carry, {}
            t_step = time.perf_counter()
            groups, stats = train_step(run, step, m)
            m["time/step"] = ranks.Max(time.perf_counter() - t_step)
            log_step(run, step, m, groups, stats)
            if run.master:
                bar.set_postfix_str(f"reward={m.get('reward/mean', float('nan')):.3f} kl={m.get('train/kl', 0.0):.4f} "
                                    f"{memory.summary(m)}")   # no reward/mean: no completion of the step was scored
            if run.val_samples is not None and args.val_freq and (step % args.val_freq == 0 or step == args.max_steps):
                with memory.phase("validation", carry):
                    validate(run, step, {})
            saved = args.save_steps and step % args.save_steps == 0
            if saved:
                with memory.phase("checkpoint", carry):
                    save(run, step)
            if job.preemption_requested(run.device):   # SIGTERM/SIGUSR1/SIGHUP on any rank: all stop here
                if not saved:
                    save(run, step)
                finish(run, export=False)
                if run.master:
                    print(f"[preempt] checkpoint-{step} written; exit {job.PREEMPTED}; relaunch to resume")
                sys.exit(job.PREEMPTED)
    if carry:   # the last step's validation and checkpoint phases: a row of their own, same step
        logs.write_metrics(run, ranks.reduce_metrics(carry, run.device), args.max_steps)
    finish(run)


if __name__ == "__main__":
    main()
