"""LoRA (--use_peft) and frozen vision parts (--freeze_vision_tower, --freeze_projector) in-process:
which parameters train, the reference as the base model with the adapter off, the real DeepSpeed
engine (ZeRO-3, one gloo rank) giving a frozen tower no gradient and no optimizer state. The merged
sync's agreement with vLLM is in test_vllm_agreement.py; the 2-process run, resume and export in
test_resume.py."""
import copy
import functools
import types

import pytest
import torch

import data
import model as model_py
import train
from conftest import ARCHS, tiny_of


def tiny(arch="qwen2_5_vl", *flags):
    model_dir, train_jsonl, _ = tiny_of(arch)
    args = train.parse_args(["--tiny_arch", arch, "--rollout_batch_size", "1", "--num_generations", "2",
                             "--per_device_train_batch_size", "2", *flags])
    dtype = torch.bfloat16 if model_py.use_bf16(args, {"model_type": arch}, cuda=False) else torch.float32
    return args, model_dir, train_jsonl, dtype


@functools.cache
def processor_of(model_dir):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_dir)


def batch_of(model_dir, train_jsonl, args):
    processor = processor_of(model_dir)
    samples = [data.prepare(row, processor, args) for row in data.read_jsonl(train_jsonl)[:2]]
    return data.collate(samples, [[5, 6, 7], [8, 9]], processor.tokenizer.pad_token_id or 0, [])


def perturb_adapter(peft_model, seed=0):
    """PEFT starts B at 0 (the adapter changes nothing): give A and B values, as training would."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn_like(p) * 0.3)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_adapts_the_language_model_and_only_it_trains(arch):
    args, model_dir, _, dtype = tiny(arch, "--use_peft", "--lora_r", "4")
    base = model_py.load_model(model_dir, args, dtype)
    names = {n for n, _ in base.named_parameters()}
    peft = model_py.trainable(base, args)
    trained = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert all(".language_model." in n for n in trained)   # the vision tower only with --lora_vision
    # every default target of every decoder layer got one (Qwen3.5's linear-attention layers have only the MLP ones;
    # a mixture-of-experts layer's are its attention's and its shared expert's: the routed experts are no Linear)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}
    mlp = {"q_proj", "k_proj", "v_proj", "o_proj"} if arch == "qwen3_vl_moe" else {"gate_proj", "up_proj", "down_proj"}
    assert mlp <= adapted and adapted <= set(args.lora_target_modules)
    assert not any(".experts." in n for n in trained)
    assert arch != "qwen3_5_moe" or any(".shared_expert." in n for n in trained)
    a = next(p for n, p in peft.named_parameters() if ".lora_A." in n)
    assert a.shape[0] == 4                                           # --lora_r acts
    layer = next(m for m in peft.modules() if hasattr(m, "get_delta_weight"))
    assert layer.scaling["default"] == args.lora_alpha / 4          # --lora_alpha acts
    assert {n.removeprefix("base_model.model.").replace(".base_layer.", ".") for n, _ in peft.named_parameters()
            if ".lora_" not in n} == names                          # the base weights, all there, under their names


def test_lora_vision_and_target_flags_act():
    args, model_dir, _, dtype = tiny("qwen2_5_vl", "--use_peft", "--lora_vision", "--lora_target_modules", "q_proj")
    peft = model_py.trainable(model_py.load_model(model_dir, args, dtype), args)
    trained = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert any(".visual.blocks." in n for n in trained) and any(".visual.merger." in n for n in trained)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained if ".language_model." in n} == {"q_proj"}
    args.lora_target_modules = ["qkv_nope"]
    with pytest.raises(SystemExit, match="no Linear of the language model has these names.*q_proj"):
        model_py.trainable(model_py.load_model(model_dir, args, dtype), args)
    args.lora_dropout, args.lora_target_modules = 0.1, ["q_proj"]   # --lora_dropout acts
    layer = next(m for m in model_py.trainable(model_py.load_model(model_dir, args, dtype), args).modules()
                 if hasattr(m, "lora_dropout"))
    assert isinstance(layer.lora_dropout["default"], torch.nn.Dropout) and layer.lora_dropout["default"].p == 0.1
    args.lora_dropout = 0.0
    args.lora_target_modules = ["lm_head"]   # an adapter on lm_head (the tiny models' random lm_head bounds the logits)
    head = model_py.trainable(model_py.load_model(model_dir, args, dtype), args).get_output_embeddings()
    assert hasattr(head, "lora_A") and head.base_layer.weight.requires_grad is False
    import os

    import tiny as tiny_py
    from conftest import ROOT
    tied = os.path.join(ROOT, ".cache", "tiny", f"test-qwen3_vl-tied-{tiny_py.VERSION}")
    if not os.path.exists(os.path.join(tied, "model.safetensors")):
        tiny_py.build_model(tied, arch="qwen3_vl", tied=True)
    with pytest.raises(SystemExit, match="ties lm_head to the token embedding"):
        model_py.trainable(model_py.load_model(tied, args, dtype), args)
    for flags, msg in ((["--lora_vision"], "--lora_vision needs --use_peft"),
                       (["--export_merged"], "--export_merged needs --use_peft"),
                       (["--use_peft", "--lora_vision", "--freeze_vision_tower"], "freeze")):
        with pytest.raises(SystemExit, match=msg):
            train.check_args(train.parse_args(["--num_generations", "4", *flags]), 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_is_the_base_model_with_the_adapter_off(arch):
    """--beta > 0 under LoRA loads no reference model: the policy with its adapter off gives the base
    model's log-probs exactly, the same KL as an explicit reference copy."""
    args, model_dir, train_jsonl, dtype = tiny(arch, "--use_peft")
    batch = batch_of(model_dir, train_jsonl, args)
    reference = model_py.load_model(model_dir, args, dtype).eval()
    peft = model_py.trainable(copy.deepcopy(reference), args).eval()   # the same load, adapted
    perturb_adapter(peft)
    with torch.no_grad():
        want = reference(**batch).logps
        policy = peft(**batch).logps
        with model_py.adapter_off(types.SimpleNamespace(module=peft)):
            got = peft(**batch).logps
        again = peft(**batch).logps
    assert torch.equal(got, want)
    assert (policy - want).abs().max() > 1e-3 and torch.equal(again, policy)   # the adapter acts, and is back on


@pytest.mark.parametrize("flags,frozen", [(["--freeze_vision_tower"], "tower"),
                                          (["--freeze_vision_tower", "--freeze_projector"], "visual"),
                                          (["--freeze_projector"], "merger")])
def test_frozen_vision_parts_get_no_gradient_and_no_optimizer_state(world1, flags, frozen):
    """One ZeRO-3 step (every parameter partitioned) on the real engine: the frozen part is not in the
    optimizer (its fp32 partitions hold exactly the trainable numel) and does not move; the rest does."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    args, model_dir, train_jsonl, dtype = tiny("qwen2_5_vl", *flags, "--learning_rate", "1e-2", "--ds_set",
                                               "zero_optimization.stage3_param_persistence_threshold=0")
    cfg = model_py.ds_config(args, 1, 1, bf16=False)
    keep = HfDeepSpeedConfig(cfg)   # noqa: F841  (from_pretrained loads partitioned)
    policy = model_py.trainable(model_py.load_model(model_dir, args, dtype), args)
    part = {"tower": lambda n: ".visual." in n and ".merger." not in n, "visual": lambda n: ".visual." in n,
            "merger": lambda n: ".visual.merger." in n}[frozen]
    assert {n for n, p in policy.named_parameters() if not p.requires_grad} \
        == {n for n, _ in policy.named_parameters() if part(n)}
    engine, *_ = deepspeed.initialize(model=policy,
                                      model_parameters=[p for p in policy.parameters() if p.requires_grad],
                                      config=cfg, lr_scheduler=model_py.lr_schedule(args))

    def snapshot():
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    before = snapshot()
    ts = engine(**batch_of(model_dir, train_jsonl, args))
    engine.backward(-ts.logps.sum())
    engine.step()
    after = snapshot()
    trainable = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
    assert sum(g.numel() for g in engine.optimizer.fp32_partitioned_groups_flat) == trainable
    assert all(torch.equal(before[n], after[n]) for n in before if part(n))
    assert any(not torch.equal(before[n], after[n]) for n in before if ".visual." in n and not part(n)) \
        or frozen == "visual"
    assert any(not torch.equal(before[n], after[n]) for n in before if ".language_model." in n)


def test_merged_weights_are_the_base_names_and_w_plus_scaled_ba():
    import rollout
    args, model_dir, _, dtype = tiny("qwen2_5_vl", "--use_peft", "--lora_r", "4")
    base = model_py.load_model(model_dir, args, dtype)
    want = {n: p.detach().clone() for n, p in base.named_parameters()}
    peft = model_py.trainable(copy.deepcopy(base), args)
    perturb_adapter(peft)
    lora = {n: m for n, m in peft.named_modules() if hasattr(m, "get_delta_weight")}
    buckets = rollout.sync_buckets(peft, 0)
    sent = dict(kv for b in buckets for kv in rollout.hf_weights(b, lora))
    assert set(sent) == set(want)
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    q = peft.base_model.model.model.language_model.layers[0].self_attn.q_proj
    expect = want[name] + (q.lora_B["default"].weight @ q.lora_A["default"].weight) * args.lora_alpha / 4
    assert torch.allclose(sent[name], expect, atol=1e-6)
    assert torch.equal(sent["model.language_model.layers.0.input_layernorm.weight"],
                       want["model.language_model.layers.0.input_layernorm.weight"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("flags", [["--use_peft"], ["--use_peft", "--lora_vision", "--lora_r", "4"],
                                   ["--freeze_vision_tower"],
                                   ["--use_peft", "--lora_target_modules", "q_proj", "lm_head"],
                                   ["--freeze_vision_tower", "--freeze_projector"]],
                         ids=["lora", "lora_vision", "lora_head", "tower", "visual"])
def test_the_plan_counts_what_trains(arch, flags):
    """planner.trainable_params (gradients, fp32 master and Adam are sized by it) from the config's shapes
    alone equals what model.trainable leaves trainable, for every family; with LoRA the plan has no
    reference model and its optimizer states shrink by that ratio."""
    import planner
    args, model_dir, _, dtype = tiny(arch, *flags)
    real = sum(p.numel() for p in model_py.trainable(model_py.load_model(model_dir, args, dtype), args).parameters()
               if p.requires_grad)
    s = planner.model_shape(model_dir)
    assert planner.trainable_params(s, args) == real
    if "--use_peft" in flags:
        cluster = planner.Cluster(gpus_per_node=1, nodes=1, gpu_gb=80, host_gb=512, cuda=True)
        full = planner.plan(train.parse_args(["--model", model_dir, "--bf16"]), cluster, s)["phases"]["update"]
        lora = planner.plan(train.parse_args(["--model", model_dir, "--bf16", *flags]), cluster, s)["phases"]["update"]
        assert "reference model" in full["host"] and "reference model" not in lora["host"]
        assert lora["host"]["ZeRO-3 adam_states (static offload)"] == pytest.approx(
            full["host"]["ZeRO-3 adam_states (static offload)"] * real / s["n"])
