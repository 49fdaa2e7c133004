"""The hooks that paper changes use, each with the friction that a fork met before it existed: parameters
edited in place under ZeRO-3 whatever their state, the reference as a part with its own state, rewards per token span
and advantages per token, a loss from another forward in the same optimizer step, an estimator's own options; and the
five changes built on them (--temperature_end, --pass_at_k, --ref_ema, the process-reward example, --sft_coef)."""
import argparse
import math
import os

import deepspeed
import pytest
import torch
import torch.distributed as dist
from test_moe import batch_of
from test_step import G, groups_of, make_run
from transformers.integrations import HfDeepSpeedConfig

import checkpoint
import grpo
import job
import learner
import model
import reward
import train
from conftest import forked_ranks, free_port, tiny_of


# ----------------------------------------------------------------------------- ZeRO-3 parameters edited in place
def _zero3_reference(rank, port, out):
    """One of two ranks: the shipped ds_zero3.json's engine and reference, edited in place; prints its RESULT line
    and saves its reference parts (and rank 0 the gathered whole) into `out`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    job.at_exit(job.remove_shm_buffer, rank)   # as startup.distributed does
    world = dist.get_world_size()
    # the shipped ds_zero3.json: parameters under stage3_param_persistence_threshold (1e5: every one of the tiny
    # model's) stay whole on every rank, and the shards live in host RAM (offload_param cpu)
    args = train.parse_args(["--model", tiny_of()[0], "--per_device_train_batch_size", "2", "--ref_ema", "0.5",
                             "--min_pixels", "784", "--max_pixels", "3136"])   # the colour task's images: 4 tokens
    cfg = model.ds_config(args, 1, world, False)
    keep = HfDeepSpeedConfig(cfg)   # noqa: F841  alive while the models load
    engine, *_ = deepspeed.initialize(model=(policy := model.load_model(args.model, args, torch.float32)),
                                      model_parameters=list(policy.parameters()), config=cfg)
    ref = model.load_reference(args, torch.float32, model.reference_config(cfg, args.ref_offload))
    b = batch_of("qwen2_5_vl", args, image=True)
    ts = engine(**b)
    engine.backward(-ts.logps.sum() * 100)   # one optimizer step takes the policy away from the reference
    engine.step()
    named, pol = list(ref.module.named_parameters()), dict(engine.module.named_parameters())
    with torch.no_grad():
        ref(**b)   # DeepSpeed's first forward traces the module and releases all; from the second, persistent ones stay
        want, before = engine(**b).logps, ref(**b).logps   # gathered whole on every rank
        for n, p in named:   # the naive edit: every partition copied, the whole copies on each rank left as they are
            p.ds_tensor.data.copy_(pol[n].ds_tensor.data)
        naive = ref(**b).logps
        model.update_params([p for _, p in named], [[pol[n]] for n, _ in named], lambda r, s: r.copy_(s))
        edited = ref(**b).logps
        # an EMA step in fp32 masters (as learner.reference_step keeps them beside bf16), then the reference's own state
        masters = [p.ds_tensor.detach().float().clone() + 1.0 for _, p in named]
        model.update_params([p for _, p in named], [[pol[n], m] for (n, _), m in zip(named, masters)],
                            lambda r, p, m: r.copy_(m.lerp_(p.float(), 0.5)))
        torch.save(checkpoint.reference_parts(ref, masters), os.path.join(out, f"reference{rank}.pt"))
        full = {}
        for n, p in named:
            with deepspeed.zero.GatheredParameters([p]):
                full[n] = p.detach().clone()
        if rank == 0:
            torch.save(full, os.path.join(out, "full.pt"))
    persistent = sum(p.ds_persist for _, p in named)
    print(f"RESULT rank {rank} persistent {persistent}/{len(named)} naive {(naive - want).abs().max().item():.3e} "
          f"before {(before - want).abs().max().item():.3e} edited {(edited - want).abs().max().item():.3e}",
          flush=True)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory):
    """The two-rank run of _zero3_reference: its output folder and each rank's RESULT line."""
    out = tmp_path_factory.mktemp("zero3_reference")
    logs, code = forked_ranks(_zero3_reference, free_port(), str(out))
    assert code == 0, "\n".join(log[-3000:] for log in logs)
    return out, [next(line for line in log.splitlines() if line.startswith("RESULT")) for log in logs]


def test_update_params_edits_zero3_parameters_whatever_their_state(two_rank_reference):
    """Two ranks, the shipped ds_zero3.json (not threshold 0): every parameter of the tiny model is persistent (kept
    whole on every rank from the second forward on, and never gathered again by an engine without an optimizer step)
    and its shard is offloaded. Copying the policy's shards into the reference's (the edit a fork wrote for an EMA
    reference) leaves the reference's forward as it was; model.update_params makes it the policy's exactly."""
    _, results = two_rank_reference
    for line in results:
        fields = line.split()
        got = dict(zip(fields[3::2], fields[4::2]))
        n, total = map(int, got["persistent"].split("/"))
        assert n == total > 0, line                                  # every parameter persistent
        assert float(got["before"]) > 1e-4, line                     # the policy moved away from the reference
        assert float(got["naive"]) == float(got["before"]), line     # the shards alone: nothing changed
        assert float(got["edited"]) < 1e-6, line                     # update_params: the policy's forward


def test_the_reference_state_goes_to_another_number_of_ranks(two_rank_reference, world1, tiny_default):
    """A moving reference's own state, saved as each rank's parts (checkpoint.reference_parts) by two ranks, loads
    into one rank (checkpoint.load_reference joins the slices and takes this rank's): every parameter equals the
    two ranks' gathered whole, and so do the fp32 masters beside it."""
    out, _ = two_rank_reference
    deepspeed.init_distributed(dist_backend="gloo")
    args = train.parse_args(["--model", tiny_default[0], "--per_device_train_batch_size", "2", "--ref_ema", "0.5"])
    cfg = model.ds_config(args, 1, 1, False)
    keep = HfDeepSpeedConfig(cfg)   # noqa: F841  alive while the reference loads
    ref = model.load_reference(args, torch.float32, model.reference_config(cfg, args.ref_offload))
    masters = [p.ds_tensor.detach().float().clone() for p in ref.module.parameters()]
    checkpoint.load_reference(ref, masters, str(out), rank=0, world=1, saved=2)
    full = torch.load(out / "full.pt", weights_only=True)
    for (n, p), m in zip(ref.module.named_parameters(), masters):
        with deepspeed.zero.GatheredParameters([p]):
            assert torch.equal(p.detach(), full[n]), n
        assert torch.equal(m[:p.ds_numel].view(p.ds_shape), full[n]), n


# ----------------------------------------------------------------------------- rewards per token span
def test_a_span_maps_to_the_token_that_writes_its_last_character_exactly_for_multibyte_text():
    """Qwen3.5's tiny tokenizer is a byte-level BPE: the multiplication sign (2 bytes in UTF-8) is two tokens of one
    byte each. A span ending at it belongs to the token that writes its second byte; a span ending before it, to
    the token before; every character offset maps to the first token whose decoded prefix holds it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_of("qwen3_5")[0])
    text = "2 \u00d7 3 = 6 and 6 + 1 = 8"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for end in range(1, len(text) + 1):
        i = train.token_of(tok, ids, end)
        assert len(tok.decode(ids[:i + 1]).rstrip("\ufffd")) >= end > len(tok.decode(ids[:i]).rstrip("\ufffd")), end
    times = text.index("\u00d7")
    i = train.token_of(tok, ids, times + 1)
    assert tok.decode(ids[:i]).endswith("\ufffd") or len(tok.convert_ids_to_tokens(ids[i])) < 2   # the sign's last byte


def test_a_reward_may_score_spans_and_a_bad_span_fails_the_completion():
    """equation_steps scores each arithmetic step; compute_rewards takes a span reward's sum as its score and hands
    the spans on; a span outside the text (or not (int, int, number)) fails that completion, not the batch."""
    text = ["2 \u00d7 3 = 6 so 6 + 1 = 8", "no steps"]
    assert reward.equation_steps(text) == [[(0, 9, 1.0), (13, 22, -1.0)], []]
    spans = {}
    total, scores, failed = reward.compute_rewards(["equation_steps"], None, text, {}, spans)
    assert total == [0.0, 0.0] and spans == {"equation_steps": [[(0, 9, 1.0), (13, 22, -1.0)], []]}
    reward.REWARDS["bad_spans"] = lambda completions, **kw: [[(0, 99, 1.0)], [(0, 2, 0.5)]]
    try:
        total, _, failed = reward.compute_rewards(["bad_spans"], None, text, {})
    finally:
        del reward.REWARDS["bad_spans"]
    assert failed["bad_spans"] == [True, False] and total == [0.0, 0.5]


def test_process_rewards_give_each_token_its_steps_advantage(parts, tmp_path):
    """--advantage_estimator process with a reward per step: score puts each step's score at the token that ends it
    and accuracy's at the last token (reward_events); advantages are one per token, the normalised events at or
    after it (DeepSeekMath's process supervision, by hand here); the loss takes them per token."""
    run, samples = make_run(parts, tmp_path, reward_funcs=["equation_steps", "accuracy"], reward_weights=[1.0, 2.0],
                            advantage_estimator="process")
    tok = run.processor.tokenizer
    texts = ["1 + 1 = 2 red", "1 + 1 = 3 red", "blue", "1 + 1 = 2 blue"]
    groups = [train.Group(sample=samples[0], completions=[
        train.Completion(index=k, token_ids=tok(t, add_special_tokens=False)["input_ids"], sampler_logps=[], text=t,
                         finish_reason="stop") for k, t in enumerate(texts)])]
    train.score(run, groups)
    comps = groups[0].completions
    assert comps[0].spans == {"equation_steps": [(0, 9, 1.0)]} and comps[2].spans == {"equation_steps": []}
    solved = [c.rewards["accuracy"] for c in comps]
    assert comps[0].events == [(train.token_of(tok, comps[0].token_ids, 9), 1.0), (len(comps[0].token_ids) - 1,
                                                                                   2.0 * solved[0])]
    train.advantages(run, groups, {})
    scores = torch.tensor([s for c in comps for _, s in c.events], dtype=torch.float64)
    mean, std = scores.mean(), scores.std()
    for c in comps:
        want = torch.zeros(len(c.token_ids), dtype=torch.float64)
        for i, s in c.events:
            want[:i + 1] += (s - mean) / (std + 1e-4)
        assert torch.allclose(c.advantage.double(), want, atol=1e-6), (c.text, c.advantage, want)
    assert c.advantage.shape == (len(c.token_ids),) and c.advantage.unique().numel() >= 1
    for c in comps:
        c.old_logps = torch.zeros(len(c.token_ids))
    (b,) = train.micro_batches(run, groups)
    stats = learner.update(run, [b], train.Metrics())
    assert math.isfinite(stats["train/loss"])


# ----------------------------------------------------------------------------- a loss from another forward
def test_sft_loss_is_one_mean_over_the_gold_tokens_at_any_micro_batch_size(parts, tmp_path):
    """--sft_coef: the gold answers go through the policy in micro-batches of their own after the RL ones, in the
    same optimizer step, at temperature 1 whatever --temperature is (the forward's sampling a parameter); the loss is
    sft_coef x the mean NLL over every gold token, so micro-batches of 1 and of 4 give the same step and the same
    train/sft_nll. With --sft_coef 0 there is no second forward."""
    lengths = [[1, 2, 3, 4]] * 4
    zero = [[0.0] * G] * 4   # no RL signal: only the supervised loss moves the policy
    results = []
    for mb in (2, 8):
        run, samples = make_run(parts, tmp_path / str(mb), sft_coef=0.5, temperature=0.5,
                                per_device_train_batch_size=mb)
        groups = groups_of(samples, lengths, advantages=zero)
        batches = train.micro_batches(run, groups)
        for c in (c for g in groups for c in g.completions):
            c.old_logps = torch.zeros(len(c.token_ids))
        forwards = run.engine.forwards
        stats = learner.update(run, batches, train.Metrics(), extra=learner.sft_losses(run, groups))
        gold = learner.gold_batches(run, groups)
        assert run.engine.forwards - forwards == len(batches) + len(gold) and len(gold) == -(-len(groups) // mb)
        results.append((run.engine.module.w.detach().clone(), stats["train/sft_nll"]))
    (w1, nll1), (w2, nll2) = results
    assert torch.allclose(w1, w2, atol=1e-6) and nll1 == pytest.approx(nll2)
    allowed = torch.ones(len(w1), dtype=torch.bool)
    allowed[list(run.sampling.banned)] = False
    assert nll1 == pytest.approx(math.log(allowed.sum().item()))   # the policy's uniform start
    gold = [run.processor.tokenizer(g.sample["columns"]["solution"], add_special_tokens=False)["input_ids"][0]
            for g in groups]
    assert all(w1[t] > 0 for t in gold)   # the step raised each gold answer's token
    # at temperature 1 whatever --temperature is: the NLL of a non-uniform policy, by hand
    torch.manual_seed(0)
    with torch.no_grad():
        run.engine.module.w.copy_(torch.randn(len(w1)))
    seen = train.Metrics()
    (b, loss_fn), *_ = learner.sft_losses(run, groups)
    loss_fn(run, b, seen)
    logp = run.engine.module.w.detach().masked_fill(~allowed, -math.inf).log_softmax(-1)
    end = run.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    want = [-logp[t].item() for g in groups[:b["inputs"]["input_ids"].shape[0]] for t in
            run.processor.tokenizer(g.sample["columns"]["solution"], add_special_tokens=False)["input_ids"] + [end]]
    assert seen.means()["train/sft_nll"] == pytest.approx(sum(want) / len(want), rel=1e-5)
    assert seen.weights["train/sft_nll"] == len(want)
    run, samples = make_run(parts, tmp_path / "off")
    assert learner.sft_losses(run, groups_of(samples, lengths)) == []


# ----------------------------------------------------------------------------- an estimator's own options
def test_pass_at_k_gets_its_k_and_matches_the_papers_advantages(parts, tmp_path):
    """--advantage_estimator pass_at_k --pass_at_k 2: group_advantages receives k by name (grpo.ESTIMATORS lists the
    flags each estimator reads) and gives Chen et al.'s analytical advantages; --pass_at_k with another estimator is
    said to do nothing, and a k above the group is refused."""
    run, samples = make_run(parts, tmp_path, advantage_estimator="pass_at_k", pass_at_k=2)
    groups = groups_of(samples[:1], [[1] * G])
    for c, r in zip(groups[0].completions, [1.0, 0.0, 0.0, 0.0]):
        c.total = r
    train.advantages(run, groups, {})
    rho = 1 - math.comb(3, 2) / math.comb(4, 2)
    sigma = math.sqrt(rho * (1 - rho))
    want = [(1 - rho) / sigma] + [(1 - rho - math.comb(2, 1) / math.comb(3, 1)) / sigma] * 3
    assert [c.advantage for c in groups[0].completions] == pytest.approx(want)
    assert want[0] > 0 > want[1]
    k4 = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "pass_at_k", pass_at_k=4)[0]
    assert torch.allclose(k4, torch.zeros(4))   # k = G: the group's pass@4 is 1 whatever each answer did
    (note,) = train.inert_flags(train.parse_args(["--pass_at_k", "2"]))
    assert note.startswith("--pass_at_k acts only with --advantage_estimator pass_at_k")
    with pytest.raises(SystemExit, match="--pass_at_k 9"):
        train.check_args(train.parse_args(["--advantage_estimator", "pass_at_k", "--pass_at_k", "9",
                                           "--num_generations", "8"]), 1)


# ----------------------------------------------------------------------------- the dynamic-sampling bug
def test_dynamic_sampling_judges_a_groups_spread_over_its_scored_completions(parts, tmp_path):
    """A group whose scored completions all agree, beside one no reward could score (its total a placeholder 0),
    carries no signal: --dynamic_sampling drops it (it kept it before: dynamic/dropped_count 0 while
    reward/zero_spread_groups counted it)."""
    run, samples = make_run(parts, tmp_path, dynamic_sampling=True, max_num_gen_batches=1)
    groups = groups_of(samples, [[1] * G] * len(samples))
    for g in groups:
        for c, r in zip(g.completions, [1.0, 1.0, 1.0, 0.0]):
            c.total = r
    groups[0].completions[3].failed = {"accuracy": True}   # unscored: its 0 is no score
    m = {}
    kept = train.filter_groups(run, groups, 1, m)
    assert m["dynamic/dropped_count"] == 1 and groups[0] not in kept[:len(samples) - 1]


# ----------------------------------------------------------------------------- the temperature schedule
def test_temperature_end_reaches_vllm_and_the_trainer(parts, tmp_path):
    """--temperature_end: each step's temperature, linear from --temperature at step 1 to the end at --max_steps, is
    the one Sampling record's: vLLM's sampling parameters and the trainer's log-probs use it."""
    run, samples = make_run(parts, tmp_path, temperature=1.0, temperature_end=0.5, max_steps=3)
    assert [train.temperature_at(run.args, s) for s in (1, 2, 3)] == pytest.approx([1.0, 0.75, 0.5])
    seen = []
    for step in (1, 3):
        train.train_step(run, step, train.Metrics())
        seen.append((run.llm.params[-1][0].temperature, run.sampling.temperature))
    assert seen == [(1.0, 1.0), (0.5, 0.5)]
    assert train.temperature_at(argparse.Namespace(temperature=0.7, temperature_end=None, max_steps=3), 3) == 0.7


# ----------------------------------------------------------------------------- the changes together, resumed
@pytest.mark.launch
def test_the_paper_changes_run_and_resume_exactly(tmp_path):
    """Two ranks with --ref_ema, --sft_coef, --temperature_end and pass@k advantages, the shipped ZeRO-3 persistence
    threshold: three steps, a checkpoint each
    (the moving reference's parts in it); the folder copied without its last checkpoint and relaunched resumes from
    step 2 (the reference's own state loaded) and logs step 3 bitwise as the uninterrupted run did."""
    import shutil

    from test_resume import SAME

    from conftest import FAST, launch
    flags = [*FAST, "--ref_ema", "0.9", "--sft_coef", "0.1", "--temperature_end", "0.7", "--advantage_estimator",
             "pass_at_k", "--pass_at_k", "2", "--max_steps", "3", "--save_steps", "1", "--val_freq", "0",
             "--no-save_final_model",
             # ds_zero3.json's own persistence threshold (conftest's launches partition every parameter): the tiny
             # model's parameters are then all kept whole, the case model.update_params exists for
             "--ds_set", "zero_optimization.stage3_param_persistence_threshold=100000"]
    whole, log = launch(tmp_path / "whole", *flags)
    assert sorted(f for f in os.listdir(tmp_path / "whole" / "checkpoint-2") if f.startswith("reference")) == \
        ["reference0.pt", "reference1.pt"]
    # the reference follows the policy: its parts differ from one step to the next (a --ref_ema that did nothing
    # would save the same reference at every checkpoint, and resume it as exactly)
    parts = [torch.load(tmp_path / "whole" / f"checkpoint-{s}" / "reference0.pt", weights_only=True)["parts"]
             for s in (2, 3)]
    assert any(not torch.equal(a, b) for a, b in zip(*parts))
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed",
                    ignore=shutil.ignore_patterns("checkpoint-3", ".owner.json"))
    resumed, log = launch(tmp_path / "resumed", *flags)
    assert "[resume] from" in log and "checkpoint-2" in log
    last = [r for r in whole if r["step"] == 3 and "reward/mean" in r]
    again = [r for r in resumed if r["step"] == 3 and "reward/mean" in r]
    assert len(last) == len(again) == 1
    for k in (*SAME, "train/sft_nll", "sampling/temperature"):
        assert last[0].get(k) == again[0].get(k), (k, last[0].get(k), again[0].get(k))
    assert last[0]["sampling/temperature"] == pytest.approx(0.7) and last[0]["train/sft_nll"] > 0


def test_the_plan_counts_the_ema_references_fp32_masters():
    """--ref_ema beside a bf16 reference keeps an fp32 master of each of its partitions (startup.fp32_masters): 4 bytes
    a parameter over the ranks, on the reference's device (the GPU, or host RAM with --ref_offload)."""
    import planner
    cluster = planner.Cluster(gpus_per_node=8, nodes=1, gpu_gb=80, host_gb=1024, cuda=True)
    s = planner.model_shape("qwen2.5-vl-7b")
    base = ["--model", "qwen2.5-vl-7b", "--bf16", "--beta", "0.04", "--no-ref_offload"]
    key = "reference's fp32 masters (--ref_ema)"
    gpu = planner.plan(train.parse_args(base + ["--ref_ema", "0.99"]), cluster, s)["phases"]["update"]["gpu"]
    assert gpu[key] == pytest.approx(s["n"] * 4 / 8)
    assert key not in planner.plan(train.parse_args(base), cluster, s)["phases"]["update"]["gpu"]


# ----------------------------------------------------------------------------- a fork's own state, after the step
def kl_step(parts, tmp_path, state=None, **flags):
    """One update with beta > 0 (and run.state `state`), a reference that prefers red -> its stats."""
    from test_step import FakeEngine
    tok = parts[0].tokenizer
    run, samples = make_run(parts, tmp_path, **{"beta": 0.1, **flags})
    run.state.update(state or {})
    run.ref_engine = FakeEngine(len(tok), 1)
    run.ref_engine.module.w.data[tok.convert_tokens_to_ids("red")] = 2.0
    groups = train.rollout_groups(run, samples, step=1)
    train.score(run, groups)
    batches = train.micro_batches(run, groups)
    learner.old_ref_logps(run, batches)
    train.advantages(run, groups, train.Metrics())
    return learner.update(run, batches, train.Metrics())


def test_the_kl_controller_moves_beta_by_zieglers_rule_and_the_loss_uses_it(parts, tmp_path):
    """--kl_target 0.01 --kl_horizon 32 (16 completions a step): after_step reads the step's reduced train/kl and
    multiplies beta by 1 + clip(kl / target - 1, -0.2, 0.2) x 16 / 32 (Ziegler et al. 2019), starting from --beta,
    in run.state. The update's loss uses that beta, logged as train/beta: its loss is the loss of a run whose --beta
    is that value. Without --kl_target beta stays --beta and nothing is logged."""
    run, _ = make_run(parts, tmp_path / "c", beta=0.1, kl_target=0.01, kl_horizon=32)
    train.after_step(run, 1, {"train/kl": 0.0})                   # error -1, clipped to -0.2
    assert run.state["beta"] == pytest.approx(0.1 * (1 - 0.2 * 16 / 32))
    train.after_step(run, 2, {"train/kl": 0.0105})                # error 0.05
    assert run.state["beta"] == pytest.approx(0.1 * 0.9 * (1 + 0.05 * 16 / 32))
    beta = run.state["beta"]
    on = kl_step(parts, tmp_path / "on", state=run.state, kl_target=0.01, kl_horizon=32)
    same = kl_step(parts, tmp_path / "same", beta=beta)
    off = kl_step(parts, tmp_path / "off")
    assert on["train/beta"] == beta and on["train/kl"] > 0
    assert on["train/loss"] == same["train/loss"] != off["train/loss"] and "train/beta" not in off
    run, _ = make_run(parts, tmp_path / "none", beta=0.1)
    train.after_step(run, 1, {"train/kl": 0.0})
    assert run.state == {} and learner.kl_beta(run) == 0.1
    with pytest.raises(SystemExit, match="--kl_target 0.1: a KL >= 0, with --beta > 0"):
        train.check_args(train.parse_args(["--kl_target", "0.1", "--beta", "0"]), 1)
    with pytest.raises(SystemExit, match="--kl_horizon 10: beta x= 1 - 0.2 x 64 completions"):
        train.check_args(train.parse_args(["--kl_target", "0.1", "--kl_horizon", "10", "--beta", "0.04",
                                           "--rollout_batch_size", "4", "--num_generations", "16"]), 1)


def test_the_pass_rate_curriculum_draws_the_prompts_still_being_learned_more_often(parts, tmp_path):
    """--curriculum pass_rate: score counts each prompt's passing completions (total >= 1) over every rank's groups
    into run.state; select_prompts then passes over three in four of the prompts whose pass rate is 0 or 1, so that
    one still being learned (or not yet seen) comes about four times as often; with every prompt settled it still
    gives its prompts, passing over at most 3 x per_rank a call."""
    from test_step import FakeStream
    run, samples = make_run(parts, tmp_path, curriculum="pass_rate")
    run.stream = FakeStream(samples)
    groups = train.rollout_groups(run, train.select_prompts(run, step=1), step=1)
    train.score(run, groups)
    assert run.state["pass_rate"] == {g.sample["id"]: [sum(t >= 1 for t in g.totals), G] for g in groups}
    ids = [s["id"] for s in samples]
    run.state["pass_rate"] = {ids[0]: [4, 4], ids[1]: [0, 4], ids[2]: [2, 4]}   # ids[3]: not seen yet
    seen = {i: 0 for i in ids}
    for step in range(2, 202):
        for s in train.select_prompts(run, step):
            seen[s["id"]] += 1
    print(seen)
    assert min(seen[ids[2]], seen[ids[3]]) > 3 * max(seen[ids[0]], seen[ids[1]]) > 0 and run.passed_over > 0
    run.state["pass_rate"], run.passed_over = {i: [0, 4] for i in ids}, 0
    assert len(train.select_prompts(run, 3)) == run.per_rank and 0 < run.passed_over <= 3 * run.per_rank
    plain, _ = make_run(parts, tmp_path / "off")
    plain.stream = FakeStream(samples)
    assert [s["id"] for s in train.select_prompts(plain, 1)] == ids and plain.state == {}


def test_a_reference_reset_makes_the_reference_the_policy_every_n_steps(parts, tmp_path):
    """--ref_reset_steps 2 (ProRL): at steps 2 and 4 the reference becomes the policy exactly, at step 3 it stays;
    the moving reference then goes into each checkpoint (run.moving_reference, which only --ref_ema set before, so a
    reset reference was lost at a resume)."""
    from test_step import FakeEngine
    run, _ = make_run(parts, tmp_path, beta=0.1, ref_reset_steps=2)
    run.ref_engine = FakeEngine(8, 1)
    run.engine.module.w = torch.nn.Parameter(torch.arange(8.0))
    seen = []
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            run.engine.module.w.add_(1.0)
        learner.reference_step(run, step)
        seen.append(torch.equal(run.ref_engine.module.w, run.engine.module.w))
    assert seen == [False, True, False, True]
    assert run.moving_reference == (run.ref_engine, None)
    assert make_run(parts, tmp_path / "off", beta=0.1)[0].moving_reference is None
    with pytest.raises(SystemExit, match="--ref_reset_steps 2: steps >= 0, with --beta > 0"):
        train.check_args(train.parse_args(["--ref_reset_steps", "2", "--beta", "0"]), 1)


@pytest.mark.launch
def test_a_forks_state_resumes_exactly_kl_controller_reference_resets_curriculum_and_updates(tmp_path, tiny_default):
    """Two ranks, --kl_target (beta in run.state), --ref_reset_steps 2, --curriculum pass_rate on 12 rows (each prompt
    comes back every step), 4 steps, checkpoints 2 and 4. The folder without checkpoint-4, relaunched with another
    --beta (said, not refused: the controller's beta resumes), trains steps 3 and 4 bitwise as the unbroken run: the
    same beta, the same prompts (the same passed over), the same KL to the reference reset at step 2 (0 at step 3:
    lost at a resume before, when only --ref_ema saved the reference), and checkpoint-4 holds the same run.state and
    4 updates (0 restarted at a resume before)."""
    import json
    import shutil

    from test_resume import SAME

    from conftest import FAST, launch
    small = tmp_path / "train.jsonl"
    small.write_text("".join(open(tiny_default[1]).readlines()[:12]))
    flags = [*FAST, "--kl_target", "0.001", "--kl_horizon", "64", "--ref_reset_steps", "2", "--curriculum",
             "pass_rate", "--train_data", str(small), "--image_root", os.path.dirname(tiny_default[1]),
             "--max_steps", "4", "--save_steps", "2", "--val_freq", "0", "--no-save_final_model"]
    whole, _ = launch(tmp_path / "whole", *flags)
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed", ignore=shutil.ignore_patterns("checkpoint-4",
                                                                                             ".owner.json"))
    resumed, log = launch(tmp_path / "resumed", *flags, "--beta", "0.08")
    assert "[resume] --beta 0.04 -> 0.08: --kl_target's beta goes on from the checkpoint's" in log, log[-3000:]
    steps = lambda rows: [r for r in rows if "reward/mean" in r and r["step"] > 2]   # noqa: E731
    assert len(steps(whole)) == len(steps(resumed)) == 2
    for a, b in zip(steps(whole), steps(resumed)):
        for k in (*SAME, "train/beta", "data/passed_over"):
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))
    betas = [r["train/beta"] for r in whole if "train/beta" in r]
    assert betas[0] == 0.04 and len(set(betas)) == 4                      # the controller moved it every step
    assert steps(whole)[0]["train/kl"] == 0.0 < steps(whole)[1]["train/kl"]   # step 3: the reference reset at 2
    assert sum(r["data/passed_over"] for r in whole if "data/passed_over" in r) > 0
    for run in ("whole", "resumed"):
        ckpt = tmp_path / run / "checkpoint-4"
        assert json.load(open(ckpt / "trainer_state.json"))["updates"] == 4, run
    a, b = (torch.load(tmp_path / run / "checkpoint-4" / "state.pt", weights_only=True) for run in ("whole", "resumed"))
    assert a == b and set(a) == {"beta", "pass_rate"} and a["beta"] != 0.04
    for r in (0, 1):   # the same data position and rewards history
        a, b = (checkpoint.rank_state(str(tmp_path / run / "checkpoint-4"), r)["stream"]
                for run in ("whole", "resumed"))
        assert a == b
