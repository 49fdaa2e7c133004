"""The GRPO math: group advantages, completion log-probs without the full logits, the clipped loss.

Pure functions, tensors in and tensors (or `(loss, metrics)`) out, so they are unit-tested by
hand-computed cases (tests/test_grpo.py) and read in one go. train.py owns everything else.
Left out on purpose: entropy bonus, importance-sampling correction of vLLM/trainer mismatch,
sequence packing. Names follow TRL / DAPO: advantages, logps, old_logps, ref_logps.
"""
import torch
from torch.utils.checkpoint import checkpoint


def group_advantages(rewards, num_generations, scale_rewards="group"):
    """rewards (N,) with N = prompts * num_generations, grouped consecutively -> advantages (N,).

    scale_rewards: "group" divides by the group std (GRPO), "batch" by the batch std
    (Dr. GRPO-style variants argue for it), "none" leaves the centred reward. A group whose
    rewards are all equal gets zeros: it carries no signal."""
    r = rewards.view(-1, num_generations)                          # (P, G)
    centred = r - r.mean(dim=1, keepdim=True)                      # (P, G)
    if scale_rewards == "group":
        centred = centred / (r.std(dim=1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"--scale_rewards must be group, batch or none, got {scale_rewards!r}")
    zero_spread = (r.max(dim=1).values == r.min(dim=1).values)    # (P,)
    return centred.reshape(-1), zero_spread.float().mean().item()


def _chunk_logps(lm_head, hidden, token_ids, temperature):
    logits = lm_head(hidden).float() / temperature                 # (n, V) float32, one chunk only
    picked = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # (n,)
    return picked - torch.logsumexp(logits, dim=-1)                # (n,)


def token_logps(lm_head, hidden, token_ids, temperature=1.0, chunk_tokens=1024):
    """Log-probs of `token_ids` under `lm_head(hidden)`, `chunk_tokens` rows of logits at a time.

    hidden (B, C, H) are the states that predict token_ids (B, C). The full (B, C, V) float32
    logits (V = 151,936 for Qwen2.5-VL: 1.2 GB at 2,048 tokens) never exist at once. Under
    autograd each chunk is recomputed in backward (checkpoint), so the backward holds one
    chunk too."""
    B, C, H = hidden.shape
    flat_h, flat_ids = hidden.reshape(B * C, H), token_ids.reshape(B * C)
    out = []
    for s in range(0, B * C, chunk_tokens):
        args = (lm_head, flat_h[s:s + chunk_tokens], flat_ids[s:s + chunk_tokens], temperature)
        if torch.is_grad_enabled() and flat_h.requires_grad:
            out.append(checkpoint(_chunk_logps, *args, use_reentrant=False))
        else:
            out.append(_chunk_logps(*args))
    return torch.cat(out).view(B, C)                                # (B, C)


def grpo_loss(logps, old_logps, advantages, mask, epsilon=0.2, epsilon_high=None, beta=0.0,
              ref_logps=None, loss_agg="token", norm_tokens=None):
    """Clipped-ratio GRPO loss with optional k3 KL. Returns (loss, metrics).

    logps, old_logps, ref_logps, mask: (B, C); advantages: (B,).
    loss_agg "token" (DAPO) sums over tokens and divides by `norm_tokens` (default: the mask
    sum; train.py passes the token count of the whole rollout batch so micro-batches add up);
    "sequence" (original GRPO) averages per sequence, then over sequences."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old_logps)                           # (B, C)
    adv = advantages.unsqueeze(1)                                  # (B, 1)
    unclipped = ratio * adv                                        # (B, C)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv  # (B, C)
    per_token = -torch.min(unclipped, clipped)                     # (B, C)
    kl = None
    if beta > 0:
        delta = ref_logps - logps                                  # (B, C)
        kl = torch.exp(delta) - delta - 1                          # (B, C) k3 estimator, >= 0
        per_token = per_token + beta * kl
    mask = mask.to(per_token.dtype)
    if loss_agg == "token":
        denom = mask.sum() if norm_tokens is None else norm_tokens
        loss = (per_token * mask).sum() / max(float(denom), 1.0)
    elif loss_agg == "sequence":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    else:
        raise ValueError(f"--loss_agg must be token or sequence, got {loss_agg!r}")
    n = mask.sum().clamp(min=1)
    is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    metrics = {"clip_frac": ((is_clipped.float() * mask).sum() / n).item(),
               "kl": ((kl * mask).sum() / n).item() if kl is not None else 0.0}
    return loss, metrics
