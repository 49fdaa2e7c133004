"""GRPO for vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5) with DeepSpeed ZeRO-3 and a colocated vLLM.

Every rank holds a ZeRO-3 shard of the policy and its own in-process vLLM engine. `main()` is a
short loop over the step's named phases; each phase is a function below that a test can call
with small fakes (tests/test_step.py). One step, every rank:

    select_prompts (hook) -> sync (+ offload) -> rollout -> score -> filter_groups (hook) -> sleep (+ reload)
    -> advantages -> micro_batches -> old_ref_logps -> update -> log -> validate -> checkpoint

Per prompt, one `Group` record (sample, completions, sampler log-probs, texts, rewards per
function, failure flags, advantages) flows through the phases; `Run` holds what the run owns.

    deepspeed train.py --num_generations 7                        # embedded tiny model + task
    deepspeed --num_gpus 8 train.py --model Qwen/Qwen2.5-VL-7B-Instruct \
        --train_data data/train.jsonl --val_data data/val.jsonl --bf16 --num_generations 7

Flags: flags.py. The model and its DeepSpeed config: model.py. Reductions over ranks and the
checked invariants: ranks.py. Data and images: data.py. The math: grpo.py. vLLM and the weight
sync: rollout.py. Memory: memory.py, and the plan before launch: planner.py (`--plan`).
Checkpoints, resume, kills, preemption: checkpoint.py. metrics.jsonl, wandb and the plot: logs.py.
Left out on purpose: a trainer class, callbacks, a vLLM server mode, video.
"""
import argparse
import atexit
import dataclasses
import itertools
import os
import random
import sys
import time
import warnings

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))  # this venv's own JIT ops
import numpy as np
import torch
import torch.distributed as dist

# DeepSpeed 0.19.8 calls torch.distributed.all_gather_into_tensor, deprecated in torch 2.13: one warning per gather
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

import checkpoint  # noqa: E402
import data
import grpo
import logs
import memory
import model
import planner
import ranks
import reward
import rollout
from flags import check_args, grad_accumulation_steps, inert_flags, micro_batch, parse_args  # noqa: F401  (train.parse_args)


# ----------------------------------------------------------------------------- records
@dataclasses.dataclass
class Group:
    """One prompt and its num_generations completions, as it flows through the step's phases."""
    sample: dict                     # data.prepare(): images, vllm_ids, hf, columns, where
    token_ids: list                  # (G,) completion token ids, a list each
    sampler_logps: list              # (G,) vLLM's log-prob of each sampled token, a list each
    texts: list                      # (G,) decoded completions
    finish_reasons: list             # (G,) "stop" or "length"
    rewards: dict = dataclasses.field(default_factory=dict)   # {reward function: (G,) scores}
    failed: dict = dataclasses.field(default_factory=dict)    # {reward function: (G,) bools}
    total: list = None               # (G,) weighted sum of rewards
    advantages: list = None          # (G,)


@dataclasses.dataclass
class Run:
    """What the run holds, built by setup(); every phase takes it first."""
    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    gas: int                         # micro-batches per step (gradient accumulation steps)
    engine: object                   # DeepSpeed engine of the policy
    ref_engine: object               # DeepSpeed engine of the reference model, or None (beta == 0, or LoRA)
    llm: object                      # this rank's vLLM engine
    processor: object
    stream: object                   # data.PromptStream: this rank's prompts
    val_samples: list                # this rank's share of the validation set, prepared (None: no validation)
    tp_group: object = None          # this rank's vLLM tensor-parallel group (None: tp 1)
    banned: list = dataclasses.field(default_factory=list)   # token ids kept out of completions (logit_bias -inf)
    pad_id: int = 0
    tied: bool = False               # lm_head shares the embedding: not synced twice
    lora_request: object = None      # --lora_sync adapter: the adapter version vLLM generates with
    offload: list = dataclasses.field(default_factory=list)   # DeepSpeed offload_states types during rollout
    wandb: object = None
    metrics_path: str = None
    start: int = 0                   # last finished step (resume)
    updates: int = 0                 # update phases run by this process
    synced_at: int = None            # `updates` when vLLM last got the weights (None: never)
    hf_ds_config: object = None      # transformers' HfDeepSpeedConfig of the trainer, kept alive
    wandb_failed: bool = False       # wandb stopped taking logs (metrics.jsonl still has them)

    @property
    def master(self):
        return self.rank == 0

    @property
    def per_rank(self):
        return self.args.rollout_batch_size // self.world


def completion_logps(engine, batch, run, top_p=1.0, with_entropy=False):
    """Per-token statistics of one micro-batch's completions (policy or reference engine), from one
    pass over the vocabulary -> grpo.TokenStats: logps (B, C); with top_p < 1 the log-mass of the
    nucleus each token was drawn from; with `with_entropy` the entropy of the sampled distribution."""
    return engine(**{k: v.to(run.device) for k, v in batch["inputs"].items()}, temperature=run.args.temperature,
                  chunks=batch["chunks"], top_p=top_p, with_entropy=with_entropy,
                  banned=torch.tensor(run.banned, dtype=torch.long, device=run.device))


def run_vllm(run, samples, sps):
    """Generate for this rank's samples (via the whole TP group), return this rank's outputs."""
    tp = run.args.vllm_tensor_parallel_size
    requests = [{"prompt_token_ids": s["vllm_ids"], **({"multi_modal_data": {"image": s["images"]}} if s["images"] else {})}
                for s in samples]
    reqs, offset = ranks.tp_gather(requests, run.tp_group, tp)
    params, _ = ranks.tp_gather(sps, run.tp_group, tp)
    if tp > 1:   # vLLM would mix up outputs (or hang) if the group's ranks submitted different requests
        sizes = lambda r: [im.size for im in r.get("multi_modal_data", {}).get("image", [])]  # noqa: E731
        ranks.check_same("the vLLM requests (prompt ids, image sizes, sampling params)",
                         [ranks.digest([(r["prompt_token_ids"], sizes(r)) for r in reqs] + [repr(sp) for sp in params])],
                         run.device, run.tp_group)
    outs = rollout.generate(run.llm, reqs, params, run.lora_request)
    return outs[offset:offset + len(samples)]


# ----------------------------------------------------------------------------- set-up
def setup(args):
    """Distributed init, preflight, model + reference under ZeRO-3, vLLM, data, resume, wandb -> Run."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from transformers import AutoConfig, AutoProcessor
    from transformers.integrations import HfDeepSpeedConfig

    if args.model is None:   # before torch.distributed exists: transformers saves on rank 0 only once it does
        import tiny
        args.model, train_default, val_default = tiny.ensure_default(task=args.tiny_task, size=args.tiny_size,
                                                                     arch=args.tiny_arch)
        args.train_data, args.val_data = args.train_data or train_default, args.val_data or val_default
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"[setup] embedded default: tiny {args.tiny_arch} at {args.model}, {args.tiny_task} task {args.train_data}")
    if torch.cuda.is_available():   # before any CUDA allocation: one GPU per rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # torch.distributed first, DeepSpeed's communication (which JIT-loads an op under a lock) next:
    # in between, one rank per node clears a lock a killed launch left behind, while the others wait
    backend = get_accelerator().communication_backend_name()
    dist.init_process_group(backend=backend)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        checkpoint.clear_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"])
        checkpoint.clear_stale_shm_buffers()
    refusal = [None]
    if dist.get_rank() == 0:   # one live job per output folder, before anything is written there
        os.makedirs(args.output_dir, exist_ok=True)
        refusal = [checkpoint.claim_output_dir(args.output_dir)]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        sys.exit(refusal[0])
    if dist.get_rank() == 0:
        checkpoint.heartbeat(args.output_dir)
    dist.barrier()
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world)))   # ranks on this node
    atexit.register(checkpoint.remove_shm_buffer, rank)   # DeepSpeed's /dev/shm buffer, ~70 MB, never removed otherwise
    device = torch.device(get_accelerator().device_name(), int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    check_args(args, world)
    if rank == 0:
        for note in inert_flags(args):
            print(f"[flags] note: {note}", flush=True)
    if args.memory == "auto":   # rank 0 picks the levers (one node's free RAM); every rank runs them, or refuses alike
        chosen = [None]
        if rank == 0:
            try:
                chosen = [planner.decide(args, this_cluster(local_world, world))]
            except SystemExit as refusal:   # nothing fits: the table, on every rank
                chosen = [str(refusal)]
        dist.broadcast_object_list(chosen, src=0)
        if isinstance(chosen[0], str):
            sys.exit(chosen[0])
        args = chosen[0]
    args.per_device_train_batch_size = micro_batch(args, world)   # a named derived value, logged with the flags
    gas = grad_accumulation_steps(args, world)
    if args.train_data is None:
        sys.exit("error: --train_data is required with --model")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model)   # its family (model.FAMILIES) decides the CPU dtype
    bf16 = model.use_bf16(args, config)
    if args.shared_prefix and (why := model.shared_prefix_unsupported(config, args.attn_implementation)):
        args.shared_prefix = False   # said once; the standard path gives the same loss
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"[setup] --shared_prefix falls back to one sequence per completion: {why}")
    dtype = torch.bfloat16 if bf16 else torch.float32
    os.makedirs(args.output_dir, exist_ok=True)
    processor = AutoProcessor.from_pretrained(args.model)
    args.min_pixels, args.max_pixels = data.pixel_bounds(args, processor)   # the model's grid and bounds by default

    # ---- the memory plan, before anything is loaded: a run that would run out is refused here
    cfg = model.ds_config(args, gas, world, bf16)
    report = planner.preflight(args, this_cluster(local_world, world), allow=args.skip_memory_preflight)
    if rank == 0:
        print(report)

    # ---- vLLM first, one engine per rank (or per TP group), asleep (--sleep_level 1|2) before the trainer's
    # states reach the GPU: its pool and theirs then never meet at load (the plan's vllm_start and load phases)
    tp = args.vllm_tensor_parallel_size
    tp_group = None
    if tp > 1:
        tp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])
    per_rank = args.rollout_batch_size // world
    threads = rollout.torch_threads_share(local_world)
    llm = rollout.create_engine(args.model, args, "bfloat16" if bf16 else "float32",
                                max_num_seqs=max(per_rank * args.num_generations * tp, 16), rank=rank // tp)
    threads = rollout.restore_threads(threads)
    if rank == 0:   # the kernels torch dispatches follow the CPU's ISA: runs compare bitwise only on the same (docs/demos.md)
        print(f"[setup] torch threads per rank after the vLLM engine started: {threads}; CPU kernels: "
              f"{torch.backends.cpu.get_cpu_capability()}")
    if args.sleep_level > 0:
        rollout.sleep(llm, args.sleep_level, args.gc_collect_after_offload)

    # ---- model, reference, optimizer under ZeRO-3
    model.check_fused_adam(cfg)
    dschf = HfDeepSpeedConfig(cfg)   # while alive (kept in Run), from_pretrained loads partitioned
    policy = model.load_model(args.model, args, dtype)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = model.trainable(policy, args)   # LoRA (--use_peft), frozen vision tower / projector
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=[p for p in policy.parameters() if p.requires_grad],
                                      config=cfg, lr_scheduler=model.lr_schedule(args))
    ref_engine = model.load_reference(args, dtype, model.reference_config(cfg, args.ref_offload)) \
        if args.beta > 0 and not args.use_peft else None   # LoRA: the reference is the policy with its adapter off
    banned = rollout.checkpoint_banned_ids(args.model, processor.tokenizer)

    # ---- data
    stream = data.PromptStream(data.Rows(args.train_data, args.columns, args.image_root), processor, args, rank, world)
    val_samples = data.validation_samples(args, processor, rank, world) if args.val_data else None

    # ---- the trainer states that leave the GPU while vLLM generates
    if (args.offload_optimizer or args.offload_model) and not torch.cuda.is_available():
        if rank == 0:
            print("[memory] --offload_optimizer/--offload_model: no-ops on CPU, where the trainer states live in host RAM")
        args.offload_optimizer = args.offload_model = False
    offload = ([OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads,
                OffloadStateTypeEnum.contiguous_grad_buffer] if args.offload_optimizer else []) + \
        ([OffloadStateTypeEnum.lp_params] if args.offload_model else [])

    run = Run(args=args, rank=rank, world=world, device=device, gas=gas, engine=engine, ref_engine=ref_engine, llm=llm,
              processor=processor, stream=stream, val_samples=val_samples, tp_group=tp_group, banned=banned,
              pad_id=processor.tokenizer.pad_token_id or 0,
              tied=policy.lm_head.weight is policy.get_input_embeddings().weight, offload=offload, hf_ds_config=dschf)

    # ---- resume: weights, optimizer, scheduler, step, data position, RNG
    ckpt, run.start = checkpoint.resume(engine, stream, args, rank)

    # ---- logging: metrics.jsonl and wandb, continued from the checkpoint
    logs.open_logs(run, resumed=bool(ckpt))
    if run.master:
        print(f"[setup] {world} ranks, {per_rank} prompts x {args.num_generations} generations per rank, "
              f"{gas} micro-batches of {args.per_device_train_batch_size}; metrics -> {run.metrics_path}")
    checkpoint.install_preemption_handler(rank)
    return run


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
    from vllm import SamplingParams
    args = run.args
    sps = [SamplingParams(n=args.num_generations, temperature=args.temperature, top_p=args.top_p,
                          max_tokens=args.max_completion_length, logprobs=0, logit_bias=rollout.logit_bias(run.banned),
                          seed=hash((args.seed, step, run.rank, i) + ((round,) if round else ())) % 2 ** 31)
           for i in range(len(samples))]
    groups = []
    for s, out in zip(samples, run_vllm(run, samples, sps)):
        comps = out.outputs
        groups.append(Group(sample=s, token_ids=[list(c.token_ids) for c in comps],
                            sampler_logps=[[next(iter(d.values())).logprob for d in c.logprobs] for c in comps],
                            texts=run.processor.tokenizer.batch_decode([list(c.token_ids) for c in comps],
                                                                       skip_special_tokens=True),
                            finish_reasons=[c.finish_reason for c in comps]))
    if not all(np.isfinite(lp).all() for g in groups for lp in g.sampler_logps):
        raise RuntimeError("vLLM returned non-finite logprobs after the weight sync: the synced weights are broken")
    return groups


def select_prompts(run, step):
    """The hook before the rollout: this rank's prompts for the step, run.per_rank of them on every
    rank. A curriculum goes here: run.stream.history maps a sample's id (sample["id"], its row in
    the data) to its group's rewards the last time it was rolled out, on any rank. Skipping the
    prompts the policy already solves, for example (README, "A paper change in one place"):

        out = []
        while len(out) < run.per_rank:
            s = run.stream.next(1)[0]
            if min(run.stream.history.get(s["id"], [0.0])) < 1.0:
                out.append(s)
        return out
    """
    return run.stream.next(run.per_rank)


def score(run, groups):
    """Rewards per completion, per function, with failure flags, into each group; every rank's
    groups' rewards into run.stream.history (a collective: all ranks score together)."""
    args = run.args
    texts = [t for g in groups for t in g.texts]
    cols = data.reward_columns([g.sample for g in groups for _ in g.texts])
    cols.update(completion_length=[len(c) for g in groups for c in g.token_ids],
                max_completion_length=[args.max_completion_length] * len(texts))
    total, scores, failed = reward.compute_rewards(args.reward_funcs, args.reward_weights, texts, cols)
    for i, g in enumerate(groups):
        at = slice(i * len(g.texts), (i + 1) * len(g.texts))
        g.total = total[at]
        g.rewards = {n: v[at] for n, v in scores.items()}
        g.failed = {n: v[at] for n, v in failed.items()}
    everyone = [None] * run.world
    dist.all_gather_object(everyone, [(g.sample.get("id"), list(g.total)) for g in groups])
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
    spread = lambda g: max(g.total) > min(g.total)   # noqa: E731
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


def advantages(run, groups):
    """Group-relative advantages (GRPO) into each group. --scale_rewards batch divides by the std of
    the whole batch, every rank's rewards (all ranks hold as many)."""
    rewards = torch.tensor([r for g in groups for r in g.total], dtype=torch.float32)     # (N,)
    batch_std = None
    if run.args.scale_rewards == "batch":
        everyone = [torch.zeros_like(rewards, device=run.device) for _ in range(run.world)]
        dist.all_gather(everyone, rewards.to(run.device))
        batch_std = torch.cat(everyone).std().cpu()                                        # over (world x N,)
    adv, zero_spread = grpo.group_advantages(rewards, run.args.num_generations, run.args.scale_rewards, batch_std)
    for i, g in enumerate(groups):
        g.advantages = adv[i * len(g.total):(i + 1) * len(g.total)].tolist()
    return zero_spread


def micro_batches(run, groups):
    """The rollout batch as micro-batches of per_device_train_batch_size sequences (or, with
    --micro_batch_tokens, as many as fit the budget), sorted by length so that similar lengths share
    one, each padded to its own longest prompt and completion (not the step's: one long answer no
    longer widens every micro-batch); with --shared_prefix, groups sorted by length, each group (or its
    part in a micro-batch) one row with its prompt once (data.collate_prefix). Under ZeRO-3 every rank must make the same number of forward
    and lm_head calls (each gathers parameters): a rank with fewer budget micro-batches splits its
    largest, the count is checked here, before it could hang, and each micro-batch takes the most
    log-prob chunks any rank needs for its position (grpo.token_logps splits fewer tokens as many times)."""
    args = run.args
    seqs = [(g.sample, ids, lp, a, i) for i, g in enumerate(groups) for ids, lp, a in zip(g.token_ids, g.sampler_logps, g.advantages)]
    size = lambda s: s[0]["hf"]["input_ids"].shape[1] + max(len(s[1]), 1)   # noqa: E731  (tokens, padded alone)
    if args.shared_prefix:   # a group's completions stay together, one row (data.collate_prefix); longer rows last
        rows = [g.sample["hf"]["input_ids"].shape[1] + sum(map(len, g.token_ids)) for g in groups]
        seqs.sort(key=lambda s: rows[s[4]])
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
    batches = []
    for part in parts:
        if args.shared_prefix:   # each group (or the part of it in this micro-batch) one row: its prompt once
            rows_ = [list(r) for _, r in itertools.groupby(part, key=lambda s: s[4])]
            inputs = data.collate_prefix([(r[0][0], [s[1] for s in r]) for r in rows_], run.pad_id, run.banned)
        else:
            inputs = data.collate([s[0] for s in part], [s[1] for s in part], run.pad_id, run.banned)
        sampler = torch.zeros(inputs["completion_mask"].shape)                               # (B, C)
        for j, s in enumerate(part):   # right-aligned, as data.collate lays out each completion
            sampler[j, sampler.shape[1] - len(s[2]):] = torch.tensor(s[2])
        batches.append(dict(inputs=inputs, advantages=torch.tensor([s[3] for s in part], dtype=torch.float32),  # (B,)
                            sampler_logps=sampler, old_logps=None, ref_logps=None))
    ranks.check_same("micro-batches per step", [len(batches)], run.device)
    chunks = torch.tensor([-(-b["inputs"]["completion_mask"].numel() // args.logprob_chunk_tokens) for b in batches],
                          device=run.device)
    dist.all_reduce(chunks, op=dist.ReduceOp.MAX)
    for b, n in zip(batches, chunks.tolist()):
        b["chunks"] = n
    return batches


def old_ref_logps(run, batches):
    """Log-probs before the update (num_iterations > 1) and of the reference model (beta > 0), no grad."""
    with torch.no_grad():
        for b in batches:
            if run.args.num_iterations > 1:
                b["old_logps"] = completion_logps(run.engine, b, run).logps
            if run.ref_engine is not None:
                b["ref_logps"] = completion_logps(run.ref_engine, b, run).logps
            elif run.args.beta > 0:   # LoRA: the base model is the policy with its adapter off
                with model.adapter_off(run.engine):
                    b["ref_logps"] = completion_logps(run.engine, b, run).logps


def update(run, batches, m):
    """num_iterations optimizer steps over the rollout batch, micro-batch by micro-batch. -> stats,
    each a weighted mean over the whole rollout batch and all ranks (the same number at any
    micro-batch size or rank count), except loss (the objective DeepSpeed differentiates) and lr.
    Every per-token mean grpo_loss reports is logged as train/<name>, token-weighted (a new one is
    one line in grpo_loss's metrics)."""
    args, engine = run.args, run.engine
    n_tokens = torch.tensor(sum(b["inputs"]["completion_mask"].sum().item() for b in batches), device=run.device)
    dist.all_reduce(n_tokens)
    # Per micro-batch normaliser: DeepSpeed divides each micro-batch loss by gas and averages ranks,
    # so the sum over micro-batches is the whole batch's objective.
    sequences = args.rollout_batch_size * args.num_generations
    norm = {"token": n_tokens.item(), "sequence": sequences, "dr_grpo": sequences * args.max_completion_length}[args.loss_agg]
    norm = norm / (run.world * run.gas)   # gas: DeepSpeed's constant divisor, however many micro-batches there are
    engine.train()
    loss_sum, lrs = 0.0, []
    sums, weights = {}, {}   # {logged name: sum of value x weight}, {logged name: sum of weights}

    def add(name, value, weight):
        sums[name], weights[name] = sums.get(name, 0.0) + value * weight, weights.get(name, 0.0) + weight
    for it in range(args.num_iterations):
        for j, b in enumerate(batches):
            ts = completion_logps(engine, b, run, args.top_p if it == 0 else 1.0, with_entropy=True)   # (B, C) each
            cmask = b["inputs"]["completion_mask"].to(run.device)                  # (B, C)
            if it == 0:   # same weights as the sampler: the sampled distribution should agree (~0)
                attn = b["inputs"]["attention_mask"]
                add("update/padded_frac", 1 - attn.sum().item() / attn.numel(), attn.numel())   # of the tokens processed
                old = b["old_logps"] if b["old_logps"] is not None else ts.logps.detach()   # pi_old, (B, C)
                sampler = b["sampler_logps"].to(run.device)                                  # (B, C)
                diff = (old - (ts.log_nucleus if ts.log_nucleus is not None else 0) - sampler).abs() * cmask
                m["rollout/logp_diff_max"] = ranks.Max(max(m.get("rollout/logp_diff_max", 0.0), diff.max().item()))
                add("rollout/logp_diff_mean", diff.sum().item() / max(cmask.sum().item(), 1), cmask.sum().item())
                b["is_weights"], im = grpo.sampler_correction(old, sampler, cmask, args.vllm_importance_sampling_correction,
                                                              args.vllm_importance_sampling_cap)
                if im:
                    m["sampling/is_ratio_min"] = ranks.Min(min(m.get("sampling/is_ratio_min", im["is_ratio_min"]), im["is_ratio_min"]))
                    m["sampling/is_ratio_max"] = ranks.Max(max(m.get("sampling/is_ratio_max", im["is_ratio_max"]), im["is_ratio_max"]))
                    add("sampling/is_ratio_mean", im["is_ratio_mean"], im["is_count"])
                    add("sampling/is_capped_frac", im["is_capped_frac"], im["is_count"])
            loss, lm = grpo.grpo_loss(
                logps=ts.logps, old_logps=b["old_logps"] if b["old_logps"] is not None else ts.logps.detach(),
                advantages=b["advantages"].to(run.device), mask=cmask, epsilon=args.epsilon,
                epsilon_high=args.epsilon_high, beta=args.beta, ref_logps=b["ref_logps"], loss_agg=args.loss_agg,
                norm=norm, importance_sampling_level=args.importance_sampling_level, is_weights=b["is_weights"],
                entropy=ts.entropy, entropy_coef=args.entropy_coef)
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
    names = sorted(sums)   # the same on every rank: which metrics exist follows from the flags
    totals = torch.tensor([sums[k] for k in names] + [weights[k] for k in names], dtype=torch.float64, device=run.device)
    dist.all_reduce(totals)
    tot = totals.tolist()
    stats = {k: tot[i] / tot[len(names) + i] if tot[len(names) + i] else 0.0 for i, k in enumerate(names)}
    stats.update({"train/loss": loss_sum, "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                  "train/lr": lrs[-1]})
    return stats


def log_step(run, step, m, groups, stats, zero_spread):
    """Everything the step measured, all-reduced over ranks; rank 0 writes metrics.jsonl and wandb."""
    args = run.args
    rewards = np.array([r for g in groups for r in g.total])
    lengths = [len(ids) for g in groups for ids in g.token_ids]
    m.update({"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(ddof=1)) if rewards.size > 1 else 0.0,
              "reward/zero_spread_groups": zero_spread, "completion/length": float(np.mean(lengths)),
              "completion/truncated": float(np.mean([f == "length" for g in groups for f in g.finish_reasons])),
              "data/skipped": ranks.Sum(run.stream.skipped), "data/empty_images": ranks.Sum(run.stream.empty_images),
              **stats})
    for name in args.reward_funcs:
        m[f"reward/{name}"] = float(np.mean([v for g in groups for v in g.rewards[name]]))
        m[f"reward/{name}_failures"] = ranks.Sum(sum(f for g in groups for f in g.failed[name]))
    ranks.reduce_metrics(m, run.device)
    logs.write_metrics(run, m, step)
    logs.log_completions(run, groups, step)


def validate(run, step, m):
    """Greedy decoding on every rank's share of the validation set; metrics all-reduced, logged.
    Every rank takes part (the sync is a collective), with or without samples of its own. The
    trainer states leave the GPU around it as around a rollout: it is no longer the run's peak."""
    from vllm import SamplingParams
    args = run.args
    sync(run, m)
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=args.max_completion_length, logit_bias=rollout.logit_bias(run.banned))
    outs = run_vllm(run, run.val_samples, [sp] * len(run.val_samples))
    sleep(run, m)
    texts = [o.outputs[0].text for o in outs]
    total, scores, _ = reward.compute_rewards(args.reward_funcs, args.reward_weights, texts,
                                              data.reward_columns(run.val_samples))
    sums = torch.tensor([sum(total), len(total)] + [sum(scores[n]) for n in args.reward_funcs],
                        dtype=torch.float64, device=run.device)
    dist.all_reduce(sums)
    n = max(sums[1].item(), 1)
    m = {"val/reward": sums[0].item() / n, **{f"val/{k}": sums[2 + i].item() / n for i, k in enumerate(args.reward_funcs)}}
    if run.master:
        print(f"[val] step {step}: " + " ".join(f"{k}={v:.3f}" for k, v in m.items()))
        for s, text, r in list(zip(run.val_samples, texts, total))[:args.log_completions]:
            print(f"    {s['where']}: {text!r} -> {r:.2f}")
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
        checkpoint.release_output_dir(run.args.output_dir)   # the next launch into it may start


# ----------------------------------------------------------------------------- main
def this_cluster(local_world, world):
    """The planner's view of this launch: ranks per node, nodes, this GPU's memory, this node's free RAM."""
    cuda = torch.cuda.is_available()
    return planner.Cluster(gpus_per_node=local_world, nodes=max(1, world // local_world), cuda=cuda,
                           gpu_gb=torch.cuda.get_device_properties(0).total_memory / memory.GB if cuda else 0.0,
                           host_gb=memory.psutil.virtual_memory().available / memory.GB)


def main(argv=None):
    from tqdm import tqdm
    args = parse_args(argv)
    if args.plan:   # `memory.py plan` for this launch, before anything starts
        if args.model is None:
            import tiny
            args.model = tiny.ensure_default(task=args.tiny_task, size=args.tiny_size, arch=args.tiny_arch)[0]
        world = int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_SIZE", world))
        check_args(args, world)
        cluster = this_cluster(local, world)
        if int(os.environ.get("RANK", 0)) == 0:
            if args.memory == "auto":
                args = planner.decide(args, cluster, verbose=True, exit_if_none=False)
            s = planner.model_shape(args.model)
            pl = planner.plan(args, cluster, s)
            print(planner.render(pl, cluster, planner.levers(args, cluster, s, pl)))
        return
    run = setup(args)
    if run.val_samples is not None and (args.val_only or args.val_before_train and run.start == 0):
        validate(run, run.start, {})
    bar = tqdm(range(run.start + 1, args.max_steps + 1) if not args.val_only else [], disable=not run.master,
               desc="grpo", dynamic_ncols=True, initial=run.start, total=args.max_steps)
    m, carry = {}, {}   # validation and checkpoint run after the step's row is written: they go in the next row
    try:
        for step in bar:
            m, carry = carry, {}
            t_step = time.perf_counter()
            with memory.phase("data", m):
                samples = select_prompts(run, step)             # the hook; images loaded and downscaled once, here
            sync(run, m)                                        # vLLM gets the new weights
            with memory.phase("rollout", m):
                groups = rollout_groups(run, samples, step)     # num_generations completions per prompt
            with memory.phase("reward", m):
                score(run, groups)
            groups = filter_groups(run, groups, step, m)        # the hook: dynamic sampling, curricula
            sleep(run, m)                                       # vLLM frees the GPU for training
            zero_spread = advantages(run, groups)
            batches = micro_batches(run, groups)
            with memory.phase("old_ref_logps", m):
                old_ref_logps(run, batches)
            with memory.phase("update", m):
                stats = update(run, batches, m)
            run.updates += 1
            m["time/step"] = ranks.Max(time.perf_counter() - t_step)
            log_step(run, step, m, groups, stats, zero_spread)
            if run.master:
                bar.set_postfix_str(f"reward={m['reward/mean']:.3f} kl={m['train/kl']:.4f} {memory.summary(m)}")
            if run.val_samples is not None and args.val_freq and (step % args.val_freq == 0 or step == args.max_steps):
                with memory.phase("validation", carry):
                    validate(run, step, {})
            saved = args.save_steps and step % args.save_steps == 0
            if saved:
                with memory.phase("checkpoint", carry):
                    save(run, step)
            if checkpoint.preemption_requested(run.device):   # SIGTERM/SIGUSR1 on any rank: all stop here
                if not saved:
                    save(run, step)
                finish(run, export=False)
                if run.master:
                    print(f"[preempt] checkpoint-{step} written; exit {checkpoint.PREEMPTED}; relaunch to resume")
                sys.exit(checkpoint.PREEMPTED)
    except BaseException as e:   # an OOM anywhere: say where and what to change, keep the checkpoints
        if memory.is_oom(e):
            sys.exit(memory.report_oom(e, table={**m, **carry}))
        raise
    if carry:   # the last step's validation and checkpoint phases: a row of their own, same step
        logs.write_metrics(run, ranks.reduce_metrics(carry, run.device), args.max_steps)
    finish(run)


if __name__ == "__main__":
    main()
