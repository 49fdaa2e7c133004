"""GRPO for vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5) with DeepSpeed ZeRO-3 and a colocated vLLM.

Every rank holds a ZeRO-3 shard of the policy and its own in-process vLLM engine. `train_step` is one step as a short
list of named phases, and `main()` loops over it; each phase is a function below, in the order the step calls it,
that a test can call with small fakes (tests/test_step.py). Per prompt, one `Group` record holds one `Completion`
record per completion: every phase reads and writes them, and micro-batches are a layout that points at them.

    deepspeed train.py --num_generations 7                        # embedded tiny model + task
    deepspeed --num_gpus 8 train.py --model Qwen/Qwen2.5-VL-7B-Instruct \
        --train_data data/train.jsonl --val_data data/val.jsonl --bf16 --num_generations 7

Elsewhere: the set-up in startup.py, the update phase in learner.py, the math in grpo.py, vLLM and the weight sync in
rollout.py, the flags in flags.py, the model in model.py, data in data.py, reductions over ranks in ranks.py, memory
in memory.py and planner.py (`--plan`), checkpoints in checkpoint.py, the job's lifetime in job.py, metrics in
logs.py, multi-turn tools in toolbox.py. Left out on purpose: a trainer class, callbacks, a vLLM server mode.
"""
import dataclasses
import functools
import itertools
import os
import sys
import time
import warnings
import zlib

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
from flags import check_args, grad_accumulation_steps, inert_flags, micro_batch, parse_args  # noqa: F401


# ----------------------------------------------------------------------------- records
@dataclasses.dataclass
class Completion:
    """Completion k of the step's group i (groups[i].completions[k]): every value the step computes for it, in the
    order the step computes them. A paper's per-completion quantity is one more field."""
    index: int                       # its place in the group, 0 .. num_generations - 1
    token_ids: list                  # (n,) what the model wrote (--tools: and the tool messages between its turns)
    sampler_logps: list              # (n,) vLLM's log-prob of each token, of its sampling distribution (0: not its)
    text: str                        # the model's (last) answer: what the rewards score
    finish_reason: str               # "stop" or "length"
    mask: list = None                # --tools: (n,) 1 where the model wrote the token (trained), else 0
    mm: dict = None                  # --tools: its tool images for the training forward (data.collate), or None
    calls: list = dataclasses.field(default_factory=list)    # --tools: (the turn's text, error or None, kind) per call
    images: list = dataclasses.field(default_factory=list)   # --tools: the images the tools returned
    routed_experts: object = None    # --routing_replay: (P + n - 1, layers, k) vLLM's experts for its prompt and tokens
    rewards: dict = dataclasses.field(default_factory=dict)   # {reward function: score}
    failed: dict = dataclasses.field(default_factory=dict)    # {reward function: True if it raised or gave None/NaN}
    spans: dict = dataclasses.field(default_factory=dict)     # {reward function: [(start, end, score)]}: scored by step
    events: list = None              # --advantage_estimator process: [(token index, weighted score)]
    total: float = None              # weighted sum of the rewards (score)
    old_logps: torch.Tensor = None   # (n,) the trainer's log-probs at the sampler's weights, pi_old
    ref_logps: torch.Tensor = None   # (n,) the reference model's (beta > 0)
    teacher_logps: torch.Tensor = None   # (n,) --teacher_model's, of the sampled distribution
    scorer_logps: torch.Tensor = None    # (n,) --reward_model's, at temperature 1 (reward.Scorer)
    is_weights: torch.Tensor = None  # (n,) the sampler correction's weight per token (per sequence: repeated)
    kl_penalty: float = None         # --kl_in_reward: beta x the summed per-token KL to the reference, off the total
    advantage: object = None         # a float, or (n,) one per token (--advantage_estimator process)

    @property
    def scored(self):
        """Every reward function scored it: it counts in its group's statistics and the loss."""
        return not any(self.failed.values())

    @property
    def length(self):
        """The tokens the model wrote (not a trajectory's tool messages)."""
        return len(self.token_ids) if self.mask is None else sum(self.mask)


@dataclasses.dataclass
class Group:
    """One prompt and its num_generations completions."""
    sample: dict                     # data.prepare(): images, vllm_ids, hf, columns, where
    completions: list                # (G,) Completion records

    @property
    def totals(self):
        """The completions' total rewards; an error if not scored yet."""
        if any(c.total is None for c in self.completions):
            raise RuntimeError("this group is not scored yet: train.score(run, groups) puts the rewards on the records "
                               "(train_step scores after the old and reference log-probs; a filter that reads rewards "
                               "calls it first)")
        return [c.total for c in self.completions]


class Metrics(dict):
    """The step's logged numbers, {name: value}, each typed by how it combines over ranks (ranks.Sum, Max, Min,
    Mean). add() builds a weighted mean, and loads keeps each mixture-of-experts forward's expert loads."""

    def __init__(self):
        super().__init__()
        self.sums, self.weights = {}, {}   # {name: sum of value x weight}, {name: sum of weights}
        self.loads = []                    # (L, E) tokens per expert and layer, one per forward

    def add(self, name, value, weight):
        """One more value of the weighted mean `name`."""
        self.sums[name], self.weights[name] = (self.sums.get(name, 0.0) + value * weight,
                                               self.weights.get(name, 0.0) + weight)

    def means(self):
        """-> {name: ranks.Mean(weighted mean, total weight)} of what add() got, sorted by name."""
        return {k: ranks.Mean(self.sums[k] / self.weights[k] if self.weights[k] else 0.0, self.weights[k])
                for k in sorted(self.sums)}

    @functools.cached_property
    def next_row(self):
        """The next step's Metrics: validation and checkpoint run after this row is written, and log there."""
        return Metrics()


# ----------------------------------------------------------------------------- the step and the loop
def train_step(run, step, m):
    """One step on every rank, its phases in the order they run, its numbers into m. -> (groups, update stats)."""
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
    if run.teacher_engine is not None or run.reward_engine is not None:
        with memory.phase("teacher_logps", m):
            learner.frozen_logps(run, batches)          # --teacher_model, --reward_model: their log-probs
    with memory.phase("reward", m):
        score(run, groups)                              # every reward onto the records (the judge's collected)
    advantages(run, groups, m)
    with memory.phase("update", m):
        stats = learner.update(run, batches, m, extra=learner.sft_losses(run, groups))   # --sft_coef: another forward
        learner.reference_step(run, step)               # --ref_ema, --ref_reset_steps: the reference moves
    run.updates += 1
    return groups, stats


def main(argv=None):
    """Plan (--plan), check the data (--check_data), or set up and train: steps, validation, checkpoints."""
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
    m = Metrics()
    with memory.oom_report(lambda: {**m, **m.next_row}):   # an OOM anywhere: say where and what to change
        for step in bar:
            m = m.next_row   # it holds the last step's validation and checkpoint phases already
            t_step = time.perf_counter()
            groups, stats = train_step(run, step, m)
            m["time/step"] = ranks.Max(time.perf_counter() - t_step)
            log_step(run, step, m, groups, stats)
            after_step(run, step, m)                    # the hook: m reduced over ranks; --kl_target's controller
            if run.master:
                bar.set_postfix_str(step_line(m))
            if why := judge_gave_up(run, step, m, last=step == args.max_steps):   # no scores: stop, saved
                save(run, step)
                finish(run, export=False)
                sys.exit(why)
            if run.val_samples is not None and args.val_freq and (step % args.val_freq == 0 or step == args.max_steps):
                with memory.phase("validation", m.next_row):
                    validate(run, step, {})
            saved = args.save_steps and step % args.save_steps == 0
            if saved:
                with memory.phase("checkpoint", m.next_row):
                    save(run, step)
            if job.preemption_requested(run.device):   # SIGTERM/SIGUSR1/SIGHUP on any rank: all stop here
                if not saved:
                    save(run, step)
                finish(run, export=False)
                if run.master:
                    print(f"[preempt] checkpoint-{step} written; exit {job.PREEMPTED}; relaunch to resume")
                sys.exit(job.PREEMPTED)
    if m.next_row:   # the last step's validation and checkpoint phases: a row of their own, same step
        logs.write_metrics(run, ranks.reduce_metrics(m.next_row, run.device), args.max_steps)
    finish(run)


# ----------------------------------------------------------------------------- the step's phases, in its order
def select_prompts(run, step):
    """The hook before the rollout: this rank's run.per_rank prompts for the step. A curriculum goes here;
    run.stream.history maps a sample's stable id to its group's last rewards, on any rank, and run.state keeps a
    curriculum's own counts (--curriculum pass_rate's). Skipping solved prompts until as many were skipped as there
    are rows (then a stream all solved still gives its prompts), for example:

        out, skipped = [], 0
        while len(out) < run.per_rank:
            s = run.stream.next(1)[0]
            if min(run.stream.history.get(s["id"], [0.0])) < 1.0 or skipped >= len(run.stream.rows):
                out.append(s)
            else:
                skipped += 1
        return out
    """
    if run.args.curriculum == "pass_rate":
        return pass_rate_prompts(run, step)
    return run.stream.next(run.per_rank)


def sync(run, m):
    """vLLM wakes and gets the trainer's weights if an optimizer step happened since the last sync (or --sleep_level 2
    dropped them); then the trainer states leave the GPU and vLLM's KV cache comes back."""
    args = run.args
    with memory.phase("sync", m):
        rollout.wake(run.llm, args.sleep_level, ["weights"])
        if run.synced_at != run.updates or args.sleep_level == 2:
            # the base once (level 2: each time), then the adapter
            adapter = args.use_peft and args.lora_sync == "adapter"
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
    """num_generations completions per sample from the awake, synced vLLM -> one Group per sample. `round` > 0:
    dynamic sampling's further rollouts in the same step, with other seeds."""
    args = run.args
    if args.tools:
        return trajectories(run, samples, step, round)
    sps = [rollout.sampling_params(run.sampling, n=args.num_generations, max_tokens=args.max_completion_length,
                                   logprobs=0,
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
    if args.routing_replay:   # every rank alike: one alone would leave the others in the next collective
        ranks.refuse_together("--routing_replay: vLLM returned a completion without its routed_experts" if any(
            c.routed_experts is None for g in groups for c in g.completions) else None)
    return groups


def run_vllm(run, samples, sps):
    """This rank's samples and their sampling params, generated by its whole vLLM tensor-parallel group -> this
    rank's outputs."""
    tp = run.args.vllm_tensor_parallel_size
    requests = [data.vllm_request(s) for s in samples]
    reqs, offset = ranks.tp_gather(requests, run.tp_group, tp)
    params, _ = ranks.tp_gather(sps, run.tp_group, tp)
    if not reqs:   # the whole TP group is done (multi-turn: its trajectories ended before the busiest rank's)
        return []
    if tp > 1:   # vLLM would mix up outputs (or hang) if the group's ranks submitted different requests
        ranks.check_same("the vLLM requests (prompt ids, image and video sizes, sampling params)",
                         [ranks.digest([(r["prompt_token_ids"], media_sizes(r)) for r in reqs]
                                       + [repr(sp) for sp in params])],
                         run.device, run.tp_group)
    outs = rollout.generate(run.llm, reqs, params, run.lora_request)
    return outs[offset:offset + len(samples)]


def media_sizes(request):
    """-> its image sizes, then its videos' (frames shape, frame indices)."""
    mm = request.get("multi_modal_data", {})
    return ([im.size for im in mm.get("image", [])]
            + [(f.shape, meta["frames_indices"]) for f, meta in mm.get("video", [])])


def filter_groups(run, groups, step, m):
    """The hook after the rollout, while vLLM is awake -> the groups to train on, as many on every rank. A filter
    that reads rewards calls score(run, groups) first. --dynamic_sampling (DAPO) drops the groups without spread and
    rolls out more, up to --max_num_gen_batches rounds; dropped groups fill a shortfall."""
    if not run.args.dynamic_sampling:
        return groups
    t0 = time.perf_counter()
    score(run, groups)   # the rewards it filters on (a group is scored once: train_step's score keeps it)
    keep, dropped, rounds = [g for g in groups if has_spread(g)], [g for g in groups if not has_spread(g)], 1
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
        keep += [g for g in more if has_spread(g)]
        dropped += [g for g in more if not has_spread(g)]
        rounds += 1
    filled = max(0, run.per_rank - len(keep))
    m.update({"dynamic/dropped_count": ranks.Sum(len(dropped)), "dynamic/filled_count": ranks.Sum(filled),
              "dynamic/rounds_max": ranks.Max(rounds), "time/dynamic_sampling": ranks.Max(time.perf_counter() - t0)})
    return (keep + dropped[:filled])[:run.per_rank]


def has_spread(g):
    """Its scored completions' totals differ."""
    return len({c.total for c in g.completions if c.scored}) > 1


def sleep(run, m):
    """vLLM sleeps (frees its GPU memory) and the trainer states come back to the GPU."""
    args = run.args
    with memory.phase("sleep", m):   # level 1 pins a host copy of the weights here: an OOM names this phase
        m["sleep/freed_gb"] = rollout.sleep(run.llm, args.sleep_level, args.gc_collect_after_offload) / 2 ** 30
    if run.offload:
        with memory.phase("reload", m):
            run.engine.reload_states()


def micro_batches(run, groups):
    """-> [{"inputs": collated tensors, "completions": the records, "chunks", "vision_calls"}], as many on every
    rank; similar lengths share one, padded to its own longest."""
    seqs = sort_by_length(run.args, groups)   # [(group, completion)]
    parts = split(run.args, seqs)
    parts = even_out(run, parts)              # the one collective
    batches = [collate(run, part) for part in parts]
    return learner.in_step(run, batches, "micro-batches per step")


def prompt_length(g):
    return g.sample["hf"]["input_ids"].shape[1]


def padded_size(g, c):
    """Its prompt's tokens and its own (at least one)."""
    return prompt_length(g) + max(len(c.token_ids), 1)


def sort_by_length(args, groups):
    """-> [(group, completion)], shortest first and stable; --shared_prefix: by the group's whole row."""
    seqs = [(g, c) for g in groups for c in g.completions]
    if args.shared_prefix:
        rows = {id(g): prompt_length(g) + sum(len(c.token_ids) for c in g.completions) for g in groups}
        seqs.sort(key=lambda s: rows[id(s[0])])
    else:
        seqs.sort(key=lambda s: padded_size(*s))
    return seqs


def split(args, seqs):
    """Sorted sequences -> parts of --per_device_train_batch_size, or of at most --micro_batch_tokens padded tokens."""
    if not args.micro_batch_tokens:
        size = args.per_device_train_batch_size
        return [seqs[i:i + size] for i in range(0, len(seqs), size)]
    parts = [[]]
    for g, c in seqs:   # ascending: the newest sequence is its micro-batch's longest
        if parts[-1] and (len(parts[-1]) + 1) * padded_size(g, c) > args.micro_batch_tokens:
            parts.append([])
        parts[-1].append((g, c))
    return parts


def even_out(run, parts):
    """--micro_batch_tokens: split the largest parts until every rank has as many as the busiest (ZeRO-3)."""
    if not run.args.micro_batch_tokens:
        return parts
    most = torch.tensor(len(parts), device=run.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    while len(parts) < most:   # every rank has as many sequences: one of >= 2 is there to split
        k = max((i for i, p in enumerate(parts) if len(p) > 1),
                key=lambda i: len(parts[i]) * padded_size(*parts[i][-1]))
        half = len(parts[k]) // 2
        parts[k:k + 1] = [parts[k][:half], parts[k][half:]]
    return parts


def collate(run, part):
    """[(group, completion)] -> {"inputs": collated tensors, "completions": the records}; --shared_prefix: one row
    per group, its prompt once."""
    banned = run.sampling.banned
    if run.args.shared_prefix:
        rows = []
        for _, row in itertools.groupby(part, key=lambda s: id(s[0])):
            row = list(row)
            cs = [c for _, c in row]
            rows.append((row[0][0].sample, [c.token_ids for c in cs], [c.mask for c in cs], [c.mm for c in cs]))
        inputs = data.collate_prefix(rows, run.pad_id, banned)
    else:
        cs = [c for _, c in part]
        inputs = data.collate([g.sample for g, _ in part], [c.token_ids for c in cs], run.pad_id, banned,
                              masks=[c.mask for c in cs], mms=[c.mm for c in cs])
    return dict(inputs=inputs, completions=[c for _, c in part])


def score(run, groups):
    """Rewards and failure flags onto each record not scored yet (the judge's answers collected); every rank's
    rewards into run.stream.history (a collective)."""
    args, spans = run.args, {}
    pairs = [(g.sample, c) for g in groups for c in g.completions if c.total is None]
    total, scores, failed = reward.compute_rewards(args.reward_funcs, args.reward_weights, [c.text for _, c in pairs],
                                                   reward_inputs(run, [s for s, _ in pairs], [c for _, c in pairs]),
                                                   spans)
    for i, (_, c) in enumerate(pairs):
        c.total, c.rewards = total[i], {n: v[i] for n, v in scores.items()}
        c.failed = {n: v[i] for n, v in failed.items()}
        c.spans = {n: v[i] for n, v in spans.items() if v[i] is not None}
        if args.advantage_estimator == "process" and c.scored:
            c.events = reward_events(run, c)
    everyone = [None] * run.world
    dist.all_gather_object(everyone, [(g.sample.get("id"), g.totals) for g in groups])
    run.stream.history.update((i, r) for part in everyone for i, r in part if i is not None)
    if args.curriculum == "pass_rate":   # {id: [completions that passed, completions]}, from every rank's groups
        counts = run.state.setdefault("pass_rate", {})
        for i, totals in (x for part in everyone for x in part if x[0] is not None):
            passed, tries = counts.get(i, (0, 0))
            counts[i] = [passed + sum(t >= PASS for t in totals), tries + len(totals)]


def reward_inputs(run, samples, comps):
    """The columns rewards read, {field: [value per completion]}: the samples' fields, lengths, and --tools' calls."""
    cols = data.reward_columns(samples)
    cols.update(completion_length=[c.length for c in comps],
                max_completion_length=[run.args.max_completion_length] * len(comps))
    if "judge" in run.args.reward_funcs:   # the judge's template names the image; --judge_images sends its pixels
        cols.update(image=[s["sources"][0] if s["sources"] else None for s in samples],
                    _images=[s["images"] for s in samples])
    if run.args.reward_model:   # validation has no reward-model log-probs: scorer None, the reward unscored
        logps = [c.scorer_logps for c in comps]
        cols.update(scorer=None if any(lp is None for lp in logps) else reward.Scorer(
            processor=run.processor, device=run.device, token_ids=[c.token_ids for c in comps],
            images=[s["images"] + c.images for s, c in zip(samples, comps)], logps=logps,
            mask=[torch.ones(len(c.token_ids)) if c.mask is None else torch.as_tensor(c.mask, dtype=torch.float32)
                  for c in comps], engine=run.reward_engine))
    if run.args.tools:
        cols.update(trajectory=run.processor.tokenizer.batch_decode([c.token_ids for c in comps],
                                                                    skip_special_tokens=True),
                    tool_calls=[len(c.calls) for c in comps],
                    tool_failures=[sum(e is not None for _, e, _ in c.calls) for c in comps])
    return cols


def advantages(run, groups, m):
    """Each completion's advantage by --advantage_estimator over its group (process: one per token); an unscored
    completion counts in no statistic. --kl_in_reward: beta x its summed KL to the reference comes off its total."""
    args, comps = run.args, [c for g in groups for c in g.completions]
    if args.kl_in_reward:
        for c in comps:
            c.kl_penalty = learner.kl_beta(run) * (c.old_logps - c.ref_logps).sum().item()
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
        lost = [g.sample["where"] for g in groups
                if grpo.spread_lost_to_precision([c.total if c.scored else float("nan") for c in g.completions])]
        if lost:   # rewards that differ but whose advantages came out 0 (or not finite) in float32
            print(f"[reward] {len(lost)} group(s) ({lost[0]}, ...) have rewards that differ but zero advantages: "
                  f"their spread is lost to float32 precision (values near 1e38 or beyond, or differences below 1e-7 "
                  f"of their size); scale the reward")
    for c, a in zip(comps, adv):
        c.advantage = a
    learner.distill(run, comps, m)                      # --teacher_model: its per-token advantage added
    m["reward/zero_spread_groups"] = ranks.Mean(zero_spread, len(groups))


# ----------------------------------------------------------------------------- after the step: log, validate, save
def log_step(run, step, m, groups, stats):
    """Everything the step measured, reduced over ranks by the rule each number states (ranks.py); rank 0 writes
    metrics.jsonl and wandb."""
    args = run.args
    comps = [c for g in groups for c in g.completions]
    scored = [c.total for c in comps if c.scored]
    m.update({"reward/mean": ranks.Mean(np.mean(scored) if scored else 0.0, len(scored)),
              "reward/std": ranks.Mean(float(np.std(scored, ddof=1)) if len(scored) > 1 else 0.0, len(scored)),
              "completion/length": ranks.Mean(np.mean([c.length for c in comps]), len(comps)),
              "completion/truncated": ranks.Mean(np.mean([c.finish_reason == "length" for c in comps]), len(comps)),
              "data/skipped": ranks.Sum(run.stream.skipped), "data/empty_images": ranks.Sum(run.stream.empty_images),
              **stats})
    if args.curriculum != "none":   # the prompts it passed over this step
        m["data/passed_over"], run.passed_over = ranks.Sum(run.passed_over), 0
    for name in args.reward_funcs:
        ok = [c.rewards[name] for c in comps if not c.failed[name]]
        m[f"reward/{name}"] = ranks.Mean(np.mean(ok) if ok else 0.0, len(ok))
        m[f"reward/{name}_failures"] = ranks.Sum(sum(c.failed[name] for c in comps))
    if args.tools:
        m.update(tool_metrics(comps))
    if "judge" in args.reward_funcs:
        m.update(judge_metrics())
    sources = [g.sample["columns"].get("source") for g in groups]   # a data row's "source" field, if it has one
    for name in set(sources) - {None}:   # the mean reward of each data source, over every rank's rows
        vals = [c.total for g, src in zip(groups, sources) if src == name for c in g.completions if c.scored]
        m[f"reward/source/{name}"] = ranks.Mean(np.mean(vals) if vals else 0.0, len(vals))
    ranks.reduce_metrics(m, run.device)
    logs.write_metrics(run, m, step)
    logs.log_completions(run, groups, step)


def after_step(run, step, m):
    """The hook after each step's log: m, reduced over ranks, is the same on every rank, and a controller's state goes
    in run.state (checkpointed). --kl_target: Ziegler et al. 2019's adaptive beta (arXiv 1909.08593)."""
    args = run.args
    if args.kl_target:   # n: the step's completions over all ranks, the samples TRL's AdaptiveKLController counts
        error = min(max(m["train/kl"] / args.kl_target - 1, -0.2), 0.2)
        n = args.rollout_batch_size * args.num_generations
        run.state["beta"] = learner.kl_beta(run) * (1 + error * n / args.kl_horizon)


def step_line(m):
    """Rank 0's progress bar: reward, KL, memory, and --tools' tool errors, so that a broken tool is seen."""
    tools = f" tool_errors={m['tools/tool_error_frac']:.0%}" if m.get("tools/tool_error_frac") else ""
    return f"reward={m.get('reward/mean', float('nan')):.3f} kl={m.get('train/kl', 0.0):.4f}{tools} {memory.summary(m)}"


def validate(run, step, m):
    """Greedy decoding of every rank's validation share, scored as in training -> the metrics, reduced and logged.
    Every rank takes part, with or without samples: the sync is a collective."""
    args = run.args
    sync(run, m)
    if args.tools:   # the same loop as training's, greedy
        comps = [g.completions[0] for g in trajectories(run, run.val_samples, step, greedy=True)]
    else:
        sp = rollout.sampling_params(dataclasses.replace(run.sampling, temperature=0.0), n=1,
                                     max_tokens=args.max_completion_length)
        outs = run_vllm(run, run.val_samples, [sp] * len(run.val_samples))
        comps = [Completion(index=0, token_ids=list(o.outputs[0].token_ids), sampler_logps=[], text=o.outputs[0].text,
                            finish_reason=o.outputs[0].finish_reason) for o in outs]
    sleep(run, m)
    texts = [c.text for c in comps]
    total, scores, failed = reward.compute_rewards(args.reward_funcs, args.reward_weights, texts,
                                                   reward_inputs(run, run.val_samples, comps))
    # no placeholder 0; a reward that asks for --reward_model is unscored here (no log-probs) and left out of the total
    counted = [f for k, f in failed.items() if not reward.asks_for_model(k)]
    scored = [t for i, t in enumerate(total) if not any(f[i] for f in counted)]
    m = {"val/reward": ranks.Mean(np.mean(scored) if scored else 0.0, len(scored))}
    for k in args.reward_funcs:
        ok = [v for v, f in zip(scores[k], failed[k]) if not f]
        m[f"val/{k}"] = ranks.Mean(np.mean(ok) if ok else 0.0, len(ok))
    ranks.reduce_metrics(m, run.device)
    if run.master:
        print(f"[val] step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in m.items()))
        for i, (s, c, r) in enumerate(list(zip(run.val_samples, comps, total))[:args.log_completions]):
            calls = "".join(f" [call {t!r}: {e or 'ok'}]" for t, e, _ in c.calls)   # --tools: each call and how it went
            unscored = [k for k in args.reward_funcs if failed[k][i]]
            print(f"    {s['where']}:{calls} {c.text!r} -> " + (f"unscored ({', '.join(unscored)} failed)" if unscored
                                                                   else f"{r:.2f}"))
    logs.write_metrics(run, m, step)
    return m


def save(run, step):
    checkpoint.save_checkpoint(run.engine, run.args, step, run.stream, run.wandb.id, run.rank, run.moving_reference,
                               state=run.state, updates=run.updates)


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


# ----------------------------------------------------------------------------- opt-in features, one flag each
# The temperature schedule (--temperature_end)
def temperature_at(args, step):
    """Linear from --temperature at step 1 to --temperature_end at --max_steps."""
    if args.temperature_end is None:
        return args.temperature
    return args.temperature + (args.temperature_end - args.temperature) * (step - 1) / max(1, args.max_steps - 1)


# The pass-rate curriculum (--curriculum pass_rate)
PASS = 1.0   # a completion passes when its total reward reaches this (accuracy's score of a right answer)


def pass_rate_prompts(run, step):
    """run.per_rank prompts; three in four with a pass rate of 0 or 1 so far are passed over, at most 3 x
    run.per_rank a call."""
    counts, out, passed_over = run.state.get("pass_rate", {}), [], 0
    while len(out) < run.per_rank:
        s = run.stream.next(1)[0]
        passed, tries = counts.get(s["id"], (0, 0))
        # which three in four: a hash of the seed, step and id, the same after a resume
        settled = tries and passed in (0, tries) and zlib.crc32(f"{run.args.seed} {step} {s['id']}".encode()) % 4
        if settled and passed_over < 3 * run.per_rank:
            passed_over += 1
        else:
            out.append(s)
    run.passed_over += passed_over
    return out


# Tools (--tools)
def trajectories(run, samples, step, round=0, greedy=False):
    """num_generations multi-turn trajectories per sample (toolbox.rollout), or one greedy one -> a Group each."""
    args = run.args
    sampling = dataclasses.replace(run.sampling, temperature=0.0) if greedy else run.sampling

    def generate(requests, keys, budgets, stops, counts):   # n > 1: vLLM seeds the k-th of them with seed + k
        sps = [rollout.sampling_params(sampling, n=n, max_tokens=b, logprobs=0, stop_token_ids=stop,
                                       seed=hash((args.seed, step, run.rank, round) + key) % 2 ** 31)
               for key, b, stop, n in zip(keys, budgets, stops, counts)]
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


def tool_metrics(comps):
    """Calls per trajectory, the shares that failed (any way, the model's bad calls, the tools' errors), and the
    most turns a trajectory took."""
    calls = [(e, kind) for c in comps for _, e, kind in c.calls]
    turns = max(1 + len(c.calls) for c in comps)   # on the rank that needed fewest too: all ran turns_max
    shares = {"failure_frac": [e is not None for e, _ in calls],
              "bad_call_frac": [kind == toolbox.BAD_CALL for _, kind in calls],
              "tool_error_frac": [kind == toolbox.TOOL_ERROR for _, kind in calls]}
    return {"tools/calls_mean": ranks.Mean(len(calls) / len(comps), len(comps)),
            **{f"tools/{k}": ranks.Mean(np.mean(v) if v else 0.0, len(v)) for k, v in shares.items()},
            "tools/turns_max": ranks.Max(turns), "tools/turns_min": ranks.Min(turns)}


# The judge (--reward_funcs judge)
def ask_judge(run, groups):
    """Send the judge's requests now, so that it answers while the trainer works; score() collects them."""
    if "judge" in run.args.reward_funcs:
        comps = [c for g in groups for c in g.completions]
        cols = reward_inputs(run, [g.sample for g in groups for _ in g.completions], comps)
        judge.send([c.text for c in comps], [{k: v[i] for k, v in cols.items()} for i in range(len(comps))])


def judge_metrics():
    """Its unique requests, the slowest, the step's wait, failures by reason."""
    st = judge.STATS
    return {"judge/requests": ranks.Sum(st.get("requests", 0)),
            "judge/latency_s": ranks.Max(st.get("latency_s", 0.0)), "judge/wait_s": ranks.Max(st.get("wait_s", 0.0)),
            **{f"judge/{k}": ranks.Sum(v) for k, v in st.items() if k.startswith("failed_")}}


def judge_gave_up(run, step, m, last=False):
    """The message to stop with after --judge_max_failed_steps steps in a row without a score, or a last step
    without one (no final model is exported from it), else None."""
    if "judge" not in run.args.reward_funcs:
        return None
    failed = sum(v for k, v in m.items() if k.startswith("judge/failed_"))
    run.judge_silent = run.judge_silent + 1 if m.get("judge/requests", 0) and failed >= m["judge/requests"] else 0
    if run.judge_silent < (1 if last else run.args.judge_max_failed_steps):
        return None
    reasons = ", ".join(k[len("judge/failed_"):] for k in m if k.startswith("judge/failed_"))
    if last and run.judge_silent < run.args.judge_max_failed_steps:
        return (f"error: the judge at {run.args.judge_url} gave no score in the last {run.judge_silent} step(s) "
                f"({reasons}); checkpoint-{step} is written and no final model is exported. Check the server "
                f"(and --judge_model, --judge_api_key_env)")
    return (f"error: the judge at {run.args.judge_url} gave no score in {run.judge_silent} steps in a row ({reasons}); "
            f"checkpoint-{step} is written. Check the server (and --judge_model, --judge_api_key_env), then relaunch: "
            f"the run resumes")


# Rewards that score spans (--advantage_estimator process)
def reward_events(run, c):
    """-> [(token index, weighted score)]: one per scored span, at the token that ends it, else one at the last."""
    args, last = run.args, len(c.token_ids) - 1
    out = []
    for name, w in zip(args.reward_funcs, reward.weights_of(args.reward_funcs, args.reward_weights)):
        if name in c.spans:
            out += [(token_of(run.processor.tokenizer, c.token_ids, end), w * s) for _, end, s in c.spans[name]]
        else:
            out.append((last, w * c.rewards[name]))
    return out


def token_of(tokenizer, ids, end):
    """The index of the first token whose decoded prefix reaches `end` characters (a split character's U+FFFD not
    counted)."""
    lo, hi = 0, max(len(ids) - 1, 0)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid + 1], skip_special_tokens=True).rstrip("\ufffd")) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


if __name__ == "__main__":
    job.run_then_exit(main)
