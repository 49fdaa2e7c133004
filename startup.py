"""One launch's set-up, phase by phase -> the `Run` record every phase of the step takes (train.py).

    setup: distributed (the output folder claimed) -> check_data (every row read, rank 0; the limits the data
           needs) -> settle_flags (checks, the checkpoint picked, --memory auto)
           -> model_settings -> preflight (the memory plan) -> start_vllm (asleep) -> load_models (policy,
           reference, optimizer under ZeRO-3) -> load_data -> Run -> resume -> logs, preemption handler

Each phase is a function of a few lines; a paper that needs another part at start-up (a second model, a judge)
adds a phase here and a field to Run. `--plan` (print_plan) stops before anything is loaded, `--check_data`
(check_data_alone) after the data check.
"""
import argparse
import dataclasses
import os
import random
import sys

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
from transformers import AutoConfig, AutoProcessor
from transformers.integrations import HfDeepSpeedConfig

import checkpoint
import data
import grpo
import job
import judge
import logs
import memory
import model
import planner
import ranks
import rollout
import tiny
import toolbox
from flags import check_args, grad_accumulation_steps, inert_flags, micro_batch


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
    sampling: grpo.Sampling = grpo.Sampling()   # the distribution vLLM samples from and the log-probs are of
    pad_id: int = 0
    tied: bool = False               # lm_head shares the embedding: not synced twice
    aux_loss_coef: float = None      # mixture-of-experts: the router's load-balancing loss in the loss (None: dense)
    lora_request: object = None      # --lora_sync adapter: the adapter version vLLM generates with
    offload: list = dataclasses.field(default_factory=list)   # DeepSpeed offload_states types during rollout
    wandb: object = None
    metrics_path: str = None
    start: int = 0                   # last finished step (resume)
    updates: int = 0                 # update phases run by this process
    synced_at: int = None            # `updates` when vLLM last got the weights (None: never)
    hf_ds_config: object = None      # transformers' HfDeepSpeedConfig of the trainer, kept alive
    ref_masters: list = None         # --ref_ema, a bf16 reference: fp32 copies of its partitions (reference_step)
    wandb_failed: bool = False       # wandb stopped taking logs (metrics.jsonl still has them)
    judge_silent: int = 0            # steps in a row in which the judge gave no score (train.judge_gave_up)
    teacher_engine: object = None    # --teacher_model: a frozen engine whose log-probs are a per-token advantage
    reward_engine: object = None     # --reward_model: a frozen engine that rewards may ask (reward.Scorer)
    passed_over: int = 0             # --curriculum: prompts passed over since the last log (data/passed_over)
    # a fork's own state, the same on every rank: JSON-able values and tensors, saved with each checkpoint and
    # resumed (--kl_target's beta, --curriculum's counts; docs/resilience.md)
    state: dict = dataclasses.field(default_factory=dict)

    @property
    def master(self):
        return self.rank == 0

    @property
    def per_rank(self):
        return self.args.rollout_batch_size // self.world

    @property
    def moving_reference(self):
        """(reference engine, fp32 masters or None) when --ref_ema or --ref_reset_steps moves the reference, else
        None: a moved reference is saved and resumed with each checkpoint."""
        return (self.ref_engine, self.ref_masters) if self.args.ref_ema or self.args.ref_reset_steps else None


def sampling_of(args, banned):
    """The sampled distribution's record (grpo.Sampling), from the flags and the checkpoint's banned ids."""
    return grpo.Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, banned=tuple(banned))


def setup(args):
    """Distributed init, preflight, model + reference under ZeRO-3, vLLM, data, resume, wandb -> Run."""
    rank, world, local_world, device = distributed(args)
    check_data(args, rank)
    args, gas, resume_from = settle_flags(args, rank, world, local_world)
    config, bf16, aux_loss_coef = model_settings(args, rank)
    dtype = torch.float32 if not bf16 else torch.bfloat16
    os.makedirs(args.output_dir, exist_ok=True)
    processor = AutoProcessor.from_pretrained(args.model)
    args.min_pixels, args.max_pixels = data.pixel_bounds(args, processor)   # the model's grid and bounds by default
    if rank == 0 and args.tools:   # the image limit, what the tools' images may take, the time a call gets
        print(toolbox.started_line(args, args.rollout_batch_size // world * args.num_generations), flush=True)
    cfg = model.ds_config(args, gas, world, bf16)
    report = planner.preflight(args, this_cluster(local_world, world), allow=args.skip_memory_preflight)
    if rank == 0:   # a run that would run out is refused above, before anything is loaded
        print(report)
    llm, tp_group = start_vllm(args, rank, world, local_world, bf16)
    engine, ref_engine, dschf = load_models(args, cfg, dtype)
    teacher_engine, reward_engine = (load_frozen(path, flag, args, processor, cfg, dtype) for path, flag in
                                     ((args.teacher_model, "--teacher_model"), (args.reward_model, "--reward_model")))
    # kept out of completions (logit_bias -inf)
    banned = rollout.checkpoint_banned_ids(args.model, processor.tokenizer)
    stream, val_samples = load_data(args, processor, rank, world, model.family(config)["norm_bbox"])
    policy = engine.module
    run = Run(args=args, rank=rank, world=world, device=device, gas=gas, engine=engine, ref_engine=ref_engine, llm=llm,
              processor=processor, stream=stream, val_samples=val_samples, tp_group=tp_group,
              sampling=sampling_of(args, banned), pad_id=processor.tokenizer.pad_token_id or 0,
              tied=policy.lm_head.weight is policy.get_input_embeddings().weight, offload=offload_types(args, rank),
              hf_ds_config=dschf, aux_loss_coef=aux_loss_coef, ref_masters=fp32_masters(ref_engine, args),
              teacher_engine=teacher_engine, reward_engine=reward_engine)
    # resume: weights, optimizer, scheduler, step, data position, RNG (and a moving reference's own state), run.state;
    # then metrics.jsonl and wandb, continued
    ckpt, run.start = checkpoint.resume(engine, stream, args, rank, resume_from, run.moving_reference)
    run.state, run.updates = checkpoint.run_state(ckpt, run.start)   # run.state and the updates run so far
    logs.open_logs(run, resumed=bool(ckpt))
    if run.master:
        print(f"[setup] {world} ranks, {run.per_rank} prompts x {args.num_generations} generations per rank, "
              f"{gas} micro-batches of {args.per_device_train_batch_size}; metrics -> {run.metrics_path}")
    job.install_preemption_handler(rank)
    return run


def distributed(args):
    """torch.distributed and DeepSpeed's communication up, this job's claim on the output folder, and what killed
    launches left behind cleared. -> (rank, world, ranks on this node, device)."""
    if args.model is None:   # before torch.distributed exists: transformers saves on rank 0 only once it does
        embedded_default(args)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"[setup] embedded default: tiny {args.tiny_arch} at {args.model}, {args.tiny_task} task "
                  f"{args.train_data}")
    # in seconds, before anything waits on the hub; a quantized checkpoint refused by name, on every rank alike
    model.refuse_quantized(model.on_disk(args.model))
    if torch.cuda.is_available():   # before any CUDA allocation: one GPU per rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # torch.distributed first, DeepSpeed's communication (which JIT-loads an op under a lock) next:
    # in between, one rank per node clears a lock a killed launch left behind, while the others wait
    backend = get_accelerator().communication_backend_name()
    dist.init_process_group(backend=backend)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        job.clear_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"])
        job.clear_stale_shm_buffers()
        job.clear_stale_vllm_shm()   # this job's own are made later, by the engines (rollout.create_engine)
    refusal = [None]
    if dist.get_rank() == 0:   # one live job per output folder, before anything is written there
        os.makedirs(args.output_dir, exist_ok=True)
        refusal = [job.claim_output_dir(args.output_dir)]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        sys.exit(refusal[0])
    if dist.get_rank() == 0:
        job.heartbeat(args.output_dir)
    dist.barrier()
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    job.at_exit(job.remove_shm_buffer, rank)   # DeepSpeed's /dev/shm buffer, ~70 MB, never removed otherwise
    device = torch.device(get_accelerator().device_name(), int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    return rank, world, ranks.local_world(world), device


def embedded_default(args):
    """No --model: the embedded tiny model (built once), and where --train_data is not given its task's train and
    validation files. A user's --train_data keeps its own --val_data, or none (check_data says so)."""
    args.model, train_default, val_default = tiny.ensure_default(task=args.tiny_task, size=args.tiny_size,
                                                                 arch=args.tiny_arch)
    if args.train_data is None:
        args.train_data, args.val_data = train_default, args.val_data or val_default


def check_sources(args):
    """Rank 0 reads --train_data and --val_data as the launch will (data.check_source) with what that needs of the
    model: its processor and box convention, read from its folder. -> (the verdicts, the lines to say first)."""
    notes = [] if args.val_data else ["[data] no --val_data: this run validates on nothing (give --val_data to "
                                      "validate)"]
    try:
        processor = AutoProcessor.from_pretrained(args.model, local_files_only=True)
        norm_bbox = model.family(AutoConfig.from_pretrained(args.model, local_files_only=True))["norm_bbox"]
        data.pixel_bounds(args, processor)   # out of bounds: the launch refuses it after this check
    except (OSError, ValueError, SystemExit) as e:
        processor, norm_bbox = None, None
        notes.append(f"[data] prompt lengths not checked, nor a box's units: the processor of --model {args.model} "
                     f"could not be read ({str(e).splitlines()[0][:160]})")
    tools = toolbox.schemas(args.tools, norm_bbox or "none")
    return [data.check_source(path, args, flag, processor, tools, norm_bbox)
            for path, flag in ((args.train_data, "--train_data"), (args.val_data, "--val_data")) if path], notes


def check_data(args, rank):
    """Rank 0 checks every row of --train_data and --val_data (nothing decoded: check_sources) and says what it found;
    every rank then stops (no usable row) or takes the limits the data needs (data.data_limits)."""
    if args.train_data is None:   # settle_flags says it is required
        return
    if args.val_only and not args.val_data:
        sys.exit("error: --val_only validates on --val_data: give it")
    verdicts = [None]
    if rank == 0:
        verdicts[0], notes = check_sources(args)
        print("\n".join(notes + [line for v in verdicts[0] for line in v["lines"]]), flush=True)
    dist.broadcast_object_list(verdicts, src=0)
    if errors := [v["error"] for v in verdicts[0] if v["error"]]:
        sys.exit("\n".join(errors))
    said = data.data_limits(args, max(v["images"] for v in verdicts[0]), max(v["videos"] for v in verdicts[0]),
                            toolbox.image_limit(args, 0))
    if rank == 0 and said:
        print(said, flush=True)


def check_data_alone(args):
    """--check_data in this process, with no model weights, vLLM or ranks -> 0 when every row is usable, else 1."""
    if args.model is None:   # the embedded default's task (its model is built with it, once)
        embedded_default(args)
    if args.train_data is None:
        sys.exit("error: --check_data with --model reads --train_data: give it")
    verdicts, notes = check_sources(args)
    print("\n".join(notes + [line for v in verdicts for line in v["lines"] + ([v["error"]] if v["error"] else [])]))
    said = data.data_limits(args, max(v["images"] for v in verdicts), max(v["videos"] for v in verdicts),
                            toolbox.image_limit(args, 0))
    if said:
        print(said)
    return 0 if all(v["usable"] == v["rows"] and not v["error"] for v in verdicts) else 1


def settle_flags(args, rank, world, local_world):
    """The flags checked, the checkpoint to resume from picked (its flags compared: before anything heavy), the
    notes on inert flags said, --memory auto's levers chosen (rank 0 picks, every rank runs them or refuses alike),
    the derived micro-batch, the seeds. -> (args, micro-batches per step, the checkpoint or None)."""
    check_args(args, world)
    judge.configure(args)   # --reward_funcs judge: its endpoint and client
    if args.judge_url:   # every rank asks the judge once; one that gets no answer stops them all alike
        said = [None] * world
        dist.all_gather_object(said, judge.probe())
        if failed := [r for r, why in enumerate(said) if why]:
            sys.exit(f"{said[failed[0]]} (rank {', '.join(map(str, failed))} of {world})")
    resume_from = checkpoint.pick_checkpoint(args, rank, world)
    if rank == 0:
        for note in inert_flags(args):
            print(f"[flags] note: {note}", flush=True)
    if args.memory == "auto":   # one node's free RAM decides
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
    if args.train_data is None:
        sys.exit("error: --train_data is required with --model")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    return args, grad_accumulation_steps(args, world), resume_from


def model_settings(args, rank):
    """What the checkpoint's config decides, said once: bf16 (its family's CPU dtype), Qwen3.5's linear-attention
    kernels, the router's loss of a mixture of experts, whether the shared prefix applies, the attention.
    -> (config, bf16, the router's loss coefficient or None)."""
    config = AutoConfig.from_pretrained(args.model)   # its family (model.FAMILIES) decides the CPU dtype
    bf16 = model.use_bf16(args, config)
    if rank == 0 and (kernels := model.linear_attention_kernels(config)):   # Qwen3.5: which GDN / conv1d kernels train
        print(f"[setup] {kernels}")
    aux_loss_coef, why = model.router_aux_loss_coef(args, config)   # mixture-of-experts: the router's loss, on or off
    if rank == 0 and aux_loss_coef is not None:
        print(f"[setup] mixture-of-experts: router aux loss x {aux_loss_coef:g} ({why}); its experts' blocks gathered "
              f"whole by ZeRO-3 (model.moe_leaf_modules)")
    if args.shared_prefix and (why := model.shared_prefix_unsupported(config, args.micro_batch_tokens)):
        args.shared_prefix = False   # said once; the standard path gives the same loss
        if rank == 0:
            print(f"[setup] --shared_prefix falls back to one sequence per completion: {why}")
    if rank == 0 and isinstance(attn := model.attention(args, config, model.flash_attn_installed() and bf16), dict):
        print(f"[setup] attention: the text model runs {attn['']}, the vision tower "
              f"{next(v for k, v in attn.items() if 'vision' in k)}")
    return config, bf16, aux_loss_coef


def start_vllm(args, rank, world, local_world, bf16):
    """One vLLM engine per rank or TP group, asleep (--sleep_level 1|2) before the trainer's states reach the GPU,
    so that the two pools never meet at load. -> (the engine, this rank's TP group or None)."""
    tp = args.vllm_tensor_parallel_size
    tp_group = None
    if tp > 1:   # consecutive ranks, as vLLM's own groups; inside a node (check_args refuses a size that spans two)
        tp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])
    per_rank = args.rollout_batch_size // world
    threads = rollout.torch_threads_share(local_world)
    llm = rollout.create_engine(args.model, args, "bfloat16" if bf16 else "float32",
                                max_num_seqs=max(per_rank * args.num_generations * tp, 16), rank=rank // tp)
    threads = rollout.restore_threads(threads)
    # the kernels torch dispatches follow the CPU's ISA: runs compare bitwise only on the same (docs/demos.md)
    if rank == 0:
        print(f"[setup] torch threads per rank after the vLLM engine started: {threads}; CPU kernels: "
              f"{torch.backends.cpu.get_cpu_capability()}")
    if args.sleep_level > 0:
        rollout.sleep(llm, args.sleep_level, args.gc_collect_after_offload)
    return llm, tp_group


def load_models(args, cfg, dtype):
    """The policy (checkpointing, LoRA or frozen parts as asked), its optimizer and the reference, under ZeRO-3.
    -> (policy engine, reference engine or None, the HfDeepSpeedConfig to keep alive)."""
    model.check_fused_adam(cfg)
    dschf = HfDeepSpeedConfig(cfg)   # while alive (kept in Run), from_pretrained loads partitioned
    policy = model.load_model(args.model, args, dtype)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = model.trainable(policy, args)   # LoRA (--use_peft), frozen vision tower / projector
    engine, *_ = deepspeed.initialize(model=policy,
                                      model_parameters=[p for p in policy.parameters() if p.requires_grad],
                                      config=cfg, lr_scheduler=model.lr_schedule(args))
    ref_engine = model.load_reference(args, dtype, model.reference_config(cfg, args.ref_offload)) \
        if args.beta > 0 and not args.use_peft else None   # LoRA: the reference is the policy with its adapter off
    return engine, ref_engine, dschf


def load_frozen(path, flag, args, processor, cfg, dtype):
    """A second model that scores the policy's completions (`flag`: --teacher_model, --reward_model), held as the
    reference is (a ZeRO-3 inference engine, its shards in host RAM with --ref_offload) -> its engine, or None
    without `path`. Its tokenizer must be the policy's: it reads the same token ids."""
    if path is None:
        return None
    path = model.on_disk(path)
    model.refuse_quantized(path, flag)
    theirs = AutoProcessor.from_pretrained(path).tokenizer.get_vocab()
    if theirs != processor.tokenizer.get_vocab():
        sys.exit(f"error: {flag} {path}: its tokenizer differs from --model's ({len(theirs)} vs "
                 f"{len(processor.tokenizer)} tokens, or other ids); it must read the policy's token ids")
    return model.load_reference(args, dtype, model.reference_config(cfg, args.ref_offload), path=path)


def fp32_masters(ref_engine, args):
    """--ref_ema beside a bf16 reference: fp32 copies of its partitions on their devices, else None; in bf16 an
    EMA step would round away."""
    if not args.ref_ema or ref_engine is None or next(ref_engine.module.parameters()).dtype == torch.float32:
        return None
    return [p.ds_tensor.detach().float().clone() for p in ref_engine.module.parameters()]


def load_data(args, processor, rank, world, norm_bbox="none"):
    """-> (this rank's data.PromptStream, its prepared validation samples or None); `norm_bbox`: the family's box
    convention (model.FAMILIES)."""
    tools = toolbox.schemas(args.tools, norm_bbox)   # the prompt shows them
    stream = data.PromptStream(data.Rows(args.train_data, args.columns, args.image_root), processor, args, rank, world,
                               tools, norm_bbox)
    val_samples = data.validation_samples(args, processor, rank, world, tools, norm_bbox) if args.val_data else None
    return stream, val_samples


def offload_types(args, rank):
    """The trainer states that leave the GPU while vLLM generates (DeepSpeed's offload_states types)."""
    if (args.offload_optimizer or args.offload_model) and not torch.cuda.is_available():
        if rank == 0:
            print("[memory] --offload_optimizer/--offload_model: no-ops on CPU, where the trainer states live in "
                  "host RAM")
        args.offload_optimizer = args.offload_model = False
    return ([OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads,
             OffloadStateTypeEnum.contiguous_grad_buffer] if args.offload_optimizer else []) + \
        ([OffloadStateTypeEnum.lp_params] if args.offload_model else [])


def this_cluster(local_world, world):
    """The planner's view of this launch: ranks per node, nodes, this GPU's memory, this node's free RAM."""
    cuda = torch.cuda.is_available()
    return planner.Cluster(gpus_per_node=local_world, nodes=max(1, world // local_world), cuda=cuda,
                           gpu_gb=torch.cuda.get_device_properties(0).total_memory / memory.GB if cuda else 0.0,
                           host_gb=memory.psutil.virtual_memory().available / memory.GB)


def print_plan(args):
    """--plan: `memory.py plan` for this launch (rank 0), before anything starts."""
    if args.model is None:
        args.model = tiny.ensure_default(task=args.tiny_task, size=args.tiny_size, arch=args.tiny_arch)[0]
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.train_data and int(os.environ.get("RANK", 0)) == 0:   # cheap (nothing decoded): the limits the data sets
        verdict = data.check_source(args.train_data, args)
        said = data.data_limits(args, verdict["images"], verdict["videos"], toolbox.image_limit(args, 0))
        print("\n".join(verdict["lines"] + [verdict["error"] or "", said or ""]).rstrip())
    check_args(args, world)
    cluster = this_cluster(ranks.local_world(world), world)
    if int(os.environ.get("RANK", 0)) == 0:
        if args.memory == "auto":
            args = planner.decide(args, cluster, verbose=True, exit_if_none=False)
        s = planner.model_shape(args.model)
        pl = planner.plan(args, cluster, s)
        print(planner.render(pl, cluster, planner.levers(args, cluster, s, pl)))
