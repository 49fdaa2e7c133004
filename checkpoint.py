"""Checkpoints: written atomically, checked, resumed on the same or another number of ranks; the HF-format export.
checkpoint-<step>/ holds zero/ (DeepSpeed's shards, optimizer, scheduler), rank<r>.pt (RNG, data position), state.pt
(run.state, a fork's own) and, last, trainer_state.json (step, updates, flags, ranks, wandb id, data fingerprint,
manifest). The job's lifetime is job.py's.
"""
import errno
import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import time
import zipfile
import zlib

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

import data
import flags
import job
import model
import planner
import rollout


def rng_state():
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st):
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st:
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(engine, args, step, stream, run_id, rank, reference=None, state=None, updates=None):
    """A collective: the full state in output_dir/checkpoint-<step> -> its path. `reference` (ref engine, fp32
    masters) saves a moving reference too (--ref_ema); `state` (run.state, the same on every rank: checked) and
    `updates` go to state.pt and trainer_state.json. Written to a .tmp folder and renamed last, so a crash mid-save
    leaves nothing that resume takes as complete. A full disk stops the run, naming the last good checkpoint."""
    final = os.path.join(args.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    short = [make_room(args.output_dir, args.save_total_limit, step) if rank == 0 else None]
    dist.broadcast_object_list(short, src=0)
    if short[0]:
        sys.exit(short[0])
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        aside = [(state, key, state.pop(key)) for state, key in offload_buffers(engine)]
        try:
            # frozen weights are left out (a LoRA checkpoint is adapter-sized); a resume keeps them as loaded
            engine.save_checkpoint(tmp, tag="zero", exclude_frozen_parameters=has_frozen(engine))
        finally:   # offload_states reuses them at the next offload
            for state, key, buf in aside:
                state[key] = buf
        torch.save({"rng": rng_state(), "stream": stream.state()}, os.path.join(tmp, f"rank{rank}.pt"))
        if reference is not None:
            torch.save(reference_parts(*reference), os.path.join(tmp, f"reference{rank}.pt"))
        if state is not None:
            save_state(state, os.path.join(tmp, STATE_PT), rank)
        dist.barrier()
        files = manifest(tmp)   # a collective: each rank reads its share of the files
        if rank == 0:
            with open(os.path.join(tmp, STATE + ".part"), "w") as f:   # whole or absent: a kill mid-write leaves .part
                json.dump({"step": step, "updates": step if updates is None else updates, "wandb_id": run_id,
                           "world": dist.get_world_size(), "args": vars(args), "data": getattr(stream, "source", None),
                           "files": files}, f, indent=1)
            os.replace(os.path.join(tmp, STATE + ".part"), os.path.join(tmp, STATE))
    except (OSError, RuntimeError) as e:   # torch's writer raises RuntimeError on a full disk, without the errno
        last = (list_checkpoints(args.output_dir) or [None])[-1]
        if not disk_full(e, args.output_dir, last):
            raise
        sys.exit(f"error: rank {rank} could not write checkpoint-{step}: the disk of {args.output_dir} is full "
                 f"({_size(shutil.disk_usage(args.output_dir).free)} free; {type(e).__name__}: "
                 f"{(str(e).strip().splitlines() or [''])[0][:200]}). " +
                 (f"The last good checkpoint is {last}: free some space and relaunch; the relaunch resumes from it "
                  f"and removes the unfinished {os.path.basename(tmp)}." if last else
                  "No checkpoint was saved before this one: a relaunch starts from step 0."))
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)   # the commit point
        for old in list_checkpoints(args.output_dir)[:-args.save_total_limit or None]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def offload_buffers(engine):
    """[(state dict, key)] of offload_states' host copies of Adam's moments, kept in the optimizer state. A
    checkpoint leaves them out: loaded, they would land on the GPU."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return [(state, key) for state in getattr(opt, "state", {}).values() for key in list(state)
            if key.endswith("_offload_buffer")]


def drop_offload_buffers(engine):
    """After load_checkpoint: offload_states makes fresh pinned host buffers at its next call. -> count."""
    found = offload_buffers(engine)
    for state, key in found:
        del state[key]
    return len(found)


def resume(engine, stream, args, rank, ckpt, reference=None):
    """Load `ckpt` from pick_checkpoint (None: step 0) -> (ckpt or None, its step or 0): weights, optimizer, scheduler,
    this rank's data position and RNG, a moving `reference`; this launch's rates over the saved ones. Saved by another
    number of ranks, it loads from its universal checkpoint and carries every rank's position and RNG over."""
    if not ckpt:
        return None, 0
    with open(os.path.join(ckpt, STATE)) as f:
        state = json.load(f)
    saved, world = state.get("world") or saved_ranks(ckpt), _share()[1]
    # DeepSpeed's checkpoint engine loads zero/ with weights_only=False; this one's go through safe_load instead
    engine.checkpoint_engine.load = lambda path, map_location=None: safe_load(path, map_location)
    if saved == world:
        engine.load_checkpoint(ckpt, tag="zero", load_module_strict=not has_frozen(engine))   # frozen ones: left out
    else:
        load_universal(engine, os.path.join(ckpt, UNIVERSAL))
    drop_offload_buffers(engine)   # older checkpoints carry offload_states' host buffers
    rate_of_this_schedule(engine, args.learning_rate, args.weight_decay)
    if saved == world:
        mine = rank_state(ckpt, rank)
        set_rng_state(mine["rng"])
        stream.load(mine["stream"])
    else:
        states = [rank_state(ckpt, r) for r in range(saved)]
        set_rng_state(rng_of_rank([st["rng"] for st in states], rank))
        stream.regroup([st["stream"] for st in states])
    if reference is not None:
        load_reference(*reference, ckpt, rank, world, saved)
    said = [f"[resume] from {ckpt}: step {state['step']}"]
    if saved != world:
        said.append(f"[resume] {saved} ranks saved it and {world} resume it: weights, Adam's moments and step, and "
                    f"the schedule from its universal checkpoint; the data goes on in epoch {stream.epoch}, whose "
                    f"{len(stream.consumed.get(stream.epoch, ()))} rows taken so far are skipped; ranks below {saved} "
                    f"go on with the saved ranks' random streams, the others are seeded from rank 0's and their rank")
    if (old := state.get("data")) and getattr(stream, "source", None) and not same_data(old, stream.source):
        stream.restart()   # pick_checkpoint refused this unless --accept_changed_data
        said.append(f"[resume] --train_data changed since {os.path.basename(ckpt)} ({old['rows']} rows then, "
                    f"{stream.source['rows']} now): --accept_changed_data, epoch {stream.epoch} starts afresh over "
                    f"the rows as they are now; the rewards history is kept, by sample identity")
    if rank == 0:
        print("\n".join(said), flush=True)
    return ckpt, state["step"]


# ----------------------------------------------------------------------------- a fork's own state (run.state)
STATE_PT = "state.pt"


def save_state(state, path, rank):
    """Rank 0 writes `state` (tensors and plain data) to path; a state that differs between ranks is a RuntimeError on
    every rank, since one copy of it resumes on any number of ranks."""
    buf = io.BytesIO()
    torch.save(state, buf)
    crcs = _from_everyone(zlib.crc32(buf.getvalue()))
    if len(set(crcs)) > 1:
        raise RuntimeError(f"distributed invariant broken: run.state must be the same on every rank (one copy is "
                           f"saved); its CRC32 by rank: {crcs}. Keep per-rank values out of it, or reduce them first")
    if rank == 0:
        with open(path, "wb") as f:
            f.write(buf.getvalue())


def run_state(ckpt, step):
    """-> (run.state, the update phases run) of `ckpt` ({} and 0 without one). An older checkpoint without them: {}
    and `step` (one update a step)."""
    if not ckpt:
        return {}, 0
    path = os.path.join(ckpt, STATE_PT)
    with open(os.path.join(ckpt, STATE)) as f:
        updates = json.load(f).get("updates", step)
    return (safe_load(path) if os.path.exists(path) else {}), updates


# ----------------------------------------------------------------------------- the reference's own state
# DeepSpeed saves no engine without an optimizer, so each rank saves its part of a moving reference (--ref_ema).
def reference_parts(ref_engine, masters):
    """This rank's part of a moving reference: {numel, parts (partitions), masters (fp32 or None)}, by parameter."""
    params = list(ref_engine.module.parameters())
    return {"numel": [p.ds_numel for p in params], "parts": [p.ds_tensor.detach().cpu().clone() for p in params],
            "masters": [m.detach().cpu().clone() for m in masters] if masters else None}


def load_reference(ref_engine, masters, ckpt, rank, world, saved):
    """The parts reference_parts saved on `saved` ranks -> this rank's partitions and masters, on any number of
    ranks. A checkpoint without them leaves the reference as loaded, and says so."""
    paths = [os.path.join(ckpt, f"reference{r}.pt") for r in range(saved)]
    if not all(os.path.exists(p) for p in paths):
        if rank == 0:
            print(f"[resume] {ckpt} holds no state of the reference model: it starts again from --model's weights")
        return
    states = [safe_load(p) for p in (paths if saved != world else [paths[rank]])]
    params = list(ref_engine.module.parameters())

    def mine(kind, i, size):   # this rank's slice of parameter i, from every saving rank's slice of it
        if saved == world:
            return states[0][kind][i]
        whole = torch.cat([st[kind][i] for st in states])[:states[0]["numel"][i]]
        return torch.nn.functional.pad(whole, (0, size * world - whole.numel()))[rank * size:(rank + 1) * size]
    parts = [mine("parts", i, p.ds_tensor.numel()) for i, p in enumerate(params)]
    model.update_params(params, [[t] for t in parts], lambda r, t: r.copy_(t))
    for i, m in enumerate(masters or []):
        m.copy_(mine("masters", i, m.numel()))


def rank_state(ckpt, rank):
    """rank<r>.pt of `ckpt`: that rank's RNG states and data position, loaded by safe_load."""
    return safe_load(os.path.join(ckpt, f"rank{rank}.pt"))


def safe_load(path, map_location=None, mmap=False):
    """torch.load with weights_only: tensors, plain containers, SAFE_TYPES; anything else, SystemExit naming it."""
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        sys.exit(untrusted(path, e))


def untrusted(path, error):
    """What to say of a checkpoint's file that weights_only loading refused (torch's UnpicklingError)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))   # torch 2.13: "unsupported GLOBAL posix.system whose module..."
    what = f"a call of {found.group(1)}" if found else \
        next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), "an object of another kind")[:200]
    return (f"error: {path} would build more than tensors and plain data when it is loaded ({what}): loading it could "
            f"run code. It is not a file this code writes. Resume only checkpoints that this run or someone you trust "
            f"wrote; do not turn this check off (torch's advice to load it with weights_only=False would run that "
            f"code). Start a new run in another --output_dir, or move this checkpoint away to resume from an earlier "
            f"one")


def unsafe_files(ckpt):
    """A collective before a resume: each .pt file of `ckpt` unpickled with weights_only, tensors mapped, not read
    -> [untrusted()'s line per file that would build more]."""
    rank, world = _share()
    names = _from_rank0(sorted(os.path.join(d, f) for d, _, fs in os.walk(ckpt) for f in fs if f.endswith(".pt"))
                        if rank == 0 else None)
    found = []
    for path in names[rank::world]:
        try:
            with torch.serialization.safe_globals(SAFE_TYPES):
                torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        except pickle.UnpicklingError as e:
            found.append(untrusted(path, e))
    return [line for part in _from_everyone(found) for line in part]


def rng_of_rank(saved, rank):
    """The saved ranks' RNG states -> `rank`'s: its own where it saved one, else seeded from saved rank 0's torch
    state and the rank. CUDA's are seeded so on every rank."""
    seed = zlib.crc32(saved[0]["torch"].numpy().tobytes() + rank.to_bytes(4, "little"))
    st = {"python": random.Random(seed).getstate(), "numpy": np.random.RandomState(seed).get_state(),
          "torch": torch.Generator().manual_seed(seed).get_state()}
    if rank < len(saved):
        st.update({k: saved[rank][k] for k in ("python", "numpy", "torch")})
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return st


def load_universal(engine, folder):
    """engine.load_checkpoint from the universal checkpoint `folder`, with load_universal on for this load."""
    config = engine._config
    before, config.load_universal_checkpoint = config.load_universal_checkpoint, True
    try:
        engine.load_checkpoint(folder, tag="zero", load_module_strict=not has_frozen(engine))
    finally:
        config.load_universal_checkpoint = before


UNIVERSAL = "universal"   # in a checkpoint: its ZeRO-3 state as DeepSpeed's universal checkpoint (to_universal)


def universal_command(ckpt, out):
    """DeepSpeed's own converter of a ZeRO checkpoint into a universal one, as a command (docs/resilience.md)."""
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(ckpt, "zero"),
            "--output_folder", os.path.join(out, "zero")]


def to_universal(ckpt, rank, poll_s=2.0):
    """A collective before a resume on another number of ranks: `ckpt`'s shards as DeepSpeed's universal checkpoint
    in ckpt/universal, made once -> the folder; SystemExit on every rank when it fails. Rank 0 converts while every
    rank polls it each `poll_s`, so no rank waits in one collective past torch.distributed's timeout."""
    target, t = os.path.join(ckpt, UNIVERSAL), time.perf_counter()
    if not damage(target):   # made by an earlier launch (a collective)
        return target
    tmp, proc = target + ".tmp", None
    if rank == 0:
        if os.path.isdir(target):
            print(f"[resume] {target} is not whole: made again", flush=True)
        for old in (target, tmp):
            shutil.rmtree(old, ignore_errors=True)
        os.makedirs(tmp)
        print(f"[resume] converting {ckpt}/zero to DeepSpeed's universal checkpoint in {target} (once; log "
              f"{UNIVERSAL}/convert.log)", flush=True)
        with open(os.path.join(tmp, "convert.log"), "w") as log:
            proc = subprocess.Popen(universal_command(ckpt, tmp), stdout=log, stderr=subprocess.STDOUT)
    while (code := _from_rank0(proc.poll() if rank == 0 else None)) is None:
        time.sleep(poll_s)
    if code != 0:
        tail = _from_rank0(tail_of(os.path.join(tmp, "convert.log")) if rank == 0 else None)
        sys.exit(f"error: DeepSpeed's conversion of {ckpt} to a universal checkpoint failed (exit {code}); the end of "
                 f"{tmp}/convert.log:\n{tail}\nLaunch the number of ranks that saved it to resume without one.")
    files = manifest(tmp)   # a collective
    if rank == 0:
        job.write_atomic(os.path.join(tmp, STATE), json.dumps({"files": files, "from": os.path.join(ckpt, "zero")}))
        os.rename(tmp, target)
        print(f"[resume] {target}: {len(files)} files, {_size(sum(s for s, _ in files.values()))}, converted in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
    _from_rank0(None)   # the others wait for the rename
    return target


def tail_of(path, n=3000):
    with open(path, errors="replace") as f:
        return f.read()[-n:]


# what np.random.get_state() pickles as (numpy 2): its MT19937 key is a uint32 array
RNG_STATE_TYPES = [np.ndarray, np.dtype, np.dtypes.UInt32DType, np._core.multiarray._reconstruct]
# What a checkpoint's files may build beside tensors and plain containers (safe_load): the RNG state's numpy types,
# and the ZeRO stage and loss scaler in DeepSpeed's optimizer states
SAFE_TYPES = [*RNG_STATE_TYPES, ZeroStageEnum, LossScaler, DynamicLossScaler]


def has_frozen(engine):
    """Whether some weights train not (LoRA's base, a frozen vision tower): checkpoints leave them out."""
    return any(not p.requires_grad for p in engine.module.parameters())


def rate_of_this_schedule(engine, learning_rate=None, weight_decay=None):
    """After a load: lr and weight decay from this launch's flags and schedule at the restored step."""
    sched = engine.lr_scheduler
    if learning_rate is not None:   # model.ds_config gives the optimizer one param group, at this rate
        sched.base_lrs = [learning_rate] * len(sched.base_lrs)
    for group, base, factor in zip(engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)
        if weight_decay is not None:
            group["weight_decay"] = weight_decay


def list_checkpoints(output_dir):
    """Paths of the finished checkpoint-<step> folders (with trainer_state.json), oldest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.exists(os.path.join(output_dir, name, STATE)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


# ----------------------------------------------------------------------------- whole checkpoints, and room for them
# trainer_state.json is a checkpoint's last file, and holds its manifest: every other file's size and CRC32.
STATE = "trainer_state.json"


def _from_rank0(obj):
    """Rank 0's obj on every rank (obj itself without torch.distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _from_everyone(obj):
    """[every rank's obj] by rank ([obj] without torch.distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _share():
    """(rank, world): the files this rank reads are every world-th."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def manifest(ckpt):
    """{path under ckpt: [size, CRC32]} of every file but trainer_state.json. A collective."""
    rank, world = _share()
    names = _from_rank0(sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs
                               if os.path.join(d, f) != os.path.join(ckpt, STATE)) if rank == 0 else None)
    mine = {n: [os.path.getsize(os.path.join(ckpt, n)), data.file_crc32(os.path.join(ckpt, n))]
            for n in names[rank::world]}
    return dict(sorted((n, v) for part in _from_everyone(mine) for n, v in part.items()))


def damage(ckpt):
    """What is wrong with the checkpoint folder `ckpt`, a line each ([] when whole). A collective; no manifest: ok."""
    rank, world = _share()
    found = []
    try:
        with open(os.path.join(ckpt, STATE)) as f:
            files = json.load(f).get("files", {})
    except FileNotFoundError:
        files = {}
        found.append("the folder does not exist" if not os.path.isdir(ckpt) else
                     f"{STATE} is missing (a save writes it last: this one did not finish, or it was deleted)")
    except ValueError:
        files = {}
        found.append(f"{STATE} is not readable JSON")
    for name in sorted(files)[rank::world]:
        size, crc = files[name]
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            found.append(f"{name} is missing")
        elif (n := os.path.getsize(path)) != size:
            found.append(f"{name} has {n} bytes where its manifest says {size}{' (cut short)' if n < size else ''}")
        elif data.file_crc32(path) != crc:
            found.append(f"{name} has the manifest's size but not its CRC32 (its bytes changed)")
    return list(dict.fromkeys(line for part in _from_everyone(found) for line in part))


def checkpoints_newest_first(output_dir):
    """checkpoint-<step> and checkpoint-<step>.tmp folders, newest first; at one step the renamed one first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)(\.tmp)?", name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), not m.group(2), os.path.join(output_dir, name)))
    return [path for *_, path in sorted(found, reverse=True)]


def pick_checkpoint(args, rank, world):
    """A collective before anything heavy -> the checkpoint --resume names, or None (step 0). Its files are checked
    against its manifest, its flags and data against this launch's: a change of what its state means is a SystemExit
    on every rank. --resume auto sets a damaged checkpoint aside and takes the newest whole one. A refusal changes
    nothing on disk."""
    if args.resume == "none":
        return None
    auto = args.resume == "auto"
    paths = _from_rank0((checkpoints_newest_first(args.output_dir) if auto else [args.resume]) if rank == 0 else None)
    chosen, damaged, t = None, [], time.perf_counter()
    for path in paths:
        if not (wrong := damage(path)):
            chosen = path
            break
        damaged.append((path, wrong))
    unsafe = unsafe_files(chosen) if chosen else []   # a collective, before anything loads a file of it
    said, refusal = [], None
    if rank == 0:
        # a .tmp that --resume auto finds is an unfinished save, removed by set_aside; a damaged checkpoint is broken
        broken = [(path, wrong) for path, wrong in damaged if not (auto and path.endswith(".tmp"))]
        said = [f"[resume] {path} is not whole: {'; '.join(wrong)}" for path, wrong in broken]
        if chosen:
            with open(os.path.join(chosen, STATE)) as f:
                state = json.load(f)
            files = state.get("files")
            said.append(f"[resume] {chosen}" + (" is the newest whole checkpoint, used instead" if broken else "") +
                        (f": its {len(files)} files match its manifest ({_size(sum(s for s, _ in files.values()))} "
                         f"checked in {time.perf_counter() - t:.2f} s)" if files is not None else
                         ": saved before checkpoints had a manifest, its files are not checked"))
            saved_world = state.get("world") or saved_ranks(chosen)
            lines, refusal = flags.changed_flags(state["args"], vars(args), saved_world, world,
                                                 args.accept_changed_flags, os.path.basename(chosen),
                                                 planner.AUTO if args.memory == "auto" else ())
            said += lines
            if not refusal:
                lines, refusal = changed_data(state.get("data"), args, os.path.basename(chosen))
                said += lines
            if unsafe:
                refusal = "\n".join(unsafe)
        elif broken:
            refusal = (f"error: no whole checkpoint to resume from in {args.output_dir}: " +
                       "; ".join(f"{os.path.basename(p)}: {w[0]}" for p, w in broken) +
                       ". --resume none starts this folder over; another --output_dir starts a new run elsewhere"
                       if auto else f"error: --resume {args.resume} is not whole: {'; '.join(broken[0][1])}")
        if auto and not refusal:
            chosen, done = set_aside(args.output_dir, chosen, damaged)
            said += done
        if said:
            print("\n".join(said), flush=True)
    chosen, refusal, saved_world = _from_rank0([chosen, refusal, chosen and saved_world] if rank == 0 else None)
    if refusal:
        if rank == 0:
            job.release_output_dir(args.output_dir)   # the next launch into it may start
        sys.exit(refusal)
    if chosen and saved_world != world:   # before vLLM and the model: rank 0 converts while nothing else holds memory
        to_universal(chosen, rank)
    return chosen


def same_data(saved, now):
    """Whether two fingerprints of a data source (data.source_fingerprint) are of the same contents."""
    return (saved.get("size"), saved.get("crc32")) == (now.get("size"), now.get("crc32"))


def changed_data(saved, args, name="the checkpoint"):
    """--train_data now against the fingerprint `saved` with the checkpoint -> (lines that say a change, the refusal
    or None). A changed file is refused unless --accept_changed_data: the saved position would point at other rows."""
    if not saved or not args.train_data or not os.path.exists(args.train_data):
        return [], None
    now = data.source_fingerprint(args.train_data)
    if same_data(saved, now):
        return [], None
    what = (f"--train_data {args.train_data} changed since {name} was saved ({saved.get('rows')} rows, "
            f"{saved['size']} bytes, CRC32 {saved['crc32']} then; {now['size']} bytes, CRC32 {now['crc32']} now)")
    if getattr(args, "accept_changed_data", False):
        return [f"[resume] {what}: accepted (--accept_changed_data), a fresh epoch starts"], None
    return [], (f"error: {what}. The saved data position is a place in a seeded shuffle of the rows as they were: "
                f"after rows are appended, removed or reordered it points at other samples, and the rest of the epoch "
                f"would repeat some and skip others. Restore the file, start a new run in another --output_dir, or go "
                f"on from this state with --accept_changed_data: a fresh epoch starts over the rows as they are now "
                f"(the rewards history is kept, by sample identity)")


def set_aside(output_dir, chosen, damaged):
    """Rank 0, --resume auto: damaged checkpoints renamed to <name>.damaged, unfinished .tmp folders removed, a whole
    chosen .tmp renamed -> (the chosen checkpoint's path now, the lines that say what was done)."""
    said = []
    for path, wrong in damaged:
        if path.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)
            said.append(f"[resume] removed {os.path.basename(path)}: a save that did not finish (cut short by a kill "
                        f"or a full disk)")
        else:
            shutil.rmtree(path + ".damaged", ignore_errors=True)
            os.rename(path, path + ".damaged")
            said.append(f"[resume] moved {os.path.basename(path)} aside to {os.path.basename(path)}.damaged: "
                        f"kept for a look, delete it when done")
    if chosen and chosen.endswith(".tmp"):
        final = chosen[:-len(".tmp")]
        shutil.rmtree(final, ignore_errors=True)
        os.rename(chosen, final)
        said.append(f"[resume] {os.path.basename(chosen)} is whole (a kill came after its last file and before its "
                    f"rename): kept as {os.path.basename(final)}")
        chosen = final
    for path in checkpoints_newest_first(output_dir):   # older unfinished saves, never looked at
        if path.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)
            said.append(f"[resume] removed {os.path.basename(path)}: a save that did not finish")
    return chosen, said


def saved_ranks(ckpt):
    """The ranks a checkpoint was saved by, from its rank<r>.pt files (before trainer_state.json said it)."""
    return len([f for f in os.listdir(ckpt) if re.fullmatch(r"rank\d+\.pt", f)])


def checkpoint_bytes(ckpt):
    """What a save of `ckpt` wrote: without the universal checkpoint a resume on other ranks may have added."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs
               if not os.path.relpath(d, ckpt).split(os.sep)[0].startswith(UNIVERSAL))


def _size(n):
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def make_room(output_dir, limit, step):
    """Rank 0 before the save of `step` -> None when the disk has room for the last checkpoint's size and a tenth,
    else the error to stop with. Short of room, the old ones --save_total_limit would remove go first."""
    done = list_checkpoints(output_dir)
    if not done:
        return None
    need = checkpoint_bytes(done[-1]) * 11 // 10
    doomed = done[:-1] if limit <= 1 else done[:max(0, len(done) + 1 - limit)]
    free = shutil.disk_usage(output_dir).free
    while free < need and doomed:
        old = doomed.pop(0)
        shutil.rmtree(old, ignore_errors=True)
        print(f"[checkpoint] {_size(free)} free on the disk of {output_dir} and a checkpoint takes ~{_size(need)}: "
              f"removed {os.path.basename(old)} before saving checkpoint-{step} (--save_total_limit {limit} would "
              f"remove it after)", flush=True)
        free = shutil.disk_usage(output_dir).free
    if free >= need:
        return None
    return (f"error: the disk of {output_dir} has {_size(free)} free and a checkpoint takes ~{_size(need)} "
            f"({os.path.basename(done[-1])}'s size and a tenth): stopped before saving checkpoint-{step}, which "
            f"would fail midway. The last good checkpoint is {done[-1]}: free some space and relaunch to resume "
            f"from it")


def disk_full(error, output_dir, last):
    """Whether a failed save ran out of disk: ENOSPC or EDQUOT, or less room left than the last checkpoint takes."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(output_dir).free < max(checkpoint_bytes(last) if last else 0, 256 << 20)
    except OSError:
        return False


def export_model(engine, processor, out_dir, master, merged=False):
    """A collective: the model in HF format in out_dir, gathered onto rank 0 (`master`). Under LoRA the adapter
    alone, in PEFT's format, and with `merged` the merged model in out_dir + "_merged" too."""
    if hasattr(engine.module, "peft_config"):
        state_dict = model.adapter_state(engine.module)
        if master:
            # the base's embeddings are unchanged: PEFT would otherwise add them when lm_head has an adapter
            engine.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True,
                                          save_embedding_layers=False)
            processor.save_pretrained(out_dir)
        if merged:
            export_merged(engine.module, processor, out_dir + "_merged", master)
        dist.barrier()
        return
    state_dict = engine._zero3_consolidated_16bit_state_dict()
    if master:
        engine.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(out_dir)
    dist.barrier()


def export_merged(peft_model, processor, out_dir, master):
    """A PeftModel saved as its plain model, W + scale x B A, merged a bucket at a time on rank 0's host."""
    import deepspeed

    lora, state = rollout.lora_layers(peft_model), {}
    for bucket in rollout.sync_buckets(peft_model, 1024):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
            state.update((n, t.detach().to("cpu", copy=True)) for n, t in rollout.hf_weights(bucket, lora) if master)
    if master:
        peft_model.get_base_model().save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        processor.save_pretrained(out_dir)
