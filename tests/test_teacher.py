"""A second model in the step: on-policy distillation (--teacher_model, --teacher_coef) and a reward that uses a model
(--reward_model, the likelihood reward). In-process on the real ZeRO-3 inference engine (one gloo rank) with a plain
tiny student: the teacher's log-probs against a plain forward of the teacher, the per-token advantage, a teacher equal
to the student; launches: a mixture-of-experts student's step, and two LoRA ranks killed and resumed bitwise."""
import argparse
import glob
import json
import os
import shutil
import types

import pytest
import torch

import data
import learner
import logs
import model as model_py
import planner
import reward
import startup
import train
from conftest import FAST, launch, tiny_of

G = 4


def perturbed_copy(src, dst, scale=0.05, seed=0):
    """A copy of the model folder `src` at `dst` with noise on every floating weight: another model, the same
    tokenizer and layout (the safetensors rewritten tensor by tensor)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in glob.glob(os.path.join(dst, "*.safetensors")):
        ts = load_file(f)
        save_file({k: v + (torch.randn(v.shape, generator=g) * scale).to(v.dtype) if v.is_floating_point() else v
                   for k, v in ts.items()}, f, metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return perturbed_copy(tiny_of()[0], tmp_path_factory.mktemp("teacher") / "model")


def make_run(world1, teacher=None, reward_model=None, **flags):
    """A one-rank Run: the plain tiny student (model.load_model, its forward the log-prob forward), the teachers and
    reward models as train.py loads them (startup.load_frozen: ZeRO-3 inference engines), 2 prompts x G."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = tiny_of()
    argv = ["--num_generations", str(G), "--rollout_batch_size", "2", "--per_device_train_batch_size", "4",
            "--beta", "0", "--report_to", "none", "--ds_set", "zero_optimization.stage3_param_persistence_threshold=0"]
    argv += ["--teacher_model", teacher] if teacher else []
    argv += ["--reward_model", reward_model, "--reward_funcs", "likelihood"] if reward_model else []
    args = train.parse_args(argv)
    args = argparse.Namespace(**{**vars(args), **flags})
    processor = AutoProcessor.from_pretrained(model_dir)
    cfg = model_py.ds_config(args, 1, 1, bf16=False)
    frozen = [startup.load_frozen(p, f, args, processor, cfg, torch.float32)
              for p, f in ((teacher, "--teacher_model"), (reward_model, "--reward_model"))]
    banned = train.rollout.checkpoint_banned_ids(model_dir, processor.tokenizer)
    run = startup.Run(args=args, rank=0, world=1, device=torch.device("cpu"), gas=2,
                      engine=model_py.load_model(model_dir, args, torch.float32).eval(), ref_engine=None, llm=None,
                      processor=processor, stream=types.SimpleNamespace(history={}), val_samples=None,
                      sampling=startup.sampling_of(args, banned),
                      pad_id=processor.tokenizer.pad_token_id or 0, teacher_engine=frozen[0], reward_engine=frozen[1])
    samples = [data.prepare(r, processor, args) for r in data.read_jsonl(train_jsonl)[:2]]
    ids = processor.tokenizer.convert_tokens_to_ids
    words = [["red"], ["blue", "red"], ["green"], ["red", "blue", "green"]]
    groups = [train.Group(sample=s, completions=[
        train.Completion(index=k, token_ids=ids(w), sampler_logps=[-1.0] * len(w), text=" ".join(w),
                         finish_reason="stop", total=float(k % 2 == i % 2), failed={})
        for k, w in enumerate(words)]) for i, s in enumerate(samples)]
    return run, groups


def test_the_teachers_log_probs_and_the_advantage(world1, teacher_dir):
    """The teacher's log-probs (a ZeRO-3 engine, over the student's own micro-batches and images) equal a plain forward
    of the teacher on the same inputs; each token's advantage is the group's plus teacher_coef x (teacher - pi_old),
    and train/teacher_kl is the mean pi_old - teacher over the tokens."""
    run, groups = make_run(world1, teacher=teacher_dir, teacher_coef=0.5)
    batches = train.micro_batches(run, groups)
    assert "pixel_values" in batches[0]["inputs"]   # the teacher sees the images
    learner.old_ref_logps(run, batches)   # pi_old before the advantages, with one iteration too
    learner.frozen_logps(run, batches)
    plain = model_py.load_model(teacher_dir, run.args, torch.float32).eval()
    for b in batches:
        with torch.no_grad():
            want = plain(**b["inputs"], sampling=run.sampling).logps
        got = learner.to_rows([c.teacher_logps for c in b["completions"]], run.device)
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    comps = [c for g in groups for c in g.completions]
    assert max((c.teacher_logps - c.old_logps).abs().max() for c in comps) > 1e-3   # another model
    teacher, run.args.teacher_model = run.args.teacher_model, None
    train.advantages(run, groups, train.Metrics())
    group = [c.advantage for c in comps]   # the group's alone, one per completion
    assert len(set(group)) > 1
    run.args.teacher_model = teacher
    m = train.Metrics()
    train.advantages(run, groups, m)
    for c, a in zip(comps, group):
        expected = a + 0.5 * (c.teacher_logps - c.old_logps)
        assert c.advantage.shape == (len(c.token_ids),) and torch.allclose(c.advantage, expected, atol=1e-6)
    tokens = sum(len(c.token_ids) for c in comps)
    kl = sum((c.old_logps - c.teacher_logps).sum().item() for c in comps) / tokens
    assert m.means()["train/teacher_kl"] == pytest.approx(kl, rel=1e-5)


def test_a_teacher_equal_to_the_student_gives_no_signal(world1):
    """The student as its own teacher: the gap is 0 at every token, the advantages are the group's."""
    run, groups = make_run(world1, teacher=tiny_of()[0])
    batches = train.micro_batches(run, groups)
    learner.old_ref_logps(run, batches)
    learner.frozen_logps(run, batches)
    m = train.Metrics()
    train.advantages(run, groups, m)
    for c in (c for g in groups for c in g.completions):
        assert torch.equal(c.teacher_logps, c.old_logps)
        assert torch.equal(c.advantage, torch.full((len(c.token_ids),), c.advantage[0].item()))
    assert m.means()["train/teacher_kl"] == 0.0


def test_the_likelihood_reward_is_the_mean_log_prob_under_the_reward_model(world1, teacher_dir):
    """--reward_model with --reward_funcs likelihood: each completion's reward is the mean of a plain forward's
    log-probs (at temperature 1) of its tokens under the reward model; without its log-probs (validation) unscored."""
    run, groups = make_run(world1, reward_model=teacher_dir, temperature=0.7)
    run.sampling = startup.sampling_of(run.args, run.sampling.banned)
    batches = train.micro_batches(run, groups)
    learner.frozen_logps(run, batches)
    for c in (c for g in groups for c in g.completions):
        c.total = None   # not scored yet
    train.score(run, groups)
    plain = model_py.load_model(teacher_dir, run.args, torch.float32).eval()
    for b in batches:
        with torch.no_grad():
            lp = plain(**b["inputs"], sampling=train.grpo.Sampling(banned=run.sampling.banned)).logps
        for j, c in enumerate(b["completions"]):
            want = lp[j, lp.shape[1] - len(c.token_ids):].mean().item()
            assert c.rewards["likelihood"] == pytest.approx(want, abs=1e-5) and c.scored
    val = [train.Completion(index=0, token_ids=[5], sampler_logps=[], text="x", finish_reason="stop")]
    assert reward.likelihood(["x"], **train.reward_inputs(run, [groups[0].sample], val)) == [None]


def test_the_flags_are_checked_and_the_plan_counts_the_teacher(teacher_dir):
    """No reward at all is allowed with a teacher only; a reward that asks for a model needs --reward_model; the plan
    with a teacher is larger by the teacher's shards, named."""
    with pytest.raises(SystemExit, match="--reward_funcs is empty"):
        train.check_args(train.parse_args(["--reward_funcs"]), 1)
    train.check_args(train.parse_args(["--reward_funcs", "--teacher_model", teacher_dir]), 1)
    with pytest.raises(SystemExit, match="likelihood score with a model: give --reward_model"):
        train.check_args(train.parse_args(["--reward_funcs", "likelihood"]), 1)
    cluster = planner.Cluster(gpus_per_node=2, nodes=1, cuda=True, gpu_gb=80.0, host_gb=500.0)
    for offload, place in ((True, "host"), (False, "gpu")):
        base = train.parse_args(["--model", tiny_of()[0], "--beta", "0", f"--{'' if offload else 'no-'}ref_offload"])
        without = planner.plan(base, cluster)
        with_ = planner.plan(argparse.Namespace(**{**vars(base), "teacher_model": teacher_dir}), cluster)
        ref = planner.plan(argparse.Namespace(**{**vars(base), "beta": 0.04}), cluster)
        term = with_["phases"]["update"][place]["teacher model (--teacher_model)"]
        assert term == ref["phases"]["update"][place]["reference model"] > 0   # a copy of the student's size
        assert sum(with_["phases"]["update"][place].values()) - sum(without["phases"]["update"][place].values()) \
            == pytest.approx(term)


@pytest.mark.launch
def test_a_mixture_of_experts_student_distils_a_step(tmp_path):
    """A mixture-of-experts student (its routers replayed in the update) with a teacher of its family, no reward
    function: one step runs and logs the teacher's KL."""
    arch = "qwen3_vl_moe"
    teacher = perturbed_copy(tiny_of(arch)[0], tmp_path / "teacher")
    rows, log = launch(tmp_path / "run", "--tiny_arch", arch, *FAST, "--beta", "0", "--max_steps", "1",
                       "--val_freq", "0", "--save_steps", "0", "--no-save_final_model", "--routing_replay",
                       "--reward_funcs", "--teacher_model", teacher, procs=1)
    step = next(r for r in rows if r["step"] == 1)
    assert step["train/teacher_kl"] != 0.0 and "time/teacher_logps" in step


@pytest.mark.launch
def test_lora_distillation_on_two_ranks_resumes_exactly_after_a_kill(tmp_path, teacher_dir):
    """--use_peft --teacher_model on 2 ranks: a run SIGKILLed after checkpoint-2 and relaunched ends bitwise as the
    uninterrupted one (the teacher is frozen: nothing saved, loaded again alike)."""
    from test_resume import assert_same, kill_at_checkpoint_2
    flags = [*FAST, "--beta", "0", "--max_steps", "3", "--val_freq", "0", "--save_steps", "2", "--use_peft",
             "--lora_r", "8", "--learning_rate", "1e-2", "--teacher_model", teacher_dir, "--teacher_coef", "0.5",
             "--no-save_final_model"]
    full, _ = launch(tmp_path / "full", *flags)
    run = tmp_path / "run"
    kill_at_checkpoint_2(run, flags)
    rows, log = launch(run, *flags)
    assert "checkpoint-2: step 2" in log
    assert_same(full, rows)
    assert [r.get("train/teacher_kl") for r in full] == [r.get("train/teacher_kl") for r in rows]
    assert any(r.get("train/teacher_kl", 0) > 0 for r in full)



def test_a_per_token_advantage_is_logged_as_a_list(tmp_path, tiny_default):
    """completions.jsonl takes a per-token advantage (the teacher's, or --advantage_estimator process) as a list."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(tiny_default[0])
    args = train.parse_args(["--output_dir", str(tmp_path), "--report_to", "none"])
    s = data.prepare(data.read_jsonl(tiny_default[1])[0], processor, args)
    c = train.Completion(index=0, token_ids=[5, 6], sampler_logps=[-1.0, -1.0], text="red", finish_reason="stop",
                         total=1.0, advantage=torch.tensor([0.5, -0.25]))
    logs.write_trajectories(types.SimpleNamespace(args=args, processor=processor),
                            [train.Group(sample=s, completions=[c])], 1)
    assert json.loads(open(tmp_path / logs.COMPLETIONS).readline())["advantage"] == [0.5, -0.25]
