"""GRPO for vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5) with DeepSpeed ZeRO-3 and a colocated vLLM.

Every rank holds a ZeRO-3 shard of the policy and its own in-process vLLM engine. `main()` is a
short loop over the step's named phases; each phase is a function below that a test can call
with small fakes (tests/test_step.py). One step, every rank:

    select_prompts (hook) -> sync (+ offload) -> rollout -> ask_judge -> filter_groups (hook) -> sleep (+ reload)
    -> micro_batches -> old_ref_logps -> score -> advantages -> update -> log -> validate -> checkpoint

Per prompt, one `Group` record (its sample) holds one `Completion` record per completion, which every
phase reads and writes (token ids, sampler / old / reference log-probs, rewards, advantage); micro-batches
are a layout that points at them. `Run` holds what the run owns (startup.setup builds it), `run.sampling` the
sampled distribution.

    deepspeed train.py --num_generations 7                        # embedded tiny model + task
    deepspeed --num_gpus 8 train.py --model Qwen/Qwen2.5-VL-7B-Instruct \
        --train_data data/train.jsonl --val_data data/val.jsonl --bf16 --num_generations 7

The set-up: startup.py. The update phase (the losses, the optimizer steps): learner.py. Flags: flags.py. The model
and its DeepSpeed config: model.py. Reductions over ranks and the checked invariants: ranks.py. Data, images and videos: data.py. The math: grpo.py. vLLM and the weight
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
import judge
import learner
import logs
import memory
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
    spans: dict = dataclasses.field(default_factory=dict)     # {reward function: [(start, end, score)]}: scored by step
    events: list = None              # --advantage_estimator process: [(token index, weighted score)], each reward's
    total: float = None              # weighted sum of the rewards (score)
    old_logps: torch.Tensor = None   # (n,) the trainer's log-probs at the sampler's weights, pi_old (0 outside the loss)
    ref_logps: torch.Tensor = None   # (n,) the reference model's (beta > 0)
    is_weights: torch.Tensor = None  # (n,) the sampler correction's weight per token (per sequence: repeated)
    kl_penalty: float = None         # --kl_in_reward: beta x the summed per-token KL to the reference, off the total
    advantage: object = None         # a float, or (n,) one per token (--advantage_estimator process)

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
        """Each completion's total reward; a group the step has not scored yet is said by name (score first)."""
        if any(c.total is None for c in self.completions):
            raise RuntimeError("this group is not scored yet: train.score(run, groups) puts the rewards on the records "
                               "(train_step scores after the old and reference log-probs; a filter that reads rewards "
                               "calls it first)")
        return [c.total for c in self.completions]


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
    --tools also the whole trajectory's text (`trajectory`), the number of its calls (`tool_calls`) and of its
    failed calls (`tool_failures`)."""
    cols = data.reward_columns(samples)
    cols.update(completion_length=[c.length for c in comps], max_completion_length=[run.args.max_completion_length] * len(comps))
    if run.args.tools:
        cols.update(trajectory=run.processor.tokenizer.batch_decode([c.token_ids for c in comps], skip_special_tokens=True),
                    tool_calls=[len(c.calls) for c in comps],
                    tool_failures=[sum(e is not None for _, e, _ in c.calls) for c in comps])
    return cols


def ask_judge(run, groups):
    """--reward_funcs judge: the judge's requests for these completions go out now (judge.send), so that it answers
    while the trainer works; score() collects its answers. A no-op without the judge."""
    if "judge" in run.args.reward_funcs:
        comps = [c for g in groups for c in g.completions]
        cols = reward_inputs(run, [g.sample for g in groups for _ in g.completions], comps)
        judge.send([c.text for c in comps], [{k: v[i] for k, v in cols.items()} for i in range(len(comps))])


def score(run, groups):
    """Rewards per completion, per function, with failure flags, onto each completion's record (a group scored
    already is kept as it is); every rank's groups' rewards into run.stream.history (a collective: all ranks score
    together). The judge's scores are collected here (ask_judge sent its requests)."""
    args, spans = run.args, {}
    pairs = [(g.sample, c) for g in groups for c in g.completions if c.total is None]
    total, scores, failed = reward.compute_rewards(args.reward_funcs, args.reward_weights, [c.text for _, c in pairs],
                                                   reward_inputs(run, [s for s, _ in pairs], [c for _, c in pairs]),
                                                   spans)
    for i, (_, c) in enumerate(pairs):
        c.total, c.rewards, c.failed = total[i], {n: v[i] for n, v in scores.items()}, {n: v[i] for n, v in failed.items()}
        c.spans = {n: v[i] for n, v in spans.items() if v[i] is not None}
        if args.advantage_estimator == "process" and c.scored:
            c.events = reward_events(run, c)
    everyone = [None] * run.world
    dist.all_gather_object(everyone, [(g.sample.get("id"), g.totals) for g in groups])
    run.stream.history.update((i, r) for part in everyone for i, r in part if i is not None)


def reward_events(run, c):
    """A completion's rewards as events (token index, weighted score) for process supervision: a reward that scored
    steps (spans of the text) gives one event per step, at the token that writes the step's last character
    (token_of); any other reward one event at the last token."""
    args, last = run.args, len(c.token_ids) - 1
    out = []
    for name, w in zip(args.reward_funcs, reward.weights_of(args.reward_funcs, args.reward_weights)):
        if name in c.spans:
            out += [(token_of(run.processor.tokenizer, c.token_ids, end), w * s) for _, end, s in c.spans[name]]
        else:
            out.append((last, w * c.rewards[name]))
    return out


def token_of(tokenizer, ids, end):
    """The index of the token that writes character `end` - 1 of the completion's text, decoded as the rewards read it
    (special tokens skipped): the first token whose decoded prefix reaches `end` characters, by bisection. A character
    of several bytes split over tokens belongs to the token that writes its last byte (a prefix ending inside it
    decodes to U+FFFD, not counted)."""
    lo, hi = 0, max(len(ids) - 1, 0)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid + 1], skip_special_tokens=True).rstrip("\ufffd")) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


def filter_groups(run, groups, step, m):
    """The hook after the rollout, while vLLM is still awake: return the groups to train on. A filter (a
    curriculum, ...) goes here; it may generate and score more groups. A filter that reads rewards scores first,
    score(run, groups) (a collective; a group is scored once, so train_step's later call keeps it); the step scores
    after the trainer's log-prob passes otherwise, so that a judge answers while the trainer works. Every rank must
    return the same number of groups (checked in micro_batches).

    --dynamic_sampling (DAPO, Yu et al. 2025): a group whose rewards are all equal has zero
    advantages, no signal; it is dropped and more prompts are rolled out, up to
    --max_num_gen_batches rounds. The rounds are collective (all ranks loop until every rank has
    enough: vLLM TP groups generate together), each rank keeps exactly rollout_batch_size / world
    groups, and a shortfall after the last round is filled with dropped groups (no policy gradient;
    only the KL term acts on them), counted in dynamic/filled_count."""
    if not run.args.dynamic_sampling:
        return groups
    t0 = time.perf_counter()
    score(run, groups)   # the rewards it filters on (a group is scored once: train_step's score keeps it)
    spread = lambda g: len({c.total for c in g.completions if c.scored}) > 1   # noqa: E731  (an unscored one holds 0)
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
            ask_judge(run, more)
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
    on). A completion that no reward function could score stays in its place (learner.in_loss leaves it out).
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
        batches.append(dict(inputs=inputs, completions=[c for _, c in part]))
    return learner.in_step(run, batches, "micro-batches per step")


def advantages(run, groups, m):
    """Each completion's advantage, by --advantage_estimator over its group (grpo.group_advantages, which gets the
    estimator's own options by name: grpo.ESTIMATORS); every rank's rewards are gathered here, once, for an estimator
    that needs a std over the whole batch (all ranks hold as many). A completion no reward could score counts in no
    statistic (advantage 0). --advantage_estimator process: one advantage per token, from each completion's reward
    events (grpo.process_advantages). --kl_in_reward (REINFORCE++, and PPO's RLHF set-up): beta x the completion's
    summed per-token KL to the reference (k1: log pi_old - log pi_ref) comes off its total first (an event at its last
    token), and the loss then has no KL term."""
    args, comps = run.args, [c for g in groups for c in g.completions]
    if args.kl_in_reward:
        for c in comps:
            c.kl_penalty = args.beta * (c.old_logps - c.ref_logps).sum().item()
        m["reward/kl_penalty"] = ranks.Mean(np.mean([c.kl_penalty for c in comps]), len(comps))
    if args.advantage_estimator == "process":
        events = [c.events + ([(len(c.token_ids) - 1, -c.kl_penalty)] if c.kl_penalty else []) if c.scored else None
                  for c in comps]
        adv, zero_spread = grpo.process_advantages(events, [len(c.token_ids) for c in comps], args.num_generations)
    else:
        rewards = torch.tensor([c.total - (c.kl_penalty or 0.0) if c.scored else float("nan") for c in comps])   # (N,)
        everyone = None
        if grpo.needs_everyone(args.advantage_estimator, args.scale_rewards):
            everyone = [torch.zeros_like(rewards, device=run.device) for _ in range(run.world)]
            dist.all_gather(everyone, rewards.to(run.device))
            everyone = torch.cat(everyone).cpu()                                             # (world x N,)
        options = {name: getattr(args, name) for name in grpo.ESTIMATORS[args.advantage_estimator]}
        adv, zero_spread = grpo.group_advantages(rewards, args.num_generations, args.advantage_estimator,
                                                 everyone=everyone, **options)
        adv = adv.tolist()
    for c, a in zip(comps, adv):
        c.advantage = a
    m["reward/zero_spread_groups"] = ranks.Mean(zero_spread, len(groups))


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
    if args.tools:   # calls per trajectory, the share that failed (and apart: the model's bad calls, the tools' own
        # errors); the most turns a trajectory took: on any rank, on the rank that needed fewest (all ran turns_max)
        calls = [(e, kind) for c in comps for _, e, kind in c.calls]
        frac = lambda ok: ranks.Mean(np.mean([ok(e, k) for e, k in calls]) if calls else 0.0, len(calls))   # noqa: E731
        turns = max(1 + len(c.calls) for c in comps)
        m.update({"tools/calls_mean": ranks.Mean(len(calls) / len(comps), len(comps)),
                  "tools/failure_frac": frac(lambda e, kind: e is not None),
                  "tools/bad_call_frac": frac(lambda e, kind: kind == toolbox.BAD_CALL),
                  "tools/tool_error_frac": frac(lambda e, kind: kind == toolbox.TOOL_ERROR),
                  "tools/turns_max": ranks.Max(turns), "tools/turns_min": ranks.Min(turns)})
    if "judge" in args.reward_funcs:   # its unique requests, the slowest, what the step waited, failures by reason
        st = judge.STATS
        m.update({"judge/requests": ranks.Sum(st.get("requests", 0)),
                  "judge/latency_s": ranks.Max(st.get("latency_s", 0.0)), "judge/wait_s": ranks.Max(st.get("wait_s", 0.0)),
                  **{f"judge/{k}": ranks.Sum(v) for k, v in st.items() if k.startswith("failed_")}})
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
    total, scores, failed = reward.compute_rewards(args.reward_funcs, args.reward_weights, texts,
                                                   reward_inputs(run, run.val_samples, comps))
    scored = [t for i, t in enumerate(total) if not any(f[i] for f in failed.values())]   # as training: no placeholder 0
    m = {"val/reward": ranks.Mean(np.mean(scored) if scored else 0.0, len(scored)),
         **{f"val/{k}": ranks.Mean(np.mean(ok) if (ok := [v for v, f in zip(scores[k], failed[k]) if not f]) else 0.0,
                                   len(ok)) for k in args.reward_funcs}}
    ranks.reduce_metrics(m, run.device)
    if run.master:
        print(f"[val] step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in m.items()))
        for s, c, r in list(zip(run.val_samples, comps, total))[:args.log_completions]:
            calls = "".join(f" [call {t!r}: {e or 'ok'}]" for t, e, _ in c.calls)   # --tools: each call and how it went
            print(f"    {s['where']}:{calls} {c.text!r} -> {r:.2f}")
    logs.write_metrics(run, m, step)
    return m


def save(run, step):
    checkpoint.save_checkpoint(run.engine, run.args, step, run.stream, run.wandb.id, run.rank, run.moving_reference)


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


def temperature_at(args, step):
    """--temperature_end: the sampling temperature goes linearly from --temperature at step 1 to --temperature_end
    at --max_steps; vLLM samples with it and the trainer's log-probs are of it (the one Sampling record)."""
    if args.temperature_end is None:
        return args.temperature
    return args.temperature + (args.temperature_end - args.temperature) * (step - 1) / max(1, args.max_steps - 1)


def step_line(m):
    """The step's numbers in the progress bar (rank 0): the reward (nan: no completion of the step was scored), the KL,
    the memory; with --tools, the share of calls whose tool failed (raised, timed out) when there is one, so that a
    broken tool is seen where the run is watched, not mistaken for a model that cannot call it."""
    tools = f" tool_errors={m['tools/tool_error_frac']:.0%}" if m.get("tools/tool_error_frac") else ""
    return f"reward={m.get('reward/mean', float('nan')):.3f} kl={m.get('train/kl', 0.0):.4f}{tools} {memory.summary(m)}"


def train_step(run, step, m):
    """One step on every rank, its phases in the order they run. -> (groups, update stats)."""
    judge.new_step()                                    # --reward_funcs judge: identical requests asked once a step
    run.sampling = dataclasses.replace(run.sampling, temperature=temperature_at(run.args, step))
    m["sampling/temperature"] = run.sampling.temperature
    with memory.phase("data", m):
        samples = select_prompts(run, step)             # the hook; images loaded and downscaled once, here
    sync(run, m)                                        # vLLM gets the new weights
    with memory.phase("rollout", m):
        groups = rollout_groups(run, samples, step)     # num_generations completions per prompt
    ask_judge(run, groups)                              # --reward_funcs judge: it answers while the trainer works
    groups = filter_groups(run, groups, step, m)        # the hook: dynamic sampling, curricula (it scores first)
    sleep(run, m)                                       # vLLM frees the GPU for training
    batches = micro_batches(run, groups)                # a layout over the completions' records
    with memory.phase("old_ref_logps", m):
        learner.old_ref_logps(run, batches)             # onto the records, before the advantages may read them
    with memory.phase("reward", m):
        score(run, groups)                              # every reward onto the records (the judge's collected)
    advantages(run, groups, m)
    with memory.phase("update", m):
        stats = learner.update(run, batches, m, extra=learner.sft_losses(run, groups))   # --sft_coef: another forward
        learner.reference_step(run)                     # --ref_ema: the reference follows the policy
    run.updates += 1
    return groups, stats


def judge_gave_up(run, step, m):
    """The message to stop with when the judge (--reward_funcs judge) gave no score in --judge_max_failed_steps steps
    in a row, else None; from the step's reduced metrics (the same on every rank). A step in which it scored
    anything resets the count."""
    if "judge" not in run.args.reward_funcs:
        return None
    failed = sum(v for k, v in m.items() if k.startswith("judge/failed_"))
    run.judge_silent = run.judge_silent + 1 if m.get("judge/requests", 0) and failed >= m["judge/requests"] else 0
    if run.judge_silent < run.args.judge_max_failed_steps:
        return None
    reasons = ", ".join(k[len("judge/failed_"):] for k in m if k.startswith("judge/failed_"))
    return (f"error: the judge at {run.args.judge_url} gave no score in {run.judge_silent} steps in a row ({reasons}); "
            f"checkpoint-{step} is written. Check the server (and --judge_model, --judge_api_key_env), then relaunch: "
            f"the run resumes")


def main(argv=None):
    args = parse_args(argv)
    if args.plan:
        return startup.print_plan(args)
    if args.check_data:
        sys.exit(startup.check_data_alone(args))
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
                bar.set_postfix_str(step_line(m))
            if why := judge_gave_up(run, step, m):   # --judge_max_failed_steps steps without one score: stop, saved
                save(run, step)
                finish(run, export=False)
                sys.exit(why)
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
