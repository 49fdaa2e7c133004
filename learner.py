"""The update phase: the RL loss of each micro-batch, losses from other forwards in the same optimizer step
(--sft_coef), the optimizer steps, a reference that moves (--ref_ema, --ref_reset_steps), and the log-probs they
read. train.py's step calls old_ref_logps and update; its micro-batches (train.micro_batches) are a layout over the
completions' records, and every value read or written lives on a record. Every rank makes the same forwards
(in_step), since under ZeRO-3 each forward and each lm_head call gathers parameters.
"""
import torch
import torch.distributed as dist

import data
import grpo
import model
import ranks


# ----------------------------------------------------------------------------- before the update
def old_ref_logps(run, batches):
    """Onto the records, without grad: pi_old if needed before the first optimizer step (else update's first forward
    is it) and the reference's log-probs."""
    args = run.args
    with torch.no_grad():
        for b in batches:
            # pi_old before the advantages: with --kl_in_reward and --teacher_model they read it
            if args.num_iterations > 1 or args.kl_in_reward or args.teacher_model:
                from_rows(b, "old_logps", completion_logps(run.engine, b, run).logps)
            if run.ref_engine is not None:
                from_rows(b, "ref_logps", completion_logps(run.ref_engine, b, run).logps)
            elif args.beta > 0:   # LoRA: the base model is the policy with its adapter off
                with model.adapter_off(run.engine):
                    from_rows(b, "ref_logps", completion_logps(run.engine, b, run).logps)


# ----------------------------------------------------------------------------- a second model in the step
def frozen_logps(run, batches):
    """--teacher_model's and --reward_model's log-probs of the completions onto the records (teacher_logps,
    scorer_logps), without grad, over the policy's micro-batches (its collated inputs and images): the teacher's of
    the sampled distribution as pi_old's, the reward model's at temperature 1. They run before update adds the routing
    replay's experts to the inputs (policy_forward): vLLM's experts are the policy's."""
    plain = grpo.Sampling(banned=run.sampling.banned)
    with torch.no_grad():
        for b in batches:
            for engine, name, sampling in ((run.teacher_engine, "teacher_logps", None),
                                           (run.reward_engine, "scorer_logps", plain)):
                if engine is not None:
                    from_rows(b, name, completion_logps(engine, b, run, sampling=sampling).logps)


def distill(run, comps, m):
    """--teacher_model: each completion's advantage becomes (n,), plus teacher_coef x (teacher - pi_old log-prob) per
    token, detached: a sampled reverse KL to the teacher as a per-token reward. Logs train/teacher_kl, the mean of
    pi_old - teacher over the scored completions' trained tokens."""
    if not run.args.teacher_model:
        return
    for c in comps:
        gap = c.teacher_logps - c.old_logps                                             # (n,)
        c.advantage = torch.as_tensor(c.advantage, dtype=torch.float32) + run.args.teacher_coef * gap
        if c.scored:
            w = torch.ones_like(gap) if c.mask is None else torch.as_tensor(c.mask, dtype=torch.float32)   # (n,)
            m.add("train/teacher_kl", -(gap * w).sum().item() / max(w.sum().item(), 1.0), w.sum().item())


# ----------------------------------------------------------------------------- the update
def update(run, batches, m, extra=()):
    """num_iterations optimizer steps over the step's micro-batches, then `extra`'s [(micro-batch, loss_fn(run,
    batch, m))] from other forwards (sft_losses), in the same optimizer step. Logs into m (train.Metrics) -> the
    update's stats: weighted means over the whole batch and all ranks, and the loss, grad norm and learning rate."""
    args, engine = run.args, run.engine
    norm = loss_norm(run, batches)
    beta = 0.0 if args.kl_in_reward else kl_beta(run)   # --kl_in_reward: the KL is in the advantages already
    engine.train()
    loss_sum, lrs = 0.0, []
    for it in range(args.num_iterations):
        work = [(b, None) for b in batches] + list(extra)
        for j, (b, loss_fn) in enumerate(work):
            if loss_fn is None:   # an RL micro-batch
                ts, mask = policy_forward(run, b, it, m)                                     # (B, C) each
                loss, lm = grpo.grpo_loss(
                    ts.logps, **from_records(run, b["completions"], beta), mask=mask, epsilon=args.epsilon,
                    epsilon_high=args.epsilon_high, beta=beta, loss_agg=args.loss_agg, norm=norm,
                    importance_sampling_level=args.importance_sampling_level, entropy=ts.entropy,
                    entropy_coef=args.entropy_coef,   # TRL's dapo and dr_grpo name an aggregation only
                    loss_type=args.loss_type if args.loss_type in grpo.LOSSES else "grpo")
                for k, v in lm.items():
                    if k != "tokens":
                        m.add(f"train/{k}", v, lm["tokens"])   # token-weighted
                loss = loss + router_loss(run, ts, len(batches), m)   # mixture-of-experts; 0 for a dense model
            else:
                loss = loss_fn(run, b, m)
            last = j == len(work) - 1
            engine.set_gradient_accumulation_boundary(last)   # the step's micro-batch count, not gas
            engine.backward(loss)
            if last:
                lrs.append(engine.get_lr()[0])   # the rate of the optimizer step the next call takes
            engine.step()   # DeepSpeed steps the optimizer only at the gradient accumulation boundary
            loss_sum += loss.item() / (run.gas * args.num_iterations)   # micro-batch losses / gas, summed
    grad_norm = engine.get_global_grad_norm()
    return {**m.means(), "train/loss": loss_sum, "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
            "train/lr": lrs[-1], **expert_shares(m.loads), **({"train/beta": beta} if args.kl_target else {})}


def kl_beta(run):
    """The KL coefficient of this step: --kl_target's controller's (run.state["beta"], from --beta at the start) or
    --beta."""
    return run.state.get("beta", run.args.beta) if run.args.kl_target else run.args.beta


def loss_norm(run, batches):
    """The micro-batch losses' divisor: the tokens (or sequences) in the loss over all ranks / (world x gas)."""
    args = run.args
    counts = torch.tensor([sum(in_loss(b).sum().item() for b in batches),
                           sum(c.scored for b in batches for c in b["completions"])], dtype=torch.float64,
                          device=run.device)
    dist.all_reduce(counts)
    n_tokens, n_seqs = counts.tolist()   # over all ranks, in the loss
    norm = {"token": n_tokens, "sequence": n_seqs, "dr_grpo": n_seqs * args.max_completion_length}[args.loss_agg]
    return norm / (run.world * run.gas)   # gas: DeepSpeed's constant divisor, however many micro-batches there are


def policy_forward(run, b, it, m):
    """The policy's forward over micro-batch b -> (grpo.TokenStats, the loss's mask), each (B, C); at iteration 0
    also pi_old and the sampler gap."""
    comps = b["completions"]
    b["inputs"].update(model.routing_replay_inputs(b["inputs"], [c.routed_experts for c in comps],
                                                   run.engine.module))   # replay; a bad record stops every rank
    ts = completion_logps(run.engine, b, run, with_entropy=True, with_kept=it == 0)   # (B, C) each
    mask = in_loss(b).to(run.device)                                                  # (B, C)
    if it == 0:   # the sampler's weights (no optimizer step yet)
        attn = b["inputs"]["attention_mask"]
        m.add("update/padded_frac", 1 - attn.sum().item() / attn.numel(), attn.numel())   # of the tokens processed
        if comps[0].old_logps is None:   # one iteration: this forward is pi_old
            from_rows(b, "old_logps", ts.logps)
        sampler_gap(run, b, ts, mask, m)
    return ts, mask


def from_records(run, comps, beta):
    """grpo_loss's inputs kept on the records, each (B, C) (advantages (B,) unless per token); None where unused."""
    def rows(name):
        return to_rows([getattr(c, name) for c in comps], run.device)   # (B, C)
    per_token = torch.is_tensor(comps[0].advantage)
    return dict(old_logps=rows("old_logps"),
                advantages=rows("advantage") if per_token else torch.tensor([c.advantage for c in comps],
                                                                             device=run.device),
                ref_logps=rows("ref_logps") if beta > 0 else None,
                is_weights=rows("is_weights") if comps[0].is_weights is not None else None)


def sampler_gap(run, b, ts, cmask, m):
    """The trainer's log-probs of the sampler's truncated distribution against vLLM's, logged; the sampler
    correction's weights onto the records."""
    args = run.args
    sampled = ts.logps.detach() - (ts.log_kept if ts.log_kept is not None else 0.0)                 # (B, C)
    sampler = to_rows([c.sampler_logps for c in b["completions"]], run.device)                    # (B, C)
    diff = (sampled - sampler).abs() * cmask
    m["rollout/logp_diff_max"] = ranks.Max(max(m.get("rollout/logp_diff_max", 0.0), diff.max().item()))
    m.add("rollout/logp_diff_mean", diff.sum().item() / max(cmask.sum().item(), 1), cmask.sum().item())
    weights, im = grpo.sampler_correction(sampled, sampler, cmask, args.vllm_importance_sampling_correction,
                                          args.vllm_importance_sampling_cap)
    if weights is not None:
        from_rows(b, "is_weights", weights.expand_as(cmask))
    if im:
        m["sampling/is_ratio_min"] = ranks.Min(min(m.get("sampling/is_ratio_min", im["is_ratio_min"]),
                                                   im["is_ratio_min"]))
        m["sampling/is_ratio_max"] = ranks.Max(max(m.get("sampling/is_ratio_max", im["is_ratio_max"]),
                                                   im["is_ratio_max"]))
        m.add("sampling/is_ratio_mean", im["is_ratio_mean"], im["is_count"])
        m.add("sampling/is_capped_frac", im["is_capped_frac"], im["is_count"])


def router_loss(run, ts, n_batches, m):
    """run.aux_loss_coef x the router's load-balancing loss, scaled to add up to their mean over the micro-batches;
    logs it and the expert loads. 0 if dense."""
    if ts.router is None:
        return 0.0
    m.add("train/aux_loss", ts.router.aux_loss.item(), 1)
    m.loads.append(ts.router.load)
    return run.aux_loss_coef * run.gas / n_batches * ts.router.aux_loss if run.aux_loss_coef else 0.0


def expert_shares(loads):
    """[(L, E) tokens per expert] -> the largest and smallest share of an expert in its layer."""
    if not loads:
        return {}
    share = sum(loads) / sum(loads).sum(dim=-1, keepdim=True)                             # (L, E)
    return {"train/expert_share_max": ranks.Max(share.max().item()),
            "train/expert_share_min": ranks.Min(share.min().item())}


# ----------------------------------------------------------------------------- a loss from another forward
def sft_losses(run, groups):
    """--sft_coef -> update's `extra`, [(gold micro-batch, loss_fn)]: sft_coef x the mean NLL over every rank's
    gold tokens, at temperature 1, untruncated."""
    if not run.args.sft_coef:
        return []
    batches = gold_batches(run, groups)
    tokens = torch.tensor(float(sum(b["inputs"]["completion_mask"].sum().item() for b in batches)), device=run.device)
    dist.all_reduce(tokens)
    norm = max(tokens.item(), 1.0) / (run.world * run.gas)   # as update's: DeepSpeed divides by gas, averages ranks

    def loss_fn(run, b, m):
        ts = completion_logps(run.engine, b, run, sampling=grpo.Sampling(banned=run.sampling.banned))   # (B, C)
        mask = b["inputs"]["completion_mask"].to(run.device)
        nll = -(ts.logps * mask).sum()
        m.add("train/sft_nll", nll.item() / max(mask.sum().item(), 1.0), mask.sum().item())
        return run.args.sft_coef * nll / norm
    return [(b, loss_fn) for b in batches]


def gold_batches(run, groups):
    """Each group's gold answer ("solution", then the turn's end) after its prompt, in micro-batches."""
    tok, size = run.processor.tokenizer, run.args.per_device_train_batch_size
    end = tok.convert_tokens_to_ids("<|im_end|>")   # the end of a turn in every Qwen chat template
    gold = [tok(str(s), add_special_tokens=False)["input_ids"] + [end] if (s := g.sample["columns"].get("solution"))
            is not None else [] for g in groups]
    batches = [dict(inputs=data.collate([g.sample for g in groups[i:i + size]], gold[i:i + size], run.pad_id,
                                        run.sampling.banned), completions=[]) for i in range(0, len(groups), size)]
    return in_step(run, batches, "--sft_coef's micro-batches per step")


# ----------------------------------------------------------------------------- after the update
def reference_step(run, step):
    """--ref_ema: ref = decay x ref + (1 - decay) x policy, in fp32 masters beside a bf16 reference, which would
    round the small steps away. --ref_reset_steps N: at every N-th step the reference becomes the policy (ProRL)."""
    args = run.args
    reset = args.ref_reset_steps and step % args.ref_reset_steps == 0
    if not (args.ref_ema or reset):
        return
    decay = args.ref_ema
    policy = dict(run.engine.module.named_parameters())
    named = list(run.ref_engine.module.named_parameters())
    masters = run.ref_masters or [None] * len(named)

    def move(r, p, master=None):
        if master is None:
            r.copy_(p.to(r.dtype)) if reset else r.lerp_(p.to(r.dtype), 1 - decay)
        else:
            r.copy_(master.copy_(p.float()) if reset else master.lerp_(p.float(), 1 - decay))
    model.update_params([p for _, p in named], [[policy[n]] + ([mm] if mm is not None else []) for (n, _), mm in
                                                 zip(named, masters)], move)


# ----------------------------------------------------------------------------- what the phases share
def completion_logps(engine, batch, run, with_entropy=False, with_kept=False, sampling=None):
    """-> grpo.TokenStats of the completions under `sampling` (default vLLM's), each (B, C): logps, and the kept
    mass's log and the entropy if asked."""
    return engine(**{k: v.to(run.device) for k, v in batch["inputs"].items()}, sampling=sampling or run.sampling,
                  chunks=batch["chunks"], vision_calls=batch.get("vision_calls", 1), with_entropy=with_entropy,
                  with_kept=with_kept, entropy_grad=bool(run.args.entropy_coef))


def to_rows(values, device):
    """[(n_i,)] -> (B, C) right-aligned as data.collate lays them out, 0 where no token."""
    C = max(max((len(v) for v in values), default=1), 1)
    out = torch.zeros(len(values), C, device=device)
    for j, v in enumerate(values):
        if len(v):
            out[j, C - len(v):] = torch.as_tensor(v, dtype=torch.float32, device=device)
    return out


def from_rows(batch, name, t):
    """(B, C) right-aligned -> each record's `name`, (n,) on the CPU."""
    C = t.shape[1]
    for j, c in enumerate(batch["completions"]):
        setattr(c, name, t[j, C - len(c.token_ids):].detach().float().cpu())


def in_step(run, batches, what):
    """As many micro-batches on every rank (checked), each with the most chunks and vision runs of any rank."""
    ranks.check_same(what, [len(batches)], run.device)
    chunks = torch.tensor([[-(-b["inputs"]["completion_mask"].numel() // run.args.logprob_chunk_tokens),
                            max(1, ("pixel_values" in b["inputs"]) + ("pixel_values_videos" in b["inputs"]))]
                           for b in batches], device=run.device).reshape(-1, 2)
    dist.all_reduce(chunks, op=dist.ReduceOp.MAX)
    for b, (n, calls) in zip(batches, chunks.tolist()):
        b["chunks"], b["vision_calls"] = n, calls
    return batches


def in_loss(b):
    """(B, C) the tokens the loss takes: those of scored completions."""
    return b["inputs"]["completion_mask"] * torch.tensor([[float(c.scored)] for c in b["completions"]])
