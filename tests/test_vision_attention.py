"""The vision tower's attention: transformers' sdpa path loops in Python over the segments of
cu_seqlens, one call per window of Qwen2.5-VL's windowed blocks and per image or frame elsewhere; model.load_model
installs model.vision_attention, one block-diagonal call per layer. Checked against transformers' own loop, forward
and backward, on each family's tower; the padded layout's groups and mask; torch's varlen call site on meta tensors
(the GPU kernel cannot run here)."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

import model
import train
from conftest import tiny_of

# (t, h, w) in patches: two images whose windows are partly cut at the edges (Qwen2.5-VL: 4 x 4 merged tokens, 8 x 8
# patches, a window) and a video of two frames: segments of 3 lengths in every block (model._length_groups); and
# images and frames of one size whose windows are whole: one call per block
GRIDS = [[1, 16, 12], [1, 12, 12], [2, 8, 12]]
WHOLE = [[1, 16, 16], [1, 16, 16], [2, 16, 16]]


class Calls(TorchFunctionMode):
    """Each scaled_dot_product_attention call's attn_mask (None or its shape)."""
    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.masks.append(None if mask is None else tuple(mask.shape))
        return func(*args, **kwargs)


def tower_pass(visual, grids):
    """The tower's forward and backward on random patches of `grids` -> (its outputs, every parameter's gradient,
    the sdpa calls' masks)."""
    cfg = visual.config
    grid_thw = torch.tensor(grids)
    torch.manual_seed(0)
    patches = torch.randn(int(grid_thw.prod(-1).sum()), cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2)
    visual.zero_grad()
    with Calls() as calls:
        out = visual(patches, grid_thw=grid_thw)
        outs = [out.pooler_output] + list(getattr(out, "deepstack_features", None) or [])
        sum(o.square().sum() for o in outs).backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in visual.named_parameters()}, calls.masks


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_one_call_per_layer_equals_transformers_loop(arch):
    """Qwen2.5-VL's windowed and full-attention blocks, Qwen3-VL's and Qwen3.5's towers (one segment per image or
    frame, deepstack features too): the installed forward's outputs and gradients equal transformers' loop (its
    class forward, restored by deleting the instance's), with one sdpa call per block against one per window or
    image. Fails before: no vision_attention, so the calls were the loop's."""
    m = model.load_model(tiny_of(arch)[0], train.parse_args(["--tiny_arch", arch]), torch.float32)
    visual, depth = m.model.visual, len(m.model.visual.blocks)
    attentions = [mod for mod in visual.modules() if type(mod).__name__.endswith("VisionAttention")]
    assert len(attentions) == depth and all(mod.forward.__func__ is model.vision_attention for mod in attentions)
    ours, ours_grads, ours_calls = tower_pass(visual, GRIDS)
    for mod in attentions:
        del mod.forward
    loop, loop_grads, loop_calls = tower_pass(visual, GRIDS)
    segments = sum(t for t, _, _ in GRIDS)   # images and frames: a full-attention block's calls in the loop
    if arch == "qwen2_5_vl":   # windows of 8 x 8 patches: 4 + 4 + 2 x 2
        windows = sum(t * -(-h // 8) * -(-w // 8) for t, h, w in GRIDS)
        assert len(loop_calls) == (depth - 1) * windows + segments and windows == 12
    else:
        assert len(loop_calls) == depth * segments
    assert len(ours_calls) == 3 * depth   # lengths 64, 32, 16 in a windowed block; 192, 144, 96 in a full one
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(ours, loop))
    assert ours_grads.keys() == loop_grads.keys()
    assert all(torch.allclose(ours_grads[n], loop_grads[n], atol=1e-5, rtol=1e-4) for n in loop_grads), \
        max((ours_grads[n] - loop_grads[n]).abs().max().item() for n in loop_grads)
    for mod in attentions:
        mod.forward = model.vision_attention.__get__(mod)
    assert tower_pass(visual, WHOLE)[2] == [None] * depth   # one call per block, no mask


def test_block_attention_pads_into_groups_and_masks_only_what_it_must():
    """block_attention's padded layout by hand: segments of one length make one call without a mask; lengths far
    apart go in groups (at most a tenth more than each group's own work) with a (S, 1, 1, L) key mask, never a (T, T)
    one; every case equals one sdpa call per segment, forward and backward."""
    def loop(q, k, v, lengths):
        outs = [torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in s),
                                                                 scale=0.3)
                for s in zip(*(t.split(lengths) for t in (q, k, v)))]
        return torch.cat([o.squeeze(0).transpose(0, 1) for o in outs])
    for lengths, groups in (([16, 16, 16], [[0, 1, 2]]), ([16, 15, 16, 16], [[0, 1, 2, 3]]),
                            ([300, 10, 12, 290, 5], [[0, 3], [2], [1], [4]])):
        assert model._length_groups(lengths) == groups
        torch.manual_seed(0)
        q, k, v = (torch.randn(sum(lengths), 3, 8, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0] + lengths).cumsum(0)
        with Calls() as calls:
            got = model.block_attention(q, k, v, cu, 0.3)
        want = loop(q, k, v, lengths)
        assert len(calls.masks) == len(groups)
        assert calls.masks == [None if len({lengths[i] for i in g}) == 1 else (len(g), 1, 1, max(lengths[i] for i in g))
                               for g in groups]
        assert torch.allclose(got, want, atol=1e-6)
        w = torch.randn_like(want)
        g1, g2 = (torch.autograd.grad((o * w).sum(), (q, k, v)) for o in (got, want))
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g1, g2))


def test_varlen_call_site_matches_torchs_api_and_the_cpu_pads():
    """On a GPU in fp16 / bf16 block_attention calls torch.nn.attention.varlen.varlen_attn once (sdpa's own check,
    torch.backends.cuda.can_use_flash_attention, says whether its flash kernel runs). Its kernel cannot run here; its
    registered shapes can: the call, forward and backward, on meta tensors of a 7B tower's width (16 heads of 80).
    On this CPU the check says no, in fp32 and bf16, and the padded path runs."""
    q = torch.empty(100, 16, 80, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with Calls() as calls:
        out = model.block_attention(q, q, q, torch.tensor([0, 64, 96, 100]), 80 ** -0.5, varlen=True)
    assert out.shape == (100, 16, 80) and out.device.type == "meta" and not calls.masks
    out.sum().backward()
    assert q.grad.shape == q.shape
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(47, 2, 8, dtype=dtype)
        with Calls() as calls:
            model.block_attention(x, x, x, torch.tensor([0, 24, 47]), 0.3)
        assert calls.masks == [(2, 1, 1, 24)]


def test_installed_under_sdpa_only():
    """load_model puts vision_attention on the tower when it runs sdpa; eager keeps transformers' forward (and
    flash_attention_2, a GPU's with flash-attn, its own varlen path: model.attention)."""
    eager = model.load_model(tiny_of()[0], train.parse_args(["--attn_implementation", "eager", "--no-shared_prefix"]),
                             torch.float32)
    assert not any("forward" in vars(mod) for mod in eager.model.visual.modules())
