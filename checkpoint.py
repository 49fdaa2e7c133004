"""What a checkpoint holds, and finding it again: checkpoints written atomically, checked and resumed (on the same
or another number of ranks), the flags and data a relaunch may change, and the HF-format export.

A checkpoint is output_dir/checkpoint-<step>: DeepSpeed's own save_checkpoint (ZeRO-3 shards,
optimizer, scheduler) under zero/, one rank<r>.pt per rank (RNG states, data position) and
trainer_state.json (step, flags, ranks, wandb run id, the training data's fingerprint, the manifest). It is
written as checkpoint-<step>.tmp and renamed last, so a crash mid-save never leaves a directory that resume
would take as complete. A resume on another number of ranks converts it once into universal/ (DeepSpeed's
universal checkpoint) and carries every rank's data position and RNG over (to_universal, resume).
The job's own lifetime (the output folder's owner, signals, what a killed launch leaves): job.py.
"""
import errno
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


def save_checkpoint(engine, args, step, stream, run_id, rank, reference=None):
    """Full state in output_dir/checkpoint-<step>: ZeRO-3 shards with optimizer and scheduler
    (DeepSpeed's save_checkpoint), every rank's RNG and data position, and last trainer_state.json: step,
    flags, ranks, wandb id and the manifest (every other file's size and CRC32) that pick_checkpoint checks
    before a resume; `reference` (ref engine, fp32 masters or None): a reference model that moves (--ref_ema), each
    rank's part of it in reference<r>.pt (reference_parts). Written to checkpoint-<step>.tmp and renamed last, so a
    crash mid-save never leaves a directory that resume would pick as complete. A disk without room for it
    (make_room) stops the run before the save; one that fills up during it stops the run saying so. Both name the
    last good checkpoint."""
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
            # frozen weights (LoRA's base model, a frozen vision tower) are the checkpoint's they were loaded
            # from: left out, a LoRA checkpoint is adapter-sized, and a resume keeps them as loaded
            engine.save_checkpoint(tmp, tag="zero", exclude_frozen_parameters=has_frozen(engine))
        finally:   # offload_states reuses them at the next offload
            for state, key, buf in aside:
                state[key] = buf
        torch.save({"rng": rng_state(), "stream": stream.state()}, os.path.join(tmp, f"rank{rank}.pt"))
        if reference is not None:
            torch.save(reference_parts(*reference), os.path.join(tmp, f"reference{rank}.pt"))
        dist.barrier()
        files = manifest(tmp)   # a collective: each rank reads its share of the files
        if rank == 0:
            with open(os.path.join(tmp, STATE + ".part"), "w") as f:   # whole or absent: a kill mid-write leaves .part
                json.dump({"step": step, "wandb_id": run_id, "world": dist.get_world_size(), "args": vars(args),
                           "data": getattr(stream, "source", None), "files": files}, f, indent=1)
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
    """[(state dict, key)] of DeepSpeed offload_states' host copies of Adam's moments: it keeps them
    in the optimizer state as <key>_offload_buffer (runtime/zero/offload_states.py), so a checkpoint
    would save them and load_state_dict would move them to the GPU, after which every offload
    "offloads" into GPU memory. Kept out of checkpoints (save_checkpoint) and dropped after a load."""
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
    """Load `ckpt`, the checkpoint pick_checkpoint chose and checked (None: start at step 0): weights,
    optimizer, scheduler, this rank's data position and RNG, with this launch's learning rate, weight decay
    and schedule over the saved ones. A checkpoint of another number of ranks loads from the universal
    checkpoint pick_checkpoint made of it, and every rank's position and RNG are carried over from all the
    saved ones (regroup, rng_of_rank). Data that changed since the save (accepted with --accept_changed_data)
    starts a fresh epoch. `reference` (ref engine, fp32 masters or None): a reference that moves, loaded from the
    checkpoint's reference<r>.pt files (load_reference), on any number of ranks. -> (the checkpoint or None, its
    step or 0)."""
    if not ckpt:
        return None, 0
    with open(os.path.join(ckpt, STATE)) as f:
        state = json.load(f)
    saved, world = state.get("world") or saved_ranks(ckpt), _share()[1]
    # DeepSpeed loads zero/ through its checkpoint engine's torch.load(weights_only=False) (torch_checkpoint_engine.py
    # :37); this engine's go through safe_load instead (pick_checkpoint checked every file the same way before)
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


# ----------------------------------------------------------------------------- the reference's own state
# A reference model that moves (--ref_ema) has a state of its own. DeepSpeed saves no engine without an optimizer, so
# each rank saves its part: every parameter's ZeRO-3 partition (ds_tensor) and, beside a bf16 reference, its fp32
# master. ZeRO-3 pads a parameter to a multiple of the ranks and gives rank r the r-th slice of it, so the parts of
# any number of ranks join into the whole parameter and split again for another (load_reference): the reference goes
# through a change of rank count as the policy goes through DeepSpeed's universal checkpoint.
def reference_parts(ref_engine, masters):
    """This rank's part of a moving reference: {numel: each parameter's size, parts: its partitions, masters: the fp32
    masters or None}, in the module's parameter order."""
    params = list(ref_engine.module.parameters())
    return {"numel": [p.ds_numel for p in params], "parts": [p.ds_tensor.detach().cpu().clone() for p in params],
            "masters": [m.detach().cpu().clone() for m in masters] if masters else None}


def load_reference(ref_engine, masters, ckpt, rank, world, saved):
    """The reference's saved parts (reference_parts, `saved` ranks) into this launch's partitions and masters: each
    parameter joined from the saving ranks' slices and this rank's slice of it taken (the same files when the rank
    count is the same); the partitions set through model.update_params, so a parameter kept whole on every rank
    is gathered again from them. A checkpoint without them (saved before the reference moved) leaves the reference
    as loaded, said."""
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
    """rank<r>.pt of `ckpt`: that rank's RNG states and data position. weights_only: the file can build
    tensors, plain containers and the numpy types of the RNG state (SAFE_TYPES), and run no other code."""
    return safe_load(os.path.join(ckpt, f"rank{rank}.pt"))


def safe_load(path, map_location=None, mmap=False):
    """torch.load(weights_only=True) of a checkpoint's file, which can build tensors, plain containers and
    SAFE_TYPES, and run no other code; a file that would is refused naming it (SystemExit), never with torch's
    advice to load it with weights_only=False, which would run that code."""
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
    """Before a resume, on every rank (a collective: each reads every world-th file): each .pt file of `ckpt`
    (DeepSpeed's zero/ shards and optimizer states, rank<r>.pt, a universal/ folder) unpickled with weights_only,
    its tensors memory-mapped, not read. -> [what untrusted() says of each file that would build anything else].
    DeepSpeed unpickles them with weights_only=False (torch_checkpoint_engine.py:37, stage3.py:3660 and 3770,
    ds_to_universal.py), so a file of someone else's could run code at a resume: the check comes before any load."""
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
    """The RNG states for `rank` of a launch resuming the states `saved` by another number of ranks (rank
    order). A rank that existed goes on with its own python, numpy and torch CPU streams. One that did not is
    seeded from saved rank 0's torch state and its own rank, so that no two ranks share a stream and a
    relaunch on the same number of ranks repeats it; the streams of saved ranks beyond this launch's end.
    CUDA's generators are seeded the same way on every rank (torch.manual_seed), since a saved rank's list of
    per-device states belongs to the devices of its node. vLLM's sampling seeds do not come from these."""
    seed = zlib.crc32(saved[0]["torch"].numpy().tobytes() + rank.to_bytes(4, "little"))
    st = {"python": random.Random(seed).getstate(), "numpy": np.random.RandomState(seed).get_state(),
          "torch": torch.Generator().manual_seed(seed).get_state()}
    if rank < len(saved):
        st.update({k: saved[rank][k] for k in ("python", "numpy", "torch")})
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return st


def load_universal(engine, folder):
    """engine.load_checkpoint from DeepSpeed's universal checkpoint `folder` (to_universal): each rank takes its
    own ZeRO-3 partition of every parameter's fp32 weights and Adam moments, whatever the number of ranks that
    saved them; the step and the LR schedule come from saved rank 0's model states. DeepSpeed reads the config's
    `checkpoint.load_universal` inside load_checkpoint only (engine.py, load_universal_checkpoint()), and the
    engine is built before the checkpoint is read: it is switched on for this one load."""
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
    """A collective, before a resume on another number of ranks: `ckpt`'s ZeRO-3 shards as DeepSpeed's
    universal checkpoint in ckpt/universal (per parameter its whole fp32 weights and Adam moments, which any
    number of ranks loads), made once and kept for later resumes. Rank 0 runs DeepSpeed's converter
    (universal_command) and every rank asks it every `poll_s` whether it is done: a short collective, so no
    rank waits in one longer than torch.distributed's timeout, and a dead rank 0 ends the wait. Written to
    universal.tmp with its manifest (trainer_state.json) last, then renamed: a kill mid-conversion leaves a
    .tmp that the next launch converts again. -> the folder; SystemExit on every rank when it fails."""
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
# What a checkpoint's files may build beside tensors and plain containers when they are loaded (safe_load): the RNG
# state's numpy types (rank<r>.pt), and the ZeRO stage and loss scaler in DeepSpeed 0.19.8's optimizer states
# (zero/*_optim_states.pt, universal/zero/optimizer_state.pt: torch.serialization.get_unsafe_globals_in_checkpoint)
SAFE_TYPES = [*RNG_STATE_TYPES, ZeroStageEnum, LossScaler, DynamicLossScaler]


def has_frozen(engine):
    """Whether some weights train not (LoRA's base, a frozen vision tower): checkpoints leave them out."""
    return any(not p.requires_grad for p in engine.module.parameters())


def rate_of_this_schedule(engine, learning_rate=None, weight_decay=None):
    """After load_checkpoint the optimizer holds the saving run's rates: the param groups' lr and weight
    decay and the scheduler's base rates come back from the checkpoint (torch's load_state_dict). A relaunch
    with another --learning_rate trained at the saved one, and one with another --max_steps (the decay's
    length) trained its first step at the saved schedule's rate (0 after a finished cosine). Both are set
    again from this launch's flags and schedule at the restored step, as the scheduler's own step would."""
    sched = engine.lr_scheduler
    if learning_rate is not None:   # model.ds_config gives the optimizer one param group, at this rate
        sched.base_lrs = [learning_rate] * len(sched.base_lrs)
    for group, base, factor in zip(engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)
        if weight_decay is not None:
            group["weight_decay"] = weight_decay


def list_checkpoints(output_dir):
    """Checkpoints renamed from .tmp, with trainer_state.json, oldest first (pick_checkpoint checks one
    against its manifest before a resume)."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.exists(os.path.join(output_dir, name, STATE)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


# ----------------------------------------------------------------------------- whole checkpoints, and room for them
# trainer_state.json is a checkpoint's last file, and holds its manifest: every other file's size and CRC32.
# The size catches a file cut short or deleted, the CRC32 one whose bytes changed. zlib's CRC32 reads ~4 GB/s
# on one core here (sha256 1.7, blake2b 0.9), each rank reads every world-th file, and right after a save the
# files are still in the page cache: the tiny model's 2.2 MB checkpoint costs about 3 ms to save and to check;
# a 7B model's full state (~100 GB over 8 ranks) about 3 s per rank at a save, and one more read of its shards
# at a resume (docs/resilience.md).
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
    """{path under ckpt: [size, CRC32]} of every file there but trainer_state.json. Under torch.distributed
    a collective: rank 0 lists the files, each rank reads every world-th."""
    rank, world = _share()
    names = _from_rank0(sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs
                               if os.path.join(d, f) != os.path.join(ckpt, STATE)) if rank == 0 else None)
    mine = {n: [os.path.getsize(os.path.join(ckpt, n)), data.file_crc32(os.path.join(ckpt, n))] for n in names[rank::world]}
    return dict(sorted((n, v) for part in _from_everyone(mine) for n, v in part.items()))


def damage(ckpt):
    """What is wrong with the checkpoint folder `ckpt`, one line each; [] when it is whole. Under
    torch.distributed a collective (each rank reads every world-th file). A checkpoint saved before
    checkpoints had a manifest is taken as whole, as it was then."""
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
    """Before anything heavy, on every rank (a collective): the checkpoint this launch resumes from
    (--resume), every file checked against its manifest, and its flags compared with this launch's
    (changed_flags: a change that steers the rest of the run is said and applied, one that changes what
    the saved state means is refused, SystemExit on every rank). With --resume auto, a damaged checkpoint
    is set aside as <name>.damaged and the newest whole one is used, said with the file that was wrong; a
    whole checkpoint-<step>.tmp (killed after its last write, before its rename) is kept; an unfinished
    one is removed. A refused launch changes nothing on disk. -> the checkpoint, or None (step 0)."""
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
    """--train_data's contents now against the fingerprint its checkpoint was saved with (`saved`, trainer_state.json's
    "data"; None before checkpoints had one). -> (lines that say the change, the refusal or None). The saved data
    position is a cursor into a seeded shuffle of the row numbers, and a row number names another sample once rows
    are appended, removed or reordered: such a change is refused by name unless --accept_changed_data, with which
    resume starts a fresh epoch over the rows as they are (PromptStream.restart)."""
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
    """Rank 0, --resume auto: damaged checkpoints renamed to <name>.damaged (kept for a look; out of
    list_checkpoints), unfinished .tmp folders removed, a whole chosen .tmp renamed as its save would have.
    -> (the chosen checkpoint's path now, the lines that say what was done)."""
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
    """Rank 0 before the save of `step`: None when the disk of output_dir has room for one more checkpoint
    of the last one's size (a tenth more: the data position's history grows), else what to say, with the
    last good checkpoint. Short of room, the old checkpoints this save would remove after it
    (--save_total_limit) go first, never the newest. The first save has no size to go by."""
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
    """Whether a failed save ran out of disk: ENOSPC or EDQUOT, or (torch's writer drops the errno and says
    "unexpected pos" or "basic_ios::clear: iostream error") less room left than the last checkpoint takes,
    or 256 MB."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(output_dir).free < max(checkpoint_bytes(last) if last else 0, 256 << 20)
    except OSError:
        return False


def export_model(engine, processor, out_dir, master, merged=False):
    """HF-format model (safetensors + processor + chat template) that transformers and vLLM load.
    The full state dict is gathered from the ZeRO-3 shards onto rank 0 (a collective). With LoRA
    (--use_peft) the adapter alone, in PEFT's format (adapter_model.safetensors + adapter_config.json
    naming the base model), which PEFT, transformers and vLLM load on top of the base; `merged`
    (--export_merged): also the merged model, in out_dir + "_merged"."""
    if hasattr(engine.module, "peft_config"):
        state_dict = model.adapter_state(engine.module)
        if master:
            # the base's embeddings are unchanged: PEFT would otherwise add them when lm_head has an adapter
            engine.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
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
    """A PeftModel as the plain HF model it stands for: W + scale x B A under the base names, gathered one
    bucket of whole layers at a time and merged as the merged weight sync does (rollout.hf_weights), onto
    rank 0's host (as the full model's export gathers it). The GPU never holds the model merged whole."""
    import deepspeed

    lora, state = rollout.lora_layers(peft_model), {}
    for bucket in rollout.sync_buckets(peft_model, 1024):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
            state.update((n, t.detach().to("cpu", copy=True)) for n, t in rollout.hf_weights(bucket, lora) if master)
    if master:
        peft_model.get_base_model().save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        processor.save_pretrained(out_dir)
