"""The GRPO math: group advantages, completion log-probs without the full logits, the clipped loss.

Pure functions, tensors in and tensors (or `(loss, metrics)`) out, so they are unit-tested by
hand-computed cases (tests/test_grpo.py) and read in one go. train.py owns everything else.
Advantage estimators: GRPO (its std scalings), RLOO, REINFORCE++-baseline, pass@k, process supervision
(one advantage per token). Loss variants: GRPO, CISPO, GMPO, DAPO token-level, Dr. GRPO, GSPO's sequence-level ratio,
the vLLM importance-sampling correction, an entropy bonus. Left out on purpose: sequence packing. Names follow TRL /
DAPO: advantages, logps, old_logps, ref_logps, sampler_logps, entropy.
"""
import dataclasses
import math

import torch
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The distribution completions are drawn from, built once from the flags (train.sampling). vLLM samples with
    it (rollout.sampling_params), _VocabStats.forward scores it: a new setting is a field here and a line in each."""
    temperature: float = 1.0
    top_p: float = 1.0               # nucleus of the (top-k) distribution; 1: off
    top_k: int = 0                   # the k most likely tokens, applied before top_p (vLLM's order); 0: off
    banned: tuple = ()               # token ids at probability 0 (vLLM: logit_bias -inf)

    @property
    def truncated(self):
        """Whether top-k or top-p keeps only part of the vocabulary."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclasses.dataclass
class TokenStats:
    """What one pass over the vocabulary gives per completion token, each (B, C). A new per-token quantity is one
    more field here and one more line in _VocabStats.forward."""
    logps: torch.Tensor                       # log-prob of each sampled token (temperature, banned ids; untruncated)
    log_kept: torch.Tensor = None             # log of the mass top-k / top-p keep (with_kept; no grad)
    entropy: torch.Tensor = None              # entropy of the untruncated distribution (with_entropy)
    router: object = None                     # mixture-of-experts: the forward's model.RouterStats (not per token)


# ----------------------------------------------------------------------------- advantages
# Each estimator (--advantage_estimator) and the flags it reads, which train.advantages passes to it by name.
ESTIMATORS = {"grpo": ("scale_rewards",), "rloo": (), "reinforce_plus_plus_baseline": (), "pass_at_k": ("pass_at_k",),
              "process": ()}


def needs_everyone(estimator, scale_rewards):
    """Whether group_advantages needs every rank's rewards (`everyone`) for a std over the whole batch."""
    return estimator == "reinforce_plus_plus_baseline" or (estimator == "grpo" and scale_rewards == "batch")


def _group_stats(r):
    """r (P, G), NaN where a completion has no score -> mean, unbiased std (torch.std's) and count over the
    scored ones, each (P, 1)."""
    n = (~r.isnan()).sum(1, keepdim=True)                          # (P, 1)
    mean = r.nan_to_num().sum(1, keepdim=True) / n.clamp(min=1)    # (P, 1)
    var = ((r - mean).nan_to_num() ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)
    return mean, var.sqrt(), n


def pass_at_k_advantages(r, k):
    """r (P, G), NaN where unscored, a reward >= 1 a success -> pass@k training's advantages (P, G), arXiv
    2508.10751. A group without spread or with under max(2, k) scored gets zeros."""
    out = torch.zeros_like(r)
    for i, row in enumerate(r):
        scored = ~row.isnan()
        n, ok = int(scored.sum()), row.nan_to_num(0.0) >= 1.0
        neg = n - int((ok & scored).sum())
        if n < 2 or k > n:
            continue
        mean = 1.0 - math.comb(neg, k) / math.comb(n, k)
        std = math.sqrt(mean * (1.0 - mean))
        if std == 0.0:
            continue
        fail = (1.0 - mean - math.comb(neg - 1, k - 1) / math.comb(n - 1, k - 1)) / std if neg else 0.0
        out[i] = torch.where(ok, (1.0 - mean) / std, fail).masked_fill(~scored, 0.0)
    return out


def group_advantages(rewards, num_generations, estimator="grpo", scale_rewards="group", everyone=None, pass_at_k=None):
    """rewards (N,), N = prompts x num_generations grouped consecutively, NaN where unscored -> (advantages (N,),
    the fraction of groups with zero spread). An unscored completion, and a group whose scored rewards are all equal,
    get 0. estimator: "grpo" (its std by scale_rewards: group, batch or none), "rloo",
    "reinforce_plus_plus_baseline" or "pass_at_k". everyone (M,): every rank's rewards, for a batch std."""
    r = rewards.view(-1, num_generations)                          # (P, G)
    mean, std, n = _group_stats(r)
    centred = r - mean                                             # (P, G), NaN where unscored
    if estimator == "grpo":
        if scale_rewards == "group":
            centred = centred / (std + 1e-4)
        elif scale_rewards == "batch":
            pool = rewards if everyone is None else everyone
            centred = centred / (pool[~pool.isnan()].std() + 1e-4)
        elif scale_rewards != "none":
            raise ValueError(f"--scale_rewards must be group, batch or none, got {scale_rewards!r}")
    elif estimator == "rloo":                                      # r - (sum - r) / (n - 1) = n / (n - 1) (r - mean)
        centred = centred * n / (n - 1).clamp(min=1)
    elif estimator == "reinforce_plus_plus_baseline":
        pool = (rewards if everyone is None else everyone).view(-1, num_generations)
        pool = pool - _group_stats(pool)[0]                        # every rank's centred rewards
        centred = centred / (pool[~pool.isnan()].std() + 1e-4)
    elif estimator == "pass_at_k":
        if not pass_at_k or pass_at_k < 1:
            raise ValueError(f"the pass_at_k estimator needs k >= 1 (--pass_at_k), got {pass_at_k!r}")
        centred = pass_at_k_advantages(r, pass_at_k)
    else:
        raise ValueError(f"--advantage_estimator must be one of {tuple(ESTIMATORS)}, got {estimator!r}")
    lo, hi = r.nan_to_num(float("inf")).amin(1), r.nan_to_num(float("-inf")).amax(1)
    zero_spread = ~(hi > lo)                                       # (P,): also a group with < 2 scored completions
    adv = centred.masked_fill(zero_spread.unsqueeze(1), 0.0).nan_to_num(0.0)
    return adv.reshape(-1), zero_spread.float().mean().item()


def spread_lost_to_precision(totals, dtype=torch.float32):
    """totals (G,), one group's rewards (a list or tensor), NaN where unscored -> whether they differ while their
    GRPO advantages computed in dtype (train.advantages' float32) are all zero or not finite: rewards too large
    (1e200 is inf in float32) or too close for that precision."""
    r = torch.as_tensor(totals, dtype=torch.float64).reshape(1, -1)     # (1, G)
    scored = r[~r.isnan()]
    if scored.numel() < 2 or not bool(scored.max() > scored.min()):
        return False
    r = r.to(dtype)
    mean, std, _ = _group_stats(r)
    adv = ((r - mean) / (std + 1e-4))[~r.isnan()]                       # as group_advantages' group scaling
    return not bool(adv.isfinite().all() and adv.ne(0).any())


def process_advantages(events, lengths, num_generations):
    """events: per completion [(token index, score)], None if unscored; lengths: its tokens -> ([(n,) per
    completion], the fraction of groups with zero spread). A token sums the group-normalised events from it on."""
    out, flat = [], 0
    for g in range(0, len(events), num_generations):
        group = events[g:g + num_generations]
        scores = torch.tensor([s for ev in group if ev for _, s in ev], dtype=torch.float64)
        spread = scores.numel() > 1 and bool(scores.max() > scores.min())
        flat += not spread
        mean, std = (scores.mean(), scores.std()) if spread else (0.0, 1.0)
        for ev, n in zip(group, lengths[g:g + num_generations]):
            step = torch.zeros(n, dtype=torch.float64)
            for i, s in (ev or []) if spread else []:
                step[min(i, n - 1)] += (s - mean) / (std + 1e-4)
            out.append(step.flip(0).cumsum(0).flip(0).float())   # (n,) the events at or after each token
    return out, flat / max(1, len(events) // num_generations)


# ----------------------------------------------------------------------------- log-probs
def _log_kept(logits, lse, top_k, top_p):
    """logits (n, V), their log-normaliser lse (n,) -> (n,) log of the mass vLLM's top-k then top-p keep (ties at
    the k-th and the largest logit stay)."""
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    if top_p < 1.0:
        ordered = logits.sort(dim=-1).values                      # (n, V) ascending
        keep = ordered.softmax(dim=-1).cumsum(dim=-1) > 1 - top_p
        keep[:, -1] = True
        logits = ordered.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(logits, dim=-1) - lse                   # (n,)


def _chunk_stats(lm_head, hidden, token_ids, sampling, with_entropy, with_kept, entropy_grad=True):
    return _VocabStats.apply(lm_head(hidden), token_ids, sampling, with_entropy, with_kept, entropy_grad)   # (n,) each


class _VocabStats(torch.autograd.Function):
    """One chunk's log-probs, kept mass and entropy. An autograd.Function so that its backward writes both outputs'
    gradient into one (n, V) buffer, where autograd's own backward of the same math made five or more."""

    @staticmethod
    def forward(ctx, logits, token_ids, sampling, with_entropy, with_kept, entropy_grad=True):
        """logits (n, V) as lm_head returns them, token_ids (n,) -> (log-probs, log of the kept mass, entropy), each
        (n,) or None, of the sampled distribution: float32 logits / temperature, banned ids at probability 0."""
        # Scaled and filled in place, on lm_head's own output when it is float32: nothing else reads it.
        x = logits.float()                                             # (n, V)
        if sampling.temperature != 1.0:
            x.div_(sampling.temperature)
        banned = torch.tensor(sampling.banned, dtype=torch.long, device=x.device)
        # The sampler's logit_bias -inf, as the lowest float: its exp() is 0 and the entropy's 0 x log 0 is not NaN.
        if sampling.banned:
            x.index_fill_(-1, banned, torch.finfo(x.dtype).min)
        kept = with_kept and sampling.truncated   # _log_kept reads x after the log-softmax: only then a new buffer
        logp = torch.log_softmax(x, dim=-1, out=None if kept else x)   # (n, V), in place on x otherwise
        idx = token_ids.unsqueeze(-1)                                  # (n, 1)
        picked = logp.gather(-1, idx).squeeze(-1)                      # (n,)
        if sampling.banned:
            picked = picked.masked_fill(torch.isin(token_ids, banned), float("-inf"))
        entropy = log_kept = None
        if with_entropy:   # -sum p log p, each row's dot product (n, 1, V) @ (n, V, 1): no (n, V) product
            entropy = -torch.bmm(logp.exp().unsqueeze(1), logp.unsqueeze(2)).view(-1)   # (n,)
        if kept:   # each row's log-normaliser from its largest logit, never a banned one
            log_kept = _log_kept(x, x.amax(-1) - logp.amax(-1), sampling.top_k, sampling.top_p)
        ctx.save_for_backward(logp, token_ids, banned, entropy if with_entropy else None)
        ctx.temperature, ctx.dtype = sampling.temperature, logits.dtype
        # A logged entropy (entropy_grad False: not in the loss) carries no gradient, so no graph holds it.
        ctx.mark_non_differentiable(*(t for t in (log_kept, None if entropy_grad else entropy) if t is not None))
        ctx.set_materialize_grads(False)
        return picked, log_kept, entropy

    @staticmethod
    def backward(ctx, d_picked, d_kept, d_entropy):
        """The outputs' gradients, each (n,) or None -> the logits' (n, V), in the saved log-softmax's buffer."""
        # -p_j (d_picked + d_H (log p_j + H)), plus d_picked at j = t (docs/step.md, "The math in grpo.py").
        logp, token_ids, banned, entropy = ctx.saved_tensors
        if d_picked is None and d_entropy is None:
            return None, None, None, None, None, None
        if d_entropy is None:
            g = logp.exp_().mul_(-d_picked.unsqueeze(-1))              # (n, V)
        else:
            g = logp.exp()                                             # (n, V) p
            w = logp.add_(entropy.unsqueeze(-1)).mul_(d_entropy.unsqueeze(-1))          # d_H (log p + H)
            g.mul_(w if d_picked is None else w.add_(d_picked.unsqueeze(-1))).neg_()
        if d_picked is not None:
            g.scatter_add_(-1, token_ids.unsqueeze(-1), d_picked.unsqueeze(-1))
        if banned.numel():   # the fill's gradient: nothing reaches a banned logit
            g.index_fill_(-1, banned, 0.0)
        if ctx.temperature != 1.0:
            g.div_(ctx.temperature)
        return g.to(ctx.dtype), None, None, None, None, None


def token_logps(lm_head, hidden, token_ids, sampling=Sampling(), chunk_tokens=1024, with_entropy=False, with_kept=False,
                chunks=None, entropy_grad=True):
    """hidden (B, C, H), the states that predict token_ids (B, C) -> TokenStats, each (B, C) or None: log-probs under
    softmax(lm_head(hidden) / temperature), banned ids at 0; with_entropy: the entropy; with_kept: the log of the mass
    top-k / top-p keep. lm_head runs on `chunk_tokens` rows at a time, or in exactly `chunks` calls (each a ZeRO-3
    gather), so the (B, C, V) logits never exist. entropy_grad False: a logged entropy, without gradient."""
    B, C, H = hidden.shape
    flat_h, flat_ids = hidden.reshape(B * C, H), token_ids.reshape(B * C)
    size = chunk_tokens if chunks is None else -(-B * C // chunks)
    parts = []
    for s in range(0, size * chunks if chunks else B * C, size):
        args = (lm_head, flat_h[s:s + size], flat_ids[s:s + size], sampling, with_entropy, with_kept, entropy_grad)
        if torch.is_grad_enabled() and flat_h.requires_grad:
            parts.append(checkpoint(_chunk_stats, *args, use_reentrant=False))
        else:
            parts.append(_chunk_stats(*args))
    joined = [torch.cat(p).view(B, C) if p[0] is not None else None for p in zip(*parts)]   # each (B, C)
    return TokenStats(*joined)


# ----------------------------------------------------------------------------- the loss
# The policy losses grpo_loss computes (--loss_type): GRPO's clipped ratio, CISPO (MiniMax-M1, arXiv 2506.13585),
# GMPO (arXiv 2507.20673); docs/step.md has their formulas.
LOSSES = ("grpo", "cispo", "gmpo")


def sampler_correction(old_logps, sampler_logps, mask, mode="token_truncate", cap=2.0):
    """Importance weights for the gap between vLLM and the trainer. old_logps (of vLLM's distribution),
    sampler_logps, mask: (B, C) -> (weights (B, C) or (B, 1), metrics). mode: a ratio per token_* or sequence_*,
    capped at `cap` (*_truncate) or zeroed above it (*_mask)."""
    if mode == "none":
        return None, {}
    mask = mask.to(old_logps.dtype)
    log_ratio = (old_logps - sampler_logps) * mask                 # (B, C)
    level, _, how = mode.partition("_")
    if level == "sequence":
        log_ratio, mask = log_ratio.sum(1, keepdim=True), (mask.sum(1, keepdim=True) > 0).to(mask.dtype)  # (B, 1)
    elif level != "token" or how not in ("truncate", "mask"):
        raise ValueError(f"--vllm_importance_sampling_correction: unknown mode {mode!r}")
    ratio = torch.exp(log_ratio)                                   # (B, C) or (B, 1)
    over = (ratio > cap) & (mask > 0)
    weights = ratio.clamp(max=cap) if how == "truncate" else ratio.masked_fill(ratio > cap, 0.0)
    real = ratio[mask > 0]
    n = max(real.numel(), 1)
    metrics = {"is_ratio_mean": real.sum().item() / n, "is_ratio_min": real.min().item() if real.numel() else 1.0,
               "is_ratio_max": real.max().item() if real.numel() else 1.0, "is_capped_frac": over.sum().item() / n,
               "is_count": real.numel()}
    return weights, metrics


def grpo_loss(logps, old_logps, advantages, mask, epsilon=0.2, epsilon_high=None, beta=0.0, ref_logps=None,
              loss_agg="token", norm=None, importance_sampling_level="token", is_weights=None, entropy=None,
              entropy_coef=0.0, loss_type="grpo"):
    """logps, old_logps, ref_logps, entropy, mask: (B, C); advantages: (B,), or (B, C) per token -> (loss, metrics).
    The policy loss per token (loss_type, one of LOSSES; grpo's ratio per "token" or per "sequence":
    importance_sampling_level) times is_weights (B, C) or (B, 1), plus beta x the k3 KL, minus entropy_coef x entropy.
    loss_agg: "token" sums over tokens, "sequence" over each sequence's mean, "dr_grpo" as token; each / norm
    (default: the mask's tokens or sequences; dr_grpo's is required). metrics: means over the tokens (clip_frac, kl,
    entropy) and their count."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    log_ratio = logps - old_logps                                  # (B, C)
    if importance_sampling_level == "sequence":                    # (B, 1): one ratio per completion
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    elif importance_sampling_level != "token":
        raise ValueError(f"--importance_sampling_level must be token or sequence, got {importance_sampling_level!r}")
    if loss_type != "grpo" and (importance_sampling_level != "token" or loss_type not in LOSSES):
        raise ValueError(f"loss_type must be one of {LOSSES}, with token-level ratios, got {loss_type!r} and "
                         f"{importance_sampling_level!r}")
    ratio = torch.exp(log_ratio)                                   # (B, C) or (B, 1)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages   # (B, 1) or (B, C)
    if loss_type == "cispo":   # MiniMax-M1: the clipped weight is a constant, so every token keeps its gradient
        weight = torch.clamp(ratio, 1 - epsilon, 1 + eps_high).detach()          # (B, C)
        per_token = -weight * adv * logps                                        # (B, C)
        is_clipped = (ratio < 1 - epsilon) | (ratio > 1 + eps_high)
    elif loss_type == "gmpo":   # the geometric mean of the ratios, each clipped in log space on A's side
        if adv.shape[1] != 1:
            raise ValueError("loss_type gmpo needs one advantage per sequence, got one per token")
        sign = adv.sign()                                                        # (B, 1)
        kept = torch.min(sign * log_ratio, sign * log_ratio.clamp(-epsilon, eps_high))   # (B, C)
        is_clipped = kept < sign * log_ratio
        mean_log = (sign * kept * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)   # (B, 1)
        per_token = -adv * torch.exp(mean_log)                                   # (B, 1)
    else:
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
        per_token = -torch.min(unclipped, clipped)                     # (B, C) or (B, 1)
        is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    if is_weights is not None:
        per_token = per_token * is_weights
    per_token = per_token.expand_as(mask)                          # (B, C)
    kl = None
    if beta > 0:
        delta = ref_logps - logps                                  # (B, C)
        kl = torch.exp(delta) - delta - 1                          # (B, C) k3 estimator, >= 0
        per_token = per_token + beta * kl
    if entropy_coef:
        per_token = per_token - entropy_coef * entropy                 # (B, C)
    if loss_agg in ("token", "dr_grpo"):
        if loss_agg == "dr_grpo" and norm is None:
            raise ValueError("loss_agg dr_grpo needs norm = sequences x max_completion_length")
        denom = mask.sum() if norm is None else norm
        loss = (per_token * mask).sum() / max(float(denom), 1.0)
    elif loss_agg == "sequence":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / (mask.shape[0] if norm is None else norm)
    else:
        raise ValueError(f"--loss_agg must be token, sequence or dr_grpo, got {loss_agg!r}")
    n = mask.sum()
    is_clipped = is_clipped.expand_as(mask)
    metrics = {"clip_frac": ((is_clipped.float() * mask).sum() / n.clamp(min=1)).item(),
               "kl": ((kl * mask).sum() / n.clamp(min=1)).item() if kl is not None else 0.0, "tokens": n.item(),
               "entropy": ((entropy.detach() * mask).sum() / n.clamp(min=1)).item() if entropy is not None else 0.0}
    return loss, metrics
