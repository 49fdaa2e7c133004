"""DeepSpeed decisions in-process: the real DeepSpeed engine (ZeRO-3, CPU offload) on one gloo rank."""
import json
import os
import types

import deepspeed
import pytest
import torch
import torch.distributed as dist
from transformers import AutoProcessor
from transformers.integrations import HfDeepSpeedConfig

import data
import model
import train


def ds_engine(flags, net=None):
    args = train.parse_args(["--rollout_batch_size", "1", "--num_generations", "2",
                             "--per_device_train_batch_size", "2", *flags])
    gas = train.grad_accumulation_steps(args, 1)
    net = net or torch.nn.Linear(4, 3)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                      config=model.ds_config(args, gas, 1, bf16=False),
                                      lr_scheduler=model.lr_schedule(args))   # the trainable ones, as train.py passes
    return engine


def weights(engine):
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])


@pytest.mark.parametrize("flags,rates", [
    (["--warmup_steps", "0", "--lr_scheduler_type", "constant"], [0.01, 0.01, 0.01]),
    (["--warmup_steps", "4", "--lr_scheduler_type", "constant"], [0.0025, 0.005, 0.0075]),
    (["--lr_scheduler_type", "linear", "--max_steps", "4"], [0.01, 0.0075, 0.005]),
    (["--lr_scheduler_type", "cosine", "--max_steps", "3", "--warmup_steps", "1"], [0.01, 0.01, 0.005])])
def test_each_optimizer_step_uses_the_logged_rate(world1, flags, rates):
    """AdamW's first steps move every weight by about the learning rate (m/sqrt(v) = sign of the
    gradient), so the step's own rate is read off the weights. With WarmupLR (before) and no
    warmup, steps 1 and 2 did not move the weights at all and step 3 moved them by half."""
    torch.manual_seed(0)
    engine = ds_engine(["--learning_rate", "0.01", "--weight_decay", "0", *flags])
    x = torch.randn(2, 4)
    for rate in rates:
        logged = engine.get_lr()[0]            # what learner.update logs for the step
        before = weights(engine)
        loss = engine(x).pow(2).sum()
        engine.backward(loss)
        engine.step()
        moved = (weights(engine) - before).abs()
        assert logged == pytest.approx(rate)
        assert moved.max().item() == pytest.approx(rate, rel=0.05)


def zero(cfg):
    return {k: cfg["zero_optimization"][k]["device"] for k in ("offload_param", "offload_optimizer")}


def test_offload_flags_change_only_what_they_name():
    def cfg(*flags, cuda=True):
        args = train.parse_args(["--per_device_train_batch_size", "4", *flags])
        return model.ds_config(args, 1, 1, bf16=True, cuda=cuda)
    assert zero(cfg()) == {"offload_param": "cpu", "offload_optimizer": "cpu"}          # ds_zero3.json's static offload
    params = cfg("--offload_model")       # params move with offload_states (which needs offload_param none) ...
    assert zero(params) == {"offload_param": "none", "offload_optimizer": "cpu"}   # ... the optimizer stays offloaded
    assert params["optimizer"]["params"]["torch_adam"] is True
    # states on the GPU to be moved, by FusedAdam, the only one offload_states moves
    optim = cfg("--offload_optimizer")
    assert zero(optim) == {"offload_param": "none", "offload_optimizer": "none"}
    assert optim["optimizer"]["params"]["torch_adam"] is False
    assert zero(cfg("--offload_model", "--offload_optimizer", cuda=False)) == zero(cfg())   # CPU: a stated no-op
    assert cfg()["data_types"] == {"grad_accum_dtype": "fp32"}
    fp32 = model.ds_config(train.parse_args(["--per_device_train_batch_size", "4"]), 1, 1, bf16=False)
    assert "data_types" not in fp32


def test_an_edited_deepspeed_file_is_read_again_and_each_config_is_its_own(tmp_path):
    """model.ds_config keeps a JSON file's text per modification time (--memory auto reads it for each set-up it
    plans): a file written again is read again, and a returned dict edited by its caller changes no later one."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    args = train.parse_args(["--per_device_train_batch_size", "4", "--deepspeed", str(path)])
    first = model.ds_config(args, 1, 1, bf16=False)
    first["zero_optimization"]["offload_param"]["device"] = "nvme"
    assert model.ds_config(args, 1, 1, bf16=False)["zero_optimization"]["offload_param"] == {"device": "cpu"}
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}}))
    os.utime(path, ns=(1, 1))   # another modification time, whatever the filesystem's clock resolution
    assert model.ds_config(args, 1, 1, bf16=False)["zero_optimization"]["offload_param"] == {"device": "none"}


def test_zero_offload_names_the_static_offload_and_the_plan_follows_it():
    """--zero_offload none|optimizer|all sets ds_zero3.json's two static offloads (no JSON needed for "no
    offload"), combines with the during-rollout flags it allows, refuses the ones it contradicts, and
    moves the plan's ZeRO-3 terms between the GPU and the host."""
    import planner

    def cfg(*flags):
        args = train.parse_args(["--per_device_train_batch_size", "4", *flags])
        return model.ds_config(args, 1, 1, bf16=True, cuda=True)
    assert zero(cfg("--zero_offload", "none")) == {"offload_param": "none", "offload_optimizer": "none"}
    assert zero(cfg("--zero_offload", "optimizer")) == {"offload_param": "none", "offload_optimizer": "cpu"}
    assert zero(cfg("--zero_offload", "all")) == zero(cfg())
    assert zero(cfg("--zero_offload", "optimizer", "--offload_model")) == {"offload_param": "none",
                                                                          "offload_optimizer": "cpu"}
    assert zero(cfg("--zero_offload", "none", "--offload_optimizer", "--offload_model")) \
        == zero(cfg("--zero_offload", "none"))
    for flags in (["--zero_offload", "optimizer", "--offload_optimizer"], ["--zero_offload", "all", "--offload_model"]):
        with pytest.raises(SystemExit, match="--zero_offload .* keeps those states in host RAM"):
            train.check_args(train.parse_args(["--num_generations", "4", *flags]), 1)
    cluster = planner.Cluster(gpus_per_node=8, nodes=1, gpu_gb=80, host_gb=1024, cuda=True)
    s = planner.model_shape("qwen2.5-vl-7b")

    def placed(value):
        args = train.parse_args(["--model", "qwen2.5-vl-7b", "--bf16", "--zero_offload", value])
        load = planner.plan(args, cluster, s)["phases"]["load"]
        return (sorted(k for k in load["gpu"] if k.startswith("ZeRO-3")),
                sorted(k for k in load["host"] if k.startswith("ZeRO-3")))
    assert placed("none")[1] == [] and len(placed("none")[0]) == 4
    assert placed("optimizer") == (["ZeRO-3 params"], [f"ZeRO-3 {k} (static offload)"
                                                       for k in ("adam_states", "fp32_master", "gradients")])
    assert placed("all")[0] == [] and len(placed("all")[1]) == 4


def test_offload_model_with_a_frozen_parameter_is_refused(world1):
    """DeepSpeed's offload_states of the param shards (what --offload_model runs before each rollout, stage3.py)
    copies a flat buffer of the trainable parameters' shards, then lays every parameter's shard over it: with a
    frozen layer, narrow runs past its end. check_args refuses the pair by name, with the way out; the
    optimizer's offload, which moves the trainable states only, stays allowed. Should a DeepSpeed upgrade make
    the frozen case pass, the refusal in flags.check_args can go."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    params = [OffloadStateTypeEnum.lp_params]
    torch.manual_seed(0)
    whole = ds_engine(["--zero_offload", "none"], torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)))
    before = weights(whole)
    whole.offload_states(include=params)   # train.py's call (pinning is a no-op on CPU)
    whole.reload_states()
    assert torch.equal(weights(whole), before)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    net[0].requires_grad_(False)   # as --freeze_vision_tower or LoRA's base weights
    frozen = ds_engine(["--zero_offload", "none"], net)
    assert frozen.optimizer.lp_param_buffer.numel() == 15 < sum(p.ds_tensor.numel() for p in net.parameters())
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        frozen.offload_states(include=params)
    base = ["--model", "qwen2.5-vl-7b", "--zero_offload", "none"]
    for flag in ("--use_peft", "--freeze_vision_tower", "--freeze_projector"):
        with pytest.raises(SystemExit,
                           match=f"--offload_model with {flag}: .*--offload_optimizer .*--zero_offload optimizer"):
            train.check_args(train.parse_args([*base, "--offload_model", flag]), 1)
        train.check_args(train.parse_args([*base, "--offload_optimizer", flag]), 1)
        train.check_args(train.parse_args(["--model", "qwen2.5-vl-7b", "--zero_offload", "optimizer", flag]), 1)
    with pytest.raises(SystemExit, match="--use_peft / --freeze_vision_tower: "):
        train.check_args(train.parse_args([*base, "--offload_model", "--use_peft", "--freeze_vision_tower"]), 1)


def test_bf16_gradients_accumulate_in_fp32(world1):
    args = train.parse_args(["--rollout_batch_size", "1", "--num_generations", "2",
                             "--per_device_train_batch_size", "2"])
    gas = train.grad_accumulation_steps(args, 1)
    net = torch.nn.Linear(4, 3)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=model.ds_config(args, gas, 1, bf16=True))
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.optimizer.gradient_accumulation_dtype == torch.float32   # ZeRO-3's own partition buffers


def test_reference_is_sharded_by_its_own_config(world1, tiny_default, monkeypatch):
    """Which device zero.Init places the shards on (its remote_device) while from_pretrained loads:
    the reference's --ref_offload, not the trainer's offload_param."""
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from transformers.integrations import HfDeepSpeedConfig
    seen, init = [], partition_parameters.Init.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        seen.append(self.remote_device)
    monkeypatch.setattr(partition_parameters.Init, "__init__", spy)
    args = train.parse_args(["--model", tiny_default[0], "--per_device_train_batch_size", "4", "--ds_set",
                             'zero_optimization.offload_param={"device": "none"}'])
    cfg = model.ds_config(args, 1, 1, bf16=False)
    trainer = HfDeepSpeedConfig(cfg)                          # the trainer's, alive as in setup()
    for ref_offload, where in ((True, OffloadDeviceEnum.cpu), (False, torch.device("cpu"))):
        seen.clear()
        ref = model.load_reference(args, torch.float32, model.reference_config(cfg, ref_offload))
        assert seen and set(seen) == {where}, (ref_offload, seen)
        assert model.transformers_ds_config() is trainer       # later loads see the trainer's again
        assert all(hasattr(p, "ds_tensor") for p in ref.module.parameters())


def test_offload_buffers_stay_out_of_checkpoints_and_are_dropped_after_a_load(world1, tmp_path):
    """DeepSpeed's own offload_adam_states (what offload_states runs for optimizer states) leaves
    <key>_offload_buffer in the optimizer state; before, checkpoints carried them."""
    from deepspeed.runtime.zero.offload_states import offload_adam_states, reload_adam_states

    import checkpoint
    torch.manual_seed(0)
    engine = ds_engine(["--learning_rate", "0.01"])
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    opt = engine.optimizer.optimizer
    offload_adam_states(opt, "cpu")
    reload_adam_states(opt, "cpu")
    assert len(checkpoint.offload_buffers(engine)) == 2
    args = types.SimpleNamespace(output_dir=str(tmp_path), save_total_limit=2)
    stream = types.SimpleNamespace(state=lambda: {})
    path = checkpoint.save_checkpoint(engine, args, 1, stream, "id", 0)
    assert len(checkpoint.offload_buffers(engine)) == 2       # kept in memory for the next offload
    saved = [torch.load(f, weights_only=False) for f in (tmp_path / "checkpoint-1" / "zero").glob("*optim*")]
    assert saved and "_offload_buffer" not in repr(saved)
    engine.save_checkpoint(str(tmp_path / "old"), tag="zero")   # as checkpoints were written before
    assert "_offload_buffer" in repr([torch.load(f, weights_only=False)
                                      for f in (tmp_path / "old" / "zero").glob("*optim*")])
    engine.load_checkpoint(str(tmp_path / "old"), tag="zero")
    assert checkpoint.drop_offload_buffers(engine) == 2 and not checkpoint.offload_buffers(engine)
    engine.load_checkpoint(path, tag="zero")
    assert not checkpoint.offload_buffers(engine)


def test_fused_adam_is_loaded_before_anything_with_a_clear_error(monkeypatch):
    """On a GPU without nvcc, FusedAdam's JIT build fails deep inside deepspeed.initialize. It is
    loaded first, and a failure says what to do. (No CUDA here: the builder's failure is a stand-in.)"""
    from deepspeed.ops import op_builder

    class NoNvcc:
        def load(self):
            raise RuntimeError("Error building extension 'fused_adam'\n/bin/sh: 1: nvcc: not found")
    monkeypatch.setattr(op_builder, "FusedAdamBuilder", NoNvcc)
    args = train.parse_args(["--per_device_train_batch_size", "4", "--offload_optimizer"])
    cfg = model.ds_config(args, 1, 1, bf16=True, cuda=True)
    with pytest.raises(SystemExit, match="(?s)FusedAdam.*nvcc: not found.*DS_BUILD_FUSED_ADAM=1"):
        model.check_fused_adam(cfg, cuda=True)
    static = model.ds_config(train.parse_args(["--per_device_train_batch_size", "4"]), 1, 1, bf16=True, cuda=True)
    assert model.check_fused_adam(static, cuda=True) is False      # static CPU offload: CPU Adam, nothing to build
    assert model.check_fused_adam(cfg, cuda=False) is False


@pytest.mark.parametrize("arch,plain", [("9.0a", "9.0"), ("8.0 9.0a 10.0f+PTX", "8.0;9.0;10.0+PTX"),
                                        ("9.0;9.0a", "9.0")])
def test_fused_adam_builds_under_an_arch_specific_torch_cuda_arch_list(monkeypatch, arch, plain):
    """make gpu-check on an H200 image whose TORCH_CUDA_ARCH_LIST names 9.0a: DeepSpeed 0.19.8's own JIT builder
    raised ValueError on the letter, and every run whose optimizer stays on the GPU exited at check_fused_adam. The
    builder here is DeepSpeed's CUDA one (its nvcc arguments need no GPU); only the compile (load) is a stand-in,
    which sees the list DeepSpeed can read, and the user's list is back afterwards."""
    from deepspeed.ops import op_builder
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # CUDA's (op_builder's is the CPU one here)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    with pytest.raises(ValueError, match="invalid literal for int"):   # the bug, in DeepSpeed 0.19.8 itself
        builder.compute_capability_args()
    assert model.deepspeed_arch_list(arch) == plain
    seen = []

    class Builder(FusedAdamBuilder):
        def load(self):
            self.jit_mode = True
            seen.append((os.environ["TORCH_CUDA_ARCH_LIST"], self.compute_capability_args()))
    monkeypatch.setattr(op_builder, "FusedAdamBuilder", Builder)
    cfg = model.ds_config(train.parse_args(["--per_device_train_batch_size", "4", "--offload_optimizer"]), 1, 1,
                          bf16=True, cuda=True)
    assert model.check_fused_adam(cfg, cuda=True) is True
    assert [env for env, _ in seen] == [plain]   # and DeepSpeed's compute_capability_args read it without raising
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == arch


def test_a_relaunch_with_a_longer_schedule_trains_at_its_own_rate(world1, tmp_path):
    """A run saved at the end of a 2-step cosine (rate 0) and relaunched with --max_steps 4 trains step 3
    at the 4-step cosine's rate, not at the saved 0 (it did before checkpoint.rate_of_this_schedule)."""
    import checkpoint
    short = ds_engine(["--lr_scheduler_type", "cosine", "--max_steps", "2", "--learning_rate", "0.01"])
    for _ in range(2):
        short.backward(short(torch.ones(2, 4)).sum())
        short.step()
    short.save_checkpoint(str(tmp_path), tag="zero")
    longer = ds_engine(["--lr_scheduler_type", "cosine", "--max_steps", "4", "--learning_rate", "0.01"])
    longer.load_checkpoint(str(tmp_path), tag="zero")
    assert longer.get_lr() == [0.0]   # the saving run's end of schedule
    checkpoint.rate_of_this_schedule(longer)
    assert longer.get_lr() == pytest.approx([0.005])   # 0.01 x (1 + cos(pi x 2 / 4)) / 2


def _widths(rank, port, model_dir, train_jsonl, modes):
    """One of two ranks: a step of each mode of `modes` (comma-separated), each on a fresh engine; prints START and
    STEPPED lines (the micro-batches' chunks, the optimizer steps)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    flags = ["--rollout_batch_size", "4", "--num_generations", "2", "--per_device_train_batch_size", "2",
             "--logprob_chunk_tokens", "1", "--ds_set", "zero_optimization.stage3_param_persistence_threshold=0"]
    processor = AutoProcessor.from_pretrained(model_dir)
    samples = [data.prepare(row, processor, train.parse_args(flags)) for row in data.read_jsonl(train_jsonl)[:2]]
    P = samples[0]["hf"]["input_ids"].shape[1]
    for mode in modes.split(","):
        print("START", mode, rank, flush=True)
        args = train.parse_args(flags)
        cfg = model.ds_config(args, 1, 2, bf16=False)
        keep = HfDeepSpeedConfig(cfg)   # noqa: F841  alive while the model loads
        policy = model.load_model(model_dir, args, torch.float32)
        engine, *_ = deepspeed.initialize(model=policy, model_parameters=list(policy.parameters()), config=cfg)
        if mode == "budget":   # rank 0: 4 one-token answers fit one micro-batch; rank 1's 30-token answer needs its own
            args.micro_batch_tokens, widths = 4 * (P + 1), [[1, 1], [1, 1]] if rank == 0 else [[1, 1], [1, 30]]
        else:                  # rank 0's micro-batches: 2 tokens, 2 chunks each; rank 1's: 10
            widths = [[1, 1], [1, 1]] if rank == 0 else [[5, 5], [5, 5]]
        groups = [train.Group(sample=s, completions=[train.Completion(index=k, token_ids=[5] * n,
                                                                      sampler_logps=[-1.0] * n, text="",
                                                                      finish_reason="stop")
                                                     for k, n in enumerate(w)])
                  for s, w in zip(samples, widths)]
        run = types.SimpleNamespace(args=args, pad_id=processor.tokenizer.pad_token_id,
                                    sampling=train.grpo.Sampling(), device=torch.device("cpu"), rank=rank)
        batches = train.micro_batches(run, groups)
        for j, b in enumerate(batches):
            chunks = b["chunks"] if mode != "uneven" else b["inputs"]["completion_mask"].numel()
            ts = engine(**b["inputs"], chunks=chunks)
            engine.set_gradient_accumulation_boundary(j == len(batches) - 1)
            engine.backward(-(ts.logps * b["inputs"]["completion_mask"]).sum())
            engine.step()
        print("STEPPED", mode, rank, [b["chunks"] for b in batches], engine.global_steps, flush=True)


def test_ranks_with_different_widths_make_as_many_calls(tiny_default):
    """No global padding, on two ranks with every parameter partitioned (ZeRO-3) and one token per
    log-prob chunk. even: micro-batches of 2 and 10 completion tokens; train.micro_batches gives both
    ranks 10 chunks and the step completes. uneven: each rank with its own count (2 and 10) is what that
    prevents: ZeRO-3's gathers of lm_head no longer pair up, and gloo aborts ("Is there a distributed
    collective mismatch") where NCCL would hang. budget (--micro_batch_tokens): rank 0's sequences fit one
    micro-batch and rank 1's need two; rank 0 splits its own, and both ranks take one optimizer step over
    their two micro-batches (DeepSpeed's accumulation boundary set at the last, not counted from gas). The three
    modes run in one pair of ranks forked after the imports (uneven last: it aborts the group), one test: a module
    fixture shared by three tests is built again by each pytest worker that runs one of them."""
    from conftest import forked_ranks, free_port
    # a hang, not a slow machine: 90 s failed beside other jobs
    outs, code = forked_ranks(_widths, free_port(), tiny_default[0], tiny_default[1], "even,budget,uneven",
                              timeout=600)
    for mode, expect in (("even", "[10, 10] 1"), ("budget", "[3, 30] 1")):
        assert all(f"STEPPED {mode} {r} {expect}" in o for r, o in enumerate(outs)), [o[-2000:] for o in outs]
    uneven = [o.partition(f"START uneven {r}\n") for r, o in enumerate(outs)]
    assert all(started for _, started, _ in uneven), [o[-1500:] for o in outs]
    said = "".join(said for *_, said in uneven)   # what the ranks said in the uneven run alone
    assert code is None or "collective mismatch" in said, [o[-1500:] for o in outs]


def test_test_ports_are_below_the_ephemeral_range_and_apart_per_process():
    """The tests' rendezvous ports (conftest.free_port) cannot be handed to a connection meanwhile: bind(0)'s
    ports could (the CI of 6f5c8e2: EADDRINUSE in a spawned rank). Two pytest processes (the two workers, or
    two runs side by side: two runs both as worker gw0 collided so) never pick the same one."""
    import subprocess
    import sys

    from conftest import ROOT, free_port
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    here = [free_port() for _ in range(20)]
    code = ("import sys\nsys.path.insert(0, 'tests')\nfrom conftest import free_port\n"
            "print(*[free_port() for _ in range(20)])")
    there = [int(p) for p in subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                            check=True, env=dict(os.environ, PYTEST_XDIST_WORKER="gw0")).stdout.split()]
    assert all(p < low for p in here + there) and len(set(here)) == len(set(there)) == 20, (here, there)
    assert not set(here) & set(there), (here, there)
