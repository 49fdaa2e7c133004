"""The update phase, and what it reads: the policy's (and the reference's) log-probs of the completions, the RL loss
of each micro-batch, losses from other forwards in the same optimizer step (--sft_coef), the optimizer steps, and a
reference that moves (--ref_ema). train.py's step calls old_ref_logps and update; their micro-batches are a layout
over the completions' records (train.micro_batches), and every value read or written lives on a record.

Every rank makes the same forwards (in_step): under ZeRO-3 each forward and each lm_head call gathers parameters.
"""
import torch
import torch.distributed as dist

import data
import grpo
import model
import ranks


def completion_logps(engine, batch, run, with_entropy=False, with_kept=False, sampling=None):
    """Per-token statistics of one micro-batch's completions (policy or reference engine) under `sampling` (by
    default run.sampling, the distribution vLLM samples from), from one pass over the vocabulary -> grpo.TokenStats,
    each (B, C): logps; with `with_kept` (and top-k or top-p) the log of the mass the sampler's truncation keeps;
    with `with_entropy` the entropy, with a gradient only where the loss takes it (--entropy_coef; a logged one with its
    graph held 9 B per token and vocabulary entry: grpo.token_logps)."""
    return engine(**{k: v.to(run.device) for k, v in batch["inputs"].items()}, sampling=sampling or run.sampling,
                  chunks=batch["chunks"], vision_calls=batch.get("vision_calls", 1), with_entropy=with_entropy,
                  with_kept=with_kept, entropy_grad=bool(run.args.entropy_coef))


def to_rows(values, device):
    """Per-completion values of one micro-batch, [(n_i,)], -> (B, C) right-aligned as data.collate lays
    completions out (C: the longest n_i); 0 where a row has no token."""
    C = max(max((len(v) for v in values), default=1), 1)
    out = torch.zeros(len(values), C, device=device)
    for j, v in enumerate(values):
        if len(v):
            out[j, C - len(v):] = torch.as_tensor(v, dtype=torch.float32, device=device)
    return out


def from_rows(batch, name, t):
    """(B, C) right-aligned values -> each completion's record of the micro-batch, as `name` ((n,), on the CPU)."""
    C = t.shape[1]
    for j, c in enumerate(batch["completions"]):
        setattr(c, name, t[j, C - len(c.token_ids):].detach().float().cpu())


def in_step(run, batches, what):
    """Every rank makes the same forwards, whatever its micro-batches hold: under ZeRO-3 each forward and each
    lm_head call gathers parameters. The count of micro-batches (`what`) is checked here, before it could hang
    (ranks.check_same), and each micro-batch takes the most log-prob chunks any rank needs at its position
    (grpo.token_logps splits fewer tokens as many times) and the most vision-tower runs (one for images, one for
    videos; model.logps_forward makes up the rest with dummy runs). Any micro-batches a step runs through the policy
    come through here: the RL ones (micro_batches), another forward's (gold_batches). -> batches."""
    ranks.check_same(what, [len(batches)], run.device)
    chunks = torch.tensor([[-(-b["inputs"]["completion_mask"].numel() // run.args.logprob_chunk_tokens),
                            max(1, ("pixel_values" in b["inputs"]) + ("pixel_values_videos" in b["inputs"]))]
                           for b in batches], device=run.device).reshape(-1, 2)
    dist.all_reduce(chunks, op=dist.ReduceOp.MAX)
    for b, (n, calls) in zip(batches, chunks.tolist()):
        b["chunks"], b["vision_calls"] = n, calls
    return batches


def in_loss(b):
    """(B, C) the tokens of micro-batch b that the loss takes: its completions' tokens (completion_mask) of every
    completion some reward scored (the records say; a completion no reward could score is out of the loss, and is
    known only once the rewards are, after the layout: the judge's answers come late)."""
    return b["inputs"]["completion_mask"] * torch.tensor([[float(c.scored)] for c in b["completions"]])


def old_ref_logps(run, batches):
    """Before the update, without grad, onto each completion's record: pi_old (the trainer at the sampler's
    weights) where it is needed before the first optimizer step (--num_iterations > 1; --kl_in_reward), and
    the reference model's log-probs (beta > 0; under LoRA the policy with its adapter off). With one
    iteration and no --kl_in_reward, update's own first forward is pi_old: no extra pass."""
    args = run.args
    with torch.no_grad():
        for b in batches:
            if args.num_iterations > 1 or args.kl_in_reward:
                from_rows(b, "old_logps", completion_logps(run.engine, b, run).logps)
            if run.ref_engine is not None:
                from_rows(b, "ref_logps", completion_logps(run.ref_engine, b, run).logps)
            elif args.beta > 0:   # LoRA: the base model is the policy with its adapter off
                with model.adapter_off(run.engine):
                    from_rows(b, "ref_logps", completion_logps(run.engine, b, run).logps)


def sampler_gap(run, b, ts, cmask, m, add):
    """The first update iteration runs at the sampler's weights: the trainer's log-probs of the distribution
    the sampler drew from (truncated as it was: logps - log_kept) against vLLM's. Logged as
    rollout/logp_diff_*; the sampler correction's weights go onto each completion's record."""
    args = run.args
    sampled = ts.logps.detach() - (ts.log_kept if ts.log_kept is not None else 0.0)                 # (B, C)
    sampler = to_rows([c.sampler_logps for c in b["completions"]], run.device)                    # (B, C)
    diff = (sampled - sampler).abs() * cmask
    m["rollout/logp_diff_max"] = ranks.Max(max(m.get("rollout/logp_diff_max", 0.0), diff.max().item()))
    add("rollout/logp_diff_mean", diff.sum().item() / max(cmask.sum().item(), 1), cmask.sum().item())
    weights, im = grpo.sampler_correction(sampled, sampler, cmask, args.vllm_importance_sampling_correction,
                                          args.vllm_importance_sampling_cap)
    if weights is not None:
        from_rows(b, "is_weights", weights.expand_as(cmask))
    if im:
        m["sampling/is_ratio_min"] = ranks.Min(min(m.get("sampling/is_ratio_min", im["is_ratio_min"]), im["is_ratio_min"]))
        m["sampling/is_ratio_max"] = ranks.Max(max(m.get("sampling/is_ratio_max", im["is_ratio_max"]), im["is_ratio_max"]))
        add("sampling/is_ratio_mean", im["is_ratio_mean"], im["is_count"])
        add("sampling/is_capped_frac", im["is_capped_frac"], im["is_count"])


def router_loss(run, ts, n_batches, add, loads):
    """A mixture-of-experts forward (ts.router, model.RouterStats): run.aux_loss_coef x its router's load-balancing
    loss, scaled so that over the step's micro-batches (DeepSpeed divides each loss by gas) it adds the coefficient x
    their mean; train/aux_loss, that mean, is logged whether or not it trains, and the tokens per expert go to
    `loads`. 0 for a dense model."""
    if ts.router is None:
        return 0.0
    add("train/aux_loss", ts.router.aux_loss.item(), 1)
    loads.append(ts.router.load)
    return run.aux_loss_coef * run.gas / n_batches * ts.router.aux_loss if run.aux_loss_coef else 0.0


def expert_shares(loads):
    """The experts' load balance of this rank's update: each sparse layer's share of top-k assignments per expert
    (1/E each when even), the largest and the smallest over layers and experts, reduced over ranks as such."""
    if not loads:
        return {}
    share = sum(loads) / sum(loads).sum(dim=-1, keepdim=True)                             # (L, E)
    return {"train/expert_share_max": ranks.Max(share.max().item()),
            "train/expert_share_min": ranks.Min(share.min().item())}


def update(run, batches, m, extra=()):
    """num_iterations optimizer steps over the rollout batch, micro-batch by micro-batch, reading each
    completion's values from its record. `extra`: [(micro-batch, loss function)] from other forwards (sft_losses:
    --sft_coef's gold answers), run after the RL micro-batches in the same optimizer step, every iteration; each
    loss_fn(run, batch, add) returns its loss normalised as the RL loss is (over every rank's tokens, / (world x gas)),
    and logs with add. -> stats, each a weighted mean over the whole rollout batch and all ranks (ranks.Mean: the
    same number at any micro-batch size or rank count), except loss (the objective DeepSpeed differentiates) and
    lr. Every per-token mean grpo_loss reports is logged as train/<name>, token-weighted (a new one is one line in
    grpo_loss's metrics)."""
    args, engine = run.args, run.engine
    counts = torch.tensor([sum(in_loss(b).sum().item() for b in batches),
                           sum(c.scored for b in batches for c in b["completions"])], dtype=torch.float64, device=run.device)
    dist.all_reduce(counts)
    n_tokens, n_seqs = counts.tolist()   # over all ranks, in the loss
    # Per micro-batch normaliser: DeepSpeed divides each micro-batch loss by gas and averages ranks,
    # so the sum over micro-batches is the whole batch's objective.
    norm = {"token": n_tokens, "sequence": n_seqs, "dr_grpo": n_seqs * args.max_completion_length}[args.loss_agg]
    norm = norm / (run.world * run.gas)   # gas: DeepSpeed's constant divisor, however many micro-batches there are
    engine.train()
    loss_sum, lrs = 0.0, []
    sums, weights = {}, {}   # {logged name: sum of value x weight}, {logged name: sum of weights}
    loads = []               # mixture-of-experts: each forward's tokens per expert and layer

    def add(name, value, weight):
        sums[name], weights[name] = sums.get(name, 0.0) + value * weight, weights.get(name, 0.0) + weight
    for it in range(args.num_iterations):
        work = [(b, None) for b in batches] + list(extra)
        for j, (b, loss_fn) in enumerate(work):
            loss = loss_fn(run, b, add) if loss_fn else policy_loss(run, b, it, norm, m, add, loads, len(batches))
            engine.set_gradient_accumulation_boundary(j == len(work) - 1)   # the step's micro-batch count, not gas
            engine.backward(loss)
            if j == len(work) - 1:
                lrs.append(engine.get_lr()[0])   # the rate of the optimizer step the next call takes
            engine.step()   # DeepSpeed steps the optimizer only at the gradient accumulation boundary
            loss_sum += loss.item() / (run.gas * args.num_iterations)   # micro-batch losses / gas, summed
    grad_norm = engine.get_global_grad_norm()
    stats = {k: ranks.Mean(sums[k] / weights[k] if weights[k] else 0.0, weights[k]) for k in sorted(sums)}
    stats.update({"train/loss": loss_sum, "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                  "train/lr": lrs[-1], **expert_shares(loads)})
    return stats


def policy_loss(run, b, it, norm, m, add, loads, n_batches):
    """The RL loss of one micro-batch (grpo.grpo_loss) in iteration `it`, from the policy's forward and each
    completion's record; the first iteration runs at the sampler's weights and records pi_old (one iteration) and the
    sampler gap. A completion's advantage is a number, or one per token (process supervision)."""
    args, comps = run.args, b["completions"]
    beta = 0.0 if args.kl_in_reward else args.beta   # --kl_in_reward: the KL is in the advantages already
    b["inputs"].update(model.routing_replay_inputs(b["inputs"], [c.routed_experts for c in comps]))   # replay
    ts = completion_logps(run.engine, b, run, with_entropy=True, with_kept=it == 0)   # (B, C) each
    cmask = in_loss(b).to(run.device)                                                 # (B, C)
    if it == 0:   # the sampler's weights (no optimizer step yet)
        attn = b["inputs"]["attention_mask"]
        add("update/padded_frac", 1 - attn.sum().item() / attn.numel(), attn.numel())   # of the tokens processed
        if comps[0].old_logps is None:   # one iteration: this forward is pi_old
            from_rows(b, "old_logps", ts.logps)
        sampler_gap(run, b, ts, cmask, m, add)
    rows = lambda name: to_rows([getattr(c, name) for c in comps], run.device)   # noqa: E731  (B, C)
    per_token = torch.is_tensor(comps[0].advantage)
    loss, lm = grpo.grpo_loss(
        logps=ts.logps, old_logps=rows("old_logps"),
        advantages=rows("advantage") if per_token else torch.tensor([c.advantage for c in comps], device=run.device),
        mask=cmask, epsilon=args.epsilon, epsilon_high=args.epsilon_high, beta=beta,
        ref_logps=rows("ref_logps") if beta > 0 else None, loss_agg=args.loss_agg, norm=norm,
        importance_sampling_level=args.importance_sampling_level,
        is_weights=rows("is_weights") if comps[0].is_weights is not None else None,
        entropy=ts.entropy, entropy_coef=args.entropy_coef)
    for k, v in lm.items():
        if k != "tokens":
            add(f"train/{k}", v, lm["tokens"])
    return loss + router_loss(run, ts, n_batches, add, loads)   # mixture-of-experts; 0 for a dense model


def gold_batches(run, groups):
    """--sft_coef: each group's gold answer, its sample's "solution" as the model would write it (the text, then the
    end of its turn), as a completion of the group's prompt, in micro-batches of --per_device_train_batch_size (a
    group without one: an empty completion, out of the loss). Every rank holds as many groups, so as many
    micro-batches (in_step checks it and evens out their chunks and vision-tower runs)."""
    tok, size = run.processor.tokenizer, run.args.per_device_train_batch_size
    end = tok.convert_tokens_to_ids("<|im_end|>")   # the end of a turn in every Qwen chat template
    gold = [tok(str(s), add_special_tokens=False)["input_ids"] + [end] if (s := g.sample["columns"].get("solution"))
            is not None else [] for g in groups]
    batches = [dict(inputs=data.collate([g.sample for g in groups[i:i + size]], gold[i:i + size], run.pad_id,
                                        run.sampling.banned), completions=[]) for i in range(0, len(groups), size)]
    return in_step(run, batches, "--sft_coef's micro-batches per step")


def sft_losses(run, groups):
    """--sft_coef (a supervised loss on the data's gold answers beside the RL loss, from a second forward): the
    extra losses update() runs, [(gold micro-batch, loss function)]; the loss is sft_coef x the mean negative
    log-likelihood over every rank's gold tokens, of the model's own distribution (temperature 1, untruncated: the
    forward's sampling is a parameter), logged as train/sft_nll."""
    if not run.args.sft_coef:
        return []
    batches = gold_batches(run, groups)
    tokens = torch.tensor(float(sum(b["inputs"]["completion_mask"].sum().item() for b in batches)), device=run.device)
    dist.all_reduce(tokens)
    norm = max(tokens.item(), 1.0) / (run.world * run.gas)   # as update's: DeepSpeed divides by gas, averages ranks

    def loss_fn(run, b, add):
        ts = completion_logps(run.engine, b, run, sampling=grpo.Sampling(banned=run.sampling.banned))   # (B, C)
        mask = b["inputs"]["completion_mask"].to(run.device)
        nll = -(ts.logps * mask).sum()
        add("train/sft_nll", nll.item() / max(mask.sum().item(), 1.0), mask.sum().item())
        return run.args.sft_coef * nll / norm
    return [(b, loss_fn) for b in batches]


def reference_step(run):
    """--ref_ema: after the update, the reference follows the policy, ref = decay x ref + (1 - decay) x policy,
    parameter by parameter (model.update_params: right whatever ZeRO-3 does with each; in fp32 beside a bf16
    reference, run.ref_masters, or bf16 would round the small steps away). A reference reset every N steps is the
    same call with `lambda r, p, *_: r.copy_(p)`. The reference's state is saved in each checkpoint (checkpoint.py)."""
    if not run.args.ref_ema:
        return
    decay = run.args.ref_ema
    policy = dict(run.engine.module.named_parameters())
    named = list(run.ref_engine.module.named_parameters())
    masters = run.ref_masters or [None] * len(named)

    def ema(r, p, master=None):
        if master is None:
            r.lerp_(p.to(r.dtype), 1 - decay)
        else:
            r.copy_(master.lerp_(p.float(), 1 - decay))
    model.update_params([p for _, p in named], [[policy[n]] + ([mm] if mm is not None else []) for (n, _), mm in
                                                 zip(named, masters)], ema)
