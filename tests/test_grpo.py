"""The GRPO math on hand-computed cases."""
import math

import pytest
import torch
from test_step import fake_update

import flags
import grpo
import startup
import train
from conftest import allocations


def test_ratio_one_gives_minus_mean_advantage():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    adv = torch.tensor([1.0, -3.0])
    mask = torch.ones(2, 2)
    loss, m = grpo.grpo_loss(logps, logps.clone(), adv, mask)
    # every token has ratio 1: per-token loss = -A; token mean = -(1 + 1 - 3 - 3) / 4 = 1
    assert loss.item() == pytest.approx(1.0)
    assert m["clip_frac"] == 0.0


def test_clipping_engages_past_epsilon():
    old = torch.zeros(1, 2)
    logps = torch.tensor([[math.log(1.5), math.log(0.5)]])   # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    loss, m = grpo.grpo_loss(logps, old, torch.tensor([1.0]), mask, epsilon=0.2)
    # A > 0: token 1 clipped to 1.2; token 2 min(0.5, 0.8) = 0.5 (not clipped: pessimistic side)
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert m["clip_frac"] == pytest.approx(0.5)
    loss, m = grpo.grpo_loss(logps, old, torch.tensor([-1.0]), mask, epsilon=0.2)
    # A < 0: -min(-1.5, -1.2) = 1.5 (unclipped); -min(-0.5, -0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)
    assert m["clip_frac"] == pytest.approx(0.5)


def test_clip_higher_uses_epsilon_high():
    logps = torch.tensor([[math.log(1.3)]])
    loss, _ = grpo.grpo_loss(logps, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                             epsilon=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_clipped_tokens_get_no_gradient():
    logps = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, _ = grpo.grpo_loss(logps, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), epsilon=0.2)
    loss.backward()
    assert logps.grad.item() == 0.0


def test_kl_zero_when_policy_equals_reference():
    logps = torch.tensor([[-1.0, -2.0, -0.3]])
    loss0, _ = grpo.grpo_loss(logps, logps, torch.tensor([0.5]), torch.ones(1, 3))
    loss, m = grpo.grpo_loss(logps, logps, torch.tensor([0.5]), torch.ones(1, 3), beta=0.1, ref_logps=logps.clone())
    assert m["kl"] == 0.0 and loss.item() == pytest.approx(loss0.item())
    _, m = grpo.grpo_loss(logps, logps, torch.tensor([0.5]), torch.ones(1, 3), beta=0.1, ref_logps=logps - 0.5)
    assert m["kl"] == pytest.approx(math.exp(-0.5) + 0.5 - 1)   # k3 of delta = -0.5


def test_padding_is_masked_out():
    logps = torch.tensor([[-1.0, -50.0]])
    old = torch.tensor([[-1.0, 3.0]])          # the pad token has a wild ratio: must not count
    mask = torch.tensor([[1.0, 0.0]])
    for agg in ("token", "sequence"):
        loss, m = grpo.grpo_loss(logps, old, torch.tensor([2.0]), mask, loss_agg=agg, beta=0.1, ref_logps=old)
        assert loss.item() == pytest.approx(-2.0)
        assert m["clip_frac"] == 0.0


def test_token_vs_sequence_aggregation():
    logps = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([4.0, 0.0])
    tok, _ = grpo.grpo_loss(logps, logps, adv, mask, loss_agg="token")
    seq, _ = grpo.grpo_loss(logps, logps, adv, mask, loss_agg="sequence")
    assert tok.item() == pytest.approx(-4.0 / 4)        # 4 real tokens
    assert seq.item() == pytest.approx(-(4.0 + 0.0) / 2)  # mean of per-sequence means


def test_norm_tokens_makes_micro_batches_add_up():
    logps, adv = torch.zeros(4, 2), torch.tensor([1.0, -2.0, 3.0, 0.5])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    whole, _ = grpo.grpo_loss(logps, logps, adv, mask)
    parts = sum(grpo.grpo_loss(logps[i:i + 2], logps[i:i + 2], adv[i:i + 2], mask[i:i + 2], norm=5)[0]
                for i in (0, 2))
    assert parts.item() == pytest.approx(whole.item())


@pytest.mark.parametrize("loss_agg,norm", [("token", 6), ("sequence", 4)])
def test_unequal_micro_batches_add_up(loss_agg, norm):
    """--micro_batch_tokens makes micro-batches of 1 and 3 sequences: with the rollout batch's norm (tokens,
    or sequences for "sequence") their losses still sum to the whole batch's."""
    logps, old = torch.zeros(4, 2), torch.full((4, 2), -0.1)
    adv, mask = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    whole, _ = grpo.grpo_loss(logps, old, adv, mask, loss_agg=loss_agg)
    parts = sum(grpo.grpo_loss(logps[a:b], old[a:b], adv[a:b], mask[a:b], loss_agg=loss_agg, norm=norm)[0]
                for a, b in ((0, 1), (1, 4)))
    assert parts.item() == pytest.approx(whole.item()) and whole.item() != 0


def test_zero_spread_group_gives_zero_advantages():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    adv, zero_frac = grpo.group_advantages(rewards, 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert zero_frac == pytest.approx(0.5)
    assert adv[3:].sum().item() == pytest.approx(0.0, abs=1e-5)
    assert adv[4].item() > 0 > adv[3].item()
    g = torch.tensor([0.0, 1.0, 0.0])
    assert adv[3:].tolist() == pytest.approx(((g - g.mean()) / (g.std() + 1e-4)).tolist())
    none, _ = grpo.group_advantages(rewards, 3, scale_rewards="none")
    assert none[3:].tolist() == pytest.approx([-1 / 3, 2 / 3, -1 / 3])


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("chunks", [None, 2, 30])
def test_chunked_logps_equal_naive(grad, chunks):
    """chunks: exactly that many lm_head calls (30 for 21 tokens: 9 empty), as a rank with fewer tokens
    than another makes them (train.micro_batches)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 7, 16, requires_grad=grad)
    ids = torch.randint(0, 50, (3, 7))
    naive = torch.log_softmax(head(hidden).float() / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    calls = []
    hook = head.register_forward_hook(lambda *a: calls.append(1))
    ts = grpo.token_logps(head, hidden, ids, grpo.Sampling(temperature=0.7), chunk_tokens=4, chunks=chunks,
                          with_kept=True)
    hook.remove()
    assert len(calls) == (chunks or 6)
    chunked, kept = ts.logps, ts.log_kept
    assert torch.allclose(chunked, naive, atol=1e-5) and kept is None   # nothing truncated: no kept mass
    if grad:   # the hidden states' and lm_head's gradients, summed over the chunks
        w = torch.randn(3, 7)
        g1 = torch.autograd.grad((w * naive).sum(), (hidden, head.weight))
        g2 = torch.autograd.grad((w * chunked).sum(), (hidden, head.weight))
        assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(g1, g2))


@pytest.mark.parametrize("grad", [False, True])
def test_entropy_comes_from_the_same_chunks(grad):
    """The entropy of softmax(logits / T) with banned ids at probability 0, per token, from the chunks
    that give the log-probs: equal to the naive full-logits entropy, its gradient too."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 7, 16, requires_grad=grad)
    ids, banned = torch.randint(0, 40, (3, 7)), torch.tensor([40, 41, 49])
    logits = (head(hidden).float() / 0.7).index_fill(-1, banned, float("-inf"))
    p = torch.softmax(logits, -1)
    naive = -(p * torch.log_softmax(logits, -1).nan_to_num(neginf=0.0)).sum(-1)            # (3, 7)
    ts = grpo.token_logps(head, hidden, ids, grpo.Sampling(temperature=0.7, banned=tuple(banned.tolist())),
                          chunk_tokens=4, with_entropy=True)
    assert torch.allclose(ts.entropy, naive, atol=1e-5)
    assert grpo.token_logps(head, hidden, ids, grpo.Sampling(temperature=0.7), chunk_tokens=4).entropy is None
    if grad:
        g1 = torch.autograd.grad(naive.sum(), hidden)[0]
        g2 = torch.autograd.grad(ts.entropy.sum(), hidden)[0]
        assert torch.allclose(g1, g2, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunks_backward_is_autograds_of_the_full_logits(dtype):
    """grpo._VocabStats writes its own backward: the gradients of any weighting of the log-probs and the entropy
    together (the update's loss has both) reach the hidden states and lm_head's weight as autograd's of the naive
    full-logits math, at T != 1 with banned ids; in bf16 the logits are float32 from lm_head's bf16 output."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).to(dtype)
    hidden = torch.randn(3, 7, 16, dtype=dtype, requires_grad=True)
    ids, banned = torch.randint(0, 40, (3, 7)), torch.tensor([40, 41, 49])
    a, b = torch.randn(3, 7), torch.randn(3, 7)

    def grads(loss):
        head.zero_grad()
        hidden.grad = None
        loss.backward()
        return hidden.grad.float(), head.weight.grad.float()
    logits = (head(hidden).float() / 0.7).index_fill(-1, banned, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    naive_h = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    want = grads((a * logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1) + b * naive_h).sum())
    ts = grpo.token_logps(head, hidden, ids, grpo.Sampling(temperature=0.7, banned=tuple(banned.tolist())),
                          chunk_tokens=4, with_entropy=True)
    got = grads((a * ts.logps + b * ts.entropy).sum())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert all(torch.allclose(g, w, atol=tol, rtol=tol) for g, w in zip(got, want))


@pytest.mark.parametrize("with_entropy,most", [(False, 2), (True, 5)])
def test_a_chunk_makes_few_vocabulary_sized_buffers(with_entropy, most):
    """The chunk's forward, its recompute and its backward (T != 1, banned ids, as the update runs them) make 2 tensors
    of a chunk's (n, V) logits' size: lm_head's output, in forward and recompute, where the log-softmax, its
    gradient and the fill write in place; with the entropy 3 more, its probabilities in each and the backward's.
    Each is a pass over memory and, on CPU, fresh pages (docs/verification.md). Counted by a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Fresh(TorchDispatchMode):   # the ops whose output is a new tensor of at least `numel` elements
        def __init__(self, numel):
            super().__init__()
            self.numel, self.ops = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
            self.ops += [str(func) for t in tree_flatten(out)[0]
                         if torch.is_tensor(t) and t.numel() >= self.numel
                         and t.untyped_storage().data_ptr() not in inputs]
            return out
    torch.manual_seed(0)
    n, V = 64, 5000
    head = torch.nn.Linear(16, V, bias=False)
    hidden, ids = torch.randn(1, n, 16, requires_grad=True), torch.randint(0, V - 3, (1, n))
    with Fresh(n * V) as fresh:
        ts = grpo.token_logps(head, hidden, ids, grpo.Sampling(temperature=0.7, banned=(V - 3, V - 2, V - 1)),
                              chunk_tokens=n, with_entropy=with_entropy)
        (ts.logps.sum() + (0.1 * ts.entropy.sum() if with_entropy else 0)).backward()
    assert len(fresh.ops) <= most, fresh.ops
def live_after(fn):
    """Bytes of torch CPU tensors that fn allocated and that are still allocated when it returns, and fn's result."""
    out, allocated = allocations(fn)
    return allocated[-1], out


def test_a_logged_entropy_keeps_no_recomputed_chunk_past_the_backward():
    """train.update asks for the entropy (logged as train/entropy) and, at --entropy_coef 0, never backpropagates it.
    With 75c8cf3's autograd math and the entropy's graph alive, torch.utils.checkpoint kept each chunk's recomputed
    softmax, masked logits and mask (9 B per row and vocabulary entry) until the stats were freed: 5 GB at 8 x 500
    completion tokens on an H200. One chunk is now one node (grpo._VocabStats) that the loss's backward
    frees, whatever else holds its outputs; and logged without a gradient (entropy_grad False, what
    learner.completion_logps asks at --entropy_coef 0) the entropy has no graph at all. Either way nothing stays, the
    values are the same, and a trained entropy still gets its gradient."""
    torch.manual_seed(0)
    V, H, rows = 20000, 32, 1000
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(2, rows // 2, H, requires_grad=True)
    ids = torch.randint(0, V, (2, rows // 2))

    def step(entropy_grad, train_it=False):
        ts = grpo.token_logps(head, hidden, ids, chunk_tokens=250, with_entropy=True, entropy_grad=entropy_grad)
        (ts.logps.sum() + (ts.entropy.sum() if train_it else 0)).backward()
        return ts
    step(False)   # the gradients exist from here on: what stays allocated is what the stats hold
    kept, old = live_after(lambda: step(True))        # 75c8cf3's call: a gradient the loss never uses
    assert kept < 0.01 * rows * V and old.entropy.requires_grad
    kept, ts = live_after(lambda: step(False))        # learner.completion_logps at --entropy_coef 0
    assert kept < 0.01 * rows * V and not ts.entropy.requires_grad
    assert torch.equal(ts.entropy, old.entropy.detach())
    kept, trained = live_after(lambda: step(True, train_it=True))   # --entropy_coef > 0: its backward frees them
    assert kept < 0.01 * rows * V and trained.entropy.requires_grad


def test_entropy_bonus_is_subtracted_per_token_and_logged():
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    base, m0 = grpo.grpo_loss(logps, logps.detach(), torch.tensor([1.0, -1.0]), mask, entropy=entropy)
    bonus, m1 = grpo.grpo_loss(logps, logps.detach(), torch.tensor([1.0, -1.0]), mask, entropy=entropy,
                               entropy_coef=0.1)
    assert m0["entropy"] == m1["entropy"] == pytest.approx(15.0 / 5)           # token mean over the mask
    assert (bonus - base).item() == pytest.approx(-0.1 * 15.0 / 5)            # token aggregation: sum / tokens


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (0, 0.9), (0, 0.5), (5, 1.0), (5, 0.8), (1, 1.0), (60, 0.9)])
def test_logps_of_the_distribution_the_sampler_drew_from(top_k, top_p):
    """Banned ids get probability 0 (vLLM's logit_bias -inf); with top-k and/or top-p, logps - log_kept equals
    what vLLM's own truncation code (its CPU and PyTorch path: top-k, then the nucleus of the renormalised rest)
    gives as processed log-probs, wherever the sampler can draw; logps stay the untruncated distribution's."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden, ids = torch.randn(2, 5, 16), torch.randint(0, 40, (2, 5))
    banned = torch.tensor([40, 41, 49])
    with torch.no_grad():
        logits = head(hidden).float() / 0.7
    logits[..., banned] = float("-inf")
    full = torch.log_softmax(logits, -1)
    sampling = grpo.Sampling(temperature=0.7, top_p=top_p, top_k=top_k, banned=tuple(banned.tolist()))
    ts = grpo.token_logps(head, hidden, ids, sampling, chunk_tokens=3, with_kept=True)
    assert torch.allclose(ts.logps, full.gather(-1, ids.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    if not sampling.truncated:
        assert ts.log_kept is None
        return
    k = torch.full((10,), min(top_k, 50)) if top_k else None   # vLLM's input batch caps k at the vocabulary
    processed = torch.log_softmax(apply_top_k_top_p_pytorch(logits.reshape(10, 50).clone(), k, torch.full((10,), top_p)
                                                            if top_p < 1 else None), -1).view(2, 5, 50)
    want = processed.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    inside = torch.isfinite(want)              # the sampler only draws tokens the truncation keeps
    assert inside.any() and torch.allclose((ts.logps - ts.log_kept)[inside], want[inside], atol=1e-5)
    assert (ts.log_kept <= 1e-6).all()
    assert grpo.token_logps(head, hidden, ids, sampling, chunk_tokens=3).log_kept is None


def test_sampler_correction_compares_the_truncated_distributions():
    """At the sampler's weights, with top_p < 1, the trainer's truncated log-probs (logps - log_kept) equal
    vLLM's processed ones: every ratio is 1. Comparing the untruncated logps instead (the old code) made each
    ratio the kept mass, below 1, and a sequence's weight its product: ~0.9^n for an n-token completion."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(1, 40, 16)
    sampling = grpo.Sampling(top_p=0.9)
    with torch.no_grad():
        logits = head(hidden).float()[0]
        ids = torch.softmax(logits, -1).argmax(-1).unsqueeze(0)                 # (1, 40): inside every nucleus
        ts = grpo.token_logps(head, hidden, ids, sampling, with_kept=True)
    sampler = ts.logps - ts.log_kept                                            # what vLLM reports for them
    mask = torch.ones(1, 40)
    w, m = grpo.sampler_correction(ts.logps - ts.log_kept, sampler, mask, "sequence_mask", cap=3.0)
    assert w.item() == pytest.approx(1.0) and m["is_ratio_mean"] == pytest.approx(1.0)
    w_old, _ = grpo.sampler_correction(ts.logps, sampler, mask, "sequence_truncate", cap=3.0)   # like with unlike
    assert w_old.item() == pytest.approx(ts.log_kept.sum().exp().item()) and w_old.item() < 0.9


def test_dr_grpo_divides_by_a_constant():
    logps, mask = torch.zeros(2, 4), torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([4.0, 1.0])
    loss, _ = grpo.grpo_loss(logps, logps, adv, mask, loss_agg="dr_grpo", norm=2 * 8)   # B x max_completion_length 8
    assert loss.item() == pytest.approx(-(4.0 + 4 * 1.0) / 16)
    with pytest.raises(ValueError, match="dr_grpo needs norm"):
        grpo.grpo_loss(logps, logps, adv, mask, loss_agg="dr_grpo")


def test_gspo_sequence_ratio_is_length_normalised_and_clipped_per_sequence():
    old = torch.zeros(2, 3)
    logps = torch.tensor([[0.3, -0.1, 5.0], [0.6, 0.6, 0.6]])        # sequence 1's third token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, 1.0])
    loss, m = grpo.grpo_loss(logps, old, adv, mask, epsilon=0.2, importance_sampling_level="sequence")
    s1, s2 = math.exp((0.3 - 0.1) / 2), math.exp(0.6)               # 1.105 (inside), 1.822 (clipped to 1.2)
    assert s1 < 1.2 < s2
    assert loss.item() == pytest.approx(-(2 * s1 + 3 * 1.2) / 5)
    assert m["clip_frac"] == pytest.approx(3 / 5)                    # every token of sequence 2
    token, _ = grpo.grpo_loss(logps, old, adv, mask, epsilon=0.2)    # token level differs
    assert token.item() != pytest.approx(loss.item())
    lp = logps.clone().requires_grad_()
    grpo.grpo_loss(lp, old, adv, mask, importance_sampling_level="sequence")[0].backward()
    assert lp.grad[0, 0] == lp.grad[0, 1] != 0 and lp.grad[0, 2] == 0 and torch.all(lp.grad[1] == 0)


@pytest.mark.parametrize("mode,weights,capped", [
    ("token_truncate", [[0.5, 2.0, 1.0]], 1 / 2),        # ratios e^-ln2 = .5, e^{ln3} = 3 -> capped at 2; pad ignored
    ("token_mask", [[0.5, 0.0, 1.0]], 1 / 2),
    ("sequence_truncate", [[1.5]], 0.0),                  # exp(-ln2 + ln3) = 1.5 for the whole completion
    ("sequence_mask", [[1.5]], 0.0),
])
def test_sampler_correction_hand_cases(mode, weights, capped):
    old = torch.tensor([[-math.log(2), math.log(3), 7.0]])
    sampler = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, m = grpo.sampler_correction(old, sampler, mask, mode, cap=2.0)
    got = w if w.shape[1] == 1 else w * mask + (1 - mask)        # padding weights are never used
    assert got.tolist() == [pytest.approx(r) for r in weights]
    assert m["is_capped_frac"] == pytest.approx(capped)
    if mode.startswith("token"):
        assert (m["is_ratio_min"], m["is_ratio_max"], m["is_ratio_mean"]) == pytest.approx((0.5, 3.0, 1.75))
    assert grpo.sampler_correction(old, sampler, mask, "none") == (None, {})


def test_sampler_weights_scale_the_policy_term_not_the_kl():
    logps = torch.zeros(1, 2)
    w = torch.tensor([[0.5, 0.0]])
    loss, _ = grpo.grpo_loss(logps, logps, torch.tensor([2.0]), torch.ones(1, 2), is_weights=w)
    assert loss.item() == pytest.approx(-(2 * 0.5 + 0) / 2)
    ref = logps - 1.0
    loss, _ = grpo.grpo_loss(logps, logps, torch.tensor([0.0]), torch.ones(1, 2), is_weights=w, beta=1.0, ref_logps=ref)
    assert loss.item() == pytest.approx(math.exp(-1) + 1 - 1)      # the k3 KL, unweighted


def test_batch_std_comes_from_the_whole_batch():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    local, _ = grpo.group_advantages(rewards, 2, scale_rewards="batch")
    everyone = torch.tensor([0.0, 1.0, 1.0, 1.0, -3.0, 3.0])             # this rank's and another rank's group
    wider, _ = grpo.group_advantages(rewards, 2, scale_rewards="batch", everyone=everyone)
    assert wider[:2].tolist() == pytest.approx([-0.5 / (everyone.std().item() + 1e-4),
                                                0.5 / (everyone.std().item() + 1e-4)])
    assert local[0].item() == pytest.approx(-0.5 / (rewards.std().item() + 1e-4))
    assert grpo.needs_everyone("grpo", "batch") and not grpo.needs_everyone("grpo", "group")


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    adv, _ = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0]), 4, "rloo")
    assert adv.tolist() == pytest.approx([1 - 2 / 3, 0 - 1, 0 - 1, 2 - 1 / 3])


def test_reinforce_plus_plus_baseline_divides_by_the_global_std_of_the_centred_rewards():
    """Group mean removed, then divided by the std of every rank's centred rewards (not the raw rewards' std,
    which --scale_rewards batch uses)."""
    mine, other = torch.tensor([1.0, 3.0]), torch.tensor([10.0, 10.0, 0.0, 4.0])   # 3 groups of 2 over two ranks
    everyone = torch.cat([mine, other])
    centred = torch.tensor([-1.0, 1.0, 0.0, 0.0, -2.0, 2.0])
    adv, _ = grpo.group_advantages(mine, 2, "reinforce_plus_plus_baseline", everyone=everyone)
    assert adv.tolist() == pytest.approx([-1 / (centred.std().item() + 1e-4), 1 / (centred.std().item() + 1e-4)])
    raw, _ = grpo.group_advantages(mine, 2, scale_rewards="batch", everyone=everyone)
    assert raw[1].item() < adv[1].item()                                  # the raw std (4.3) is larger than 1.5
    assert grpo.needs_everyone("reinforce_plus_plus_baseline", "group")


def test_an_unscored_completion_is_out_of_its_groups_statistics():
    """NaN: no reward function could score it (train.score's failure flags). Its group's mean and std come from
    the others, its advantage is 0; a group with fewer than two scored completions has no spread (all 0)."""
    nan = float("nan")
    adv, zero = grpo.group_advantages(torch.tensor([1.0, nan, 0.0, nan, nan, 1.0, 0.0, 1.0, 1.0]), 3)
    g = torch.tensor([1.0, 0.0])
    assert adv[:3].tolist() == pytest.approx([((g - g.mean()) / (g.std() + 1e-4))[0].item(), 0.0,
                                              ((g - g.mean()) / (g.std() + 1e-4))[1].item()])
    assert adv[3:6].tolist() == [0.0, 0.0, 0.0] and zero == pytest.approx(1 / 3)
    everyone = torch.tensor([1.0, nan, 0.0, nan, nan, 1.0, 0.0, 1.0, 1.0])
    for est, scale in (("grpo", "batch"), ("rloo", "group"), ("reinforce_plus_plus_baseline", "group")):
        a, _ = grpo.group_advantages(everyone, 3, est, scale, everyone=everyone)
        assert torch.isfinite(a).all() and a[1] == 0 and a[3:6].abs().sum() == 0


# ----------------------------------------------------------------------------- CISPO and GMPO (--loss_type)
LOGPS = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]]        # sequence 0's third token is padding
OLD = [[-1.5, -0.5, -9.0], [-0.9, -1.0, -0.2]]           # ratios e^0.5, 1, -; e^0.6, e^-0.2, e^-0.5
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def hand_loss(agg, terms):
    """Each token's (loss, d loss / d logp) from terms(b, t) -> the loss and gradient aggregated by hand."""
    rows = [[t for t in range(3) if MASK[b][t]] for b in range(2)]
    n_tok = sum(len(r) for r in rows)
    loss, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    for b, row in enumerate(rows):
        div = n_tok if agg == "token" else 2 * len(row)   # sequence: each sequence's mean, then the mean of the 2
        for t in row:
            value, d = terms(b, t)
            loss += value / div
            grad[b][t] = d / div
    return loss, grad


def loss_and_grad(adv, **kw):
    lp = torch.tensor(LOGPS, requires_grad=True)
    loss, m = grpo.grpo_loss(lp, torch.tensor(OLD), adv, torch.tensor(MASK), **kw)
    loss.backward()
    return loss.item(), lp.grad.tolist(), m


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("per_token", [False, True])
def test_cispo_is_the_clipped_detached_weight_times_the_log_prob(agg, per_token):
    """MiniMax-M1 (arXiv 2506.13585, eq. 4): per token -sg(clip(r, 1 - eps, 1 + eps_high)) A log pi. A clipped token
    keeps the gradient -w A (GRPO's gets 0); eps 1 leaves no lower clip."""
    A = [[1.0, 2.0, 0.0], [-1.0, 0.5, -2.0]] if per_token else [[1.0] * 3, [-1.0] * 3]
    adv = torch.tensor(A) if per_token else torch.tensor([1.0, -1.0])
    for eps, eps_high in ((0.2, 0.28), (1.0, 0.28)):
        def terms(b, t):
            r = math.exp(LOGPS[b][t] - OLD[b][t])
            w = min(max(r, 1 - eps), 1 + eps_high)
            return -w * A[b][t] * LOGPS[b][t], -w * A[b][t]
        want, want_grad = hand_loss(agg, terms)
        got, grad, m = loss_and_grad(adv, epsilon=eps, epsilon_high=eps_high, loss_agg=agg, loss_type="cispo")
        assert got == pytest.approx(want) and grad == [pytest.approx(g) for g in want_grad]
        # e^0.5 and e^0.6 above 1.28; e^-0.5 = 0.61 below 0.8 only with eps 0.2
        assert m["clip_frac"] == pytest.approx((3 if eps == 0.2 else 2) / 5)
        assert grad[0][0] != 0 and grad[1][0] != 0   # clipped, and still a gradient


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_gmpo_is_the_geometric_mean_of_the_ratios_clipped_in_log_space(agg):
    """GMPO (arXiv 2507.20673; callsys/GMPO): per sequence -A exp(mean_t clip_A(log r_t)), where A > 0 caps
    log r at eps_high and A < 0 floors it at -eps; a clipped token gets no gradient, the others A's share of the
    sequence's ratio / |o|. Under --loss_agg token the sequence's term counts once per token."""
    A = [2.0, -1.0]
    eps, eps_high = 0.4, 0.3
    clipped_log, kept = [], []
    for b in range(2):
        logs = [LOGPS[b][t] - OLD[b][t] for t in range(3) if MASK[b][t]]
        cut = [min(x, eps_high) if A[b] > 0 else max(x, -eps) for x in logs]
        clipped_log.append(sum(cut) / len(cut))
        kept.append([x == c for x, c in zip(logs, cut)])

    def terms(b, t):
        # the token's copy of its sequence's term; the n copies' gradient by logp_t: n x -A rho / n, if not clipped
        rho = math.exp(clipped_log[b])
        return -A[b] * rho, -A[b] * rho * kept[b][t]
    want, want_grad = hand_loss(agg, terms)
    if agg == "sequence":   # the paper's 1/G sum over the sequences
        assert want == pytest.approx(-(A[0] * math.exp(clipped_log[0]) + A[1] * math.exp(clipped_log[1])) / 2)
    got, grad, m = loss_and_grad(torch.tensor(A), epsilon=eps, epsilon_high=eps_high, loss_agg=agg, loss_type="gmpo")
    assert got == pytest.approx(want) and grad == [pytest.approx(g) for g in want_grad]
    assert m["clip_frac"] == pytest.approx(2 / 5)   # 0.5 > 0.3 (A > 0); -0.5 < -0.4 (A < 0)
    assert grad[0][0] == 0 and grad[1][2] == 0 and grad[0][1] != 0


def ratio_one(loss_type, agg, is_weights):
    """At num_iterations 1 the old log-probs are the forward's own, detached: each ratio is 1. -> (loss, grads of
    the log-probs and of the entropy), with the KL, the entropy bonus and the sampler weights on."""
    lp = torch.tensor(LOGPS, requires_grad=True)
    ent = torch.tensor([[0.5, 0.7, 0.0], [0.2, 0.9, 1.1]], requires_grad=True)
    loss, _ = grpo.grpo_loss(lp, lp.detach(), torch.tensor([1.5, -0.5]), torch.tensor(MASK), beta=0.1,
                             ref_logps=torch.tensor(OLD), loss_agg=agg, norm=2 * 3 if agg == "dr_grpo" else None,
                             is_weights=is_weights, entropy=ent, entropy_coef=0.05, loss_type=loss_type)
    loss.backward()
    return loss.item(), lp.grad, ent.grad


@pytest.mark.parametrize("agg", ["token", "sequence", "dr_grpo"])
def test_at_ratio_one_cispo_and_gmpo_step_as_grpo(agg):
    """At ratio 1 (--num_iterations 1) CISPO's gradient is GRPO's, -A per token, and so is GMPO's under the same
    --loss_agg: its geometric mean moves by 1/|o| of each token's, and the sequence's term counts |o| times (token)
    or its mean is taken (sequence). The KL and the entropy bonus are the same terms. GMPO's equality needs the
    sampler weights constant over a sequence (sequence_*); per token they are averaged over it."""
    seq_w, tok_w = torch.tensor([[0.7], [1.3]]), torch.tensor([[0.7, 1.0, 1.0], [1.3, 0.4, 1.0]])
    for w in (None, seq_w, tok_w):
        base_loss, base, base_ent = ratio_one("grpo", agg, w)
        for loss_type in ("cispo", "gmpo"):
            loss, grad, ent = ratio_one(loss_type, agg, w)
            assert torch.equal(ent, base_ent)
            if loss_type == "gmpo" and w is tok_w:
                assert not torch.allclose(grad, base)
            else:
                assert torch.allclose(grad, base, atol=1e-7), (loss_type, w)
            assert (loss == pytest.approx(base_loss)) == (loss_type == "gmpo")   # CISPO's value is A log pi's


def test_gmpo_without_a_clip_is_gspos_sequence_ratio():
    """GSPO's sequence ratio (arXiv 2507.18071) is the same geometric mean of the token ratios: where no clip acts the
    two losses and their gradients are one, at ratios far from 1; GSPO clips a whole sequence, GMPO single tokens."""
    for agg in ("token", "sequence"):
        wide = dict(epsilon=50.0, epsilon_high=50.0, loss_agg=agg)
        gspo = loss_and_grad(torch.tensor([2.0, -1.0]), importance_sampling_level="sequence", **wide)
        gmpo = loss_and_grad(torch.tensor([2.0, -1.0]), loss_type="gmpo", **wide)
        assert gmpo[0] == pytest.approx(gspo[0]) and gmpo[1] == [pytest.approx(g) for g in gspo[1]]
        narrow = loss_and_grad(torch.tensor([2.0, -1.0]), loss_type="gmpo", epsilon=0.2, loss_agg=agg)
        assert narrow[0] != pytest.approx(gspo[0])


def test_gmpo_refuses_per_token_advantages_and_both_refuse_a_sequence_ratio():
    """GMPO's objective is one advantage times a sequence's ratio; CISPO and GMPO take token ratios (check_args
    refuses the flags alike, naming them)."""
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        grpo.grpo_loss(lp, lp, torch.ones(1, 2), mask, loss_type="gmpo")
    for loss_type in ("cispo", "gmpo"):
        with pytest.raises(ValueError, match="token-level ratios"):
            grpo.grpo_loss(lp, lp, torch.ones(1), mask, loss_type=loss_type, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo.grpo_loss(lp, lp, torch.ones(1), mask, loss_type="dapo")


def one_step(parts, tmp_path, **flags):
    """A step of learner.update on the fake unigram policy, completions of 1 to 3 tokens sampled at log-prob -1, a
    large learning rate so that a second iteration's ratios are far from 1 -> (the policy after it, the logged)."""
    return fake_update(parts, tmp_path, 100.0, entropy_coef=0.0, **flags)


def test_loss_type_reaches_the_loss_through_the_update(parts, tmp_path):
    """--loss_type cispo and gmpo act at the far end of learner.update: at --num_iterations 2 each gives its own
    policy, and CISPO keeps gradient on the tokens GRPO clips (train/clip_frac > 0). At --num_iterations 1 each step
    is GRPO's, as the start-up note says; CISPO's train/loss, -A log pi, is not GRPO's."""
    two = {t: one_step(parts, tmp_path / f"{t}2", num_iterations=2, loss_type=t) for t in (None, "cispo", "gmpo")}
    assert two[None][1]["train/clip_frac"] > 0
    for t in ("cispo", "gmpo"):
        assert not torch.allclose(two[t][0], two[None][0], atol=1e-6), t
    assert not torch.allclose(two["cispo"][0], two["gmpo"][0], atol=1e-6)
    one = {t: one_step(parts, tmp_path / f"{t}1", num_iterations=1, loss_type=t) for t in (None, "cispo", "gmpo")}
    for t in ("cispo", "gmpo"):
        assert torch.allclose(one[t][0], one[None][0], atol=1e-6), t
    assert one["cispo"][1]["train/loss"] != pytest.approx(one[None][1]["train/loss"])
    assert one["gmpo"][1]["train/loss"] == pytest.approx(one[None][1]["train/loss"])


@pytest.mark.parametrize("loss_type", ["cispo", "gmpo"])
def test_the_start_says_a_one_iteration_run_steps_as_grpo(loss_type, world1, tmp_path, capsys):
    """startup.settle_flags prints the note at --num_iterations 1, none at 2; GMPO's adds the per-token sampler
    weights, which it averages over a completion."""
    for n, correction in ((1, "sequence_mask"), (1, "token_truncate"), (2, "sequence_mask")):
        args = train.parse_args(["--loss_type", loss_type, "--num_iterations", str(n), "--output_dir",
                                 str(tmp_path / f"{n}{correction}"), "--train_data", "unread.jsonl",
                                 "--vllm_importance_sampling_correction", correction])
        startup.settle_flags(args, 0, 1, 1)
        said = [line for line in capsys.readouterr().out.splitlines() if "--loss_type" in line]
        if n == 2:
            assert said == []
            continue
        (line,) = said
        assert line.startswith(f"[flags] note: --loss_type {loss_type} with --num_iterations 1: every ratio is 1, "
                               "so its gradient equals GRPO's")
        assert ("per-token sampler weights" in line) == (loss_type == "gmpo" and correction != "sequence_mask")
        assert ("-A log pi" in line) == (loss_type == "cispo")


@pytest.mark.parametrize("given,refused", [
    (["--loss_type", "cispo", "--importance_sampling_level", "sequence"], "--loss_type cispo with "
                                                                          "--importance_sampling_level sequence"),
    (["--loss_type", "gmpo", "--importance_sampling_level", "sequence"], "--loss_type gmpo with "
                                                                         "--importance_sampling_level sequence"),
    (["--loss_type", "gmpo", "--advantage_estimator", "process"], "--loss_type gmpo with --advantage_estimator "
                                                                  "process"),
])
def test_check_args_refuses_what_cispo_and_gmpo_do_not_define(given, refused):
    with pytest.raises(SystemExit, match=refused):
        flags.check_args(flags.parse_args(given), 1)
    flags.check_args(flags.parse_args(given[:2]), 1)   # the loss alone is fine
    assert flags.parse_args(given[:2]).loss_agg == "token"   # and keeps --loss_agg
