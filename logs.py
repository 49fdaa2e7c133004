"""Where the numbers go: metrics.jsonl (rank 0, one JSON row per step, the record a run is judged by), wandb
(rank 0, and a disabled run on the other ranks, so no ifs), a few trajectories in completions.jsonl and a wandb
table, and reward.png. A wandb failure never stops training: metrics.jsonl keeps every row, and the next launch
logs again the rows wandb is missing.
"""
import json
import os
import secrets

from PIL import Image

import job

# Seconds wandb.init may wait for its server before the run goes on offline, while every rank waits
# (docs/resilience.md, wandb that does not start). The environment's WANDB_INIT_TIMEOUT overrides it.
WANDB_INIT_TIMEOUT = 30


def open_logs(run, resumed):
    """Start wandb (a relaunch continues the same run) and metrics.jsonl, whose rows are kept up to the checkpoint
    when `resumed`, else dropped."""
    args = run.args
    on = run.master and args.report_to == "wandb"
    run.wandb = start_wandb(args, wandb_mode() if on else "disabled",
                            wandb_run_id(args.output_dir, fresh=args.resume == "none") if on else None)
    run.metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if run.master:
        kept = trim_metrics(run.metrics_path, run.start if resumed else -1)
        trim_metrics(os.path.join(args.output_dir, COMPLETIONS), run.start if resumed else -1)   # the same rows again
        # A killed process loses what wandb had not yet written (its tail), so a relaunch logs the
        # kept rows again: wandb keeps a step it does not have and drops one it has (steps only grow).
        for row in kept if on else []:
            if row["step"] >= run.wandb.step:
                run.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])


def wandb_mode():
    """Rank 0's wandb mode: an exported WANDB_MODE, else online with WANDB_API_KEY and offline without."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def start_wandb(args, mode, run_id):
    """wandb.init in `mode`, for at most WANDB_INIT_TIMEOUT seconds -> the run. A start that fails is said and
    tried again offline with the same run id (for `wandb sync`), then disabled."""
    import wandb
    timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", WANDB_INIT_TIMEOUT))
    tries = [mode, *{"disabled": [], "offline": ["disabled"]}.get(mode, ["offline", "disabled"])]
    for now, fallback in zip(tries, tries[1:] + [None]):
        try:
            return wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args), dir=args.output_dir,
                              id=run_id, resume="allow", mode=now, settings=wandb.Settings(init_timeout=timeout))
        except Exception as e:   # wandb's errors are many (CommError, AuthenticationError, pydantic's for a bad mode)
            if fallback is None:
                raise
            where = f"; `wandb sync {os.path.join(args.output_dir, 'wandb')}` uploads it later" \
                if fallback == "offline" else "; metrics.jsonl keeps every row"
            print(f"[wandb] could not start {now} ({type(e).__name__}: {e}); continuing {fallback}{where}", flush=True)
            try:   # the failed run keeps its id in wandb's service ("run ID ... is in use"): a fresh service
                wandb.teardown()
            except (Exception, SystemExit) as e:   # teardown exits with the service's own exit code, if not 0
                print(f"[wandb] teardown after the failed start: {type(e).__name__}: {e}")


def write_metrics(run, m, step):
    """Rank 0: one row of metrics.jsonl, and the same to wandb."""
    if run.master:
        with open(run.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **m}) + "\n")
        wandb_call(run, run.wandb.log, m, step=step)


def wandb_call(run, fn, *a, **k):
    try:
        fn(*a, **k)
    except Exception as e:   # never lose a step of training for its log (its service killed with the job, say)
        if not run.wandb_failed:
            print(f"[wandb] {type(e).__name__}: {e}; metrics.jsonl keeps every row, the next launch re-logs them")
        run.wandb_failed = True


def log_completions(run, groups, step):
    """Rank 0, every --log_completions_steps: a few trajectories to the run folder (write_trajectories), and with
    --report_to wandb a table of this rank's prompts, completions and rewards."""
    args = run.args
    if not (run.master and args.log_completions_steps and step % args.log_completions_steps == 0):
        return
    write_trajectories(run, groups, step)
    if args.report_to != "wandb":
        return
    import wandb
    tools = ["trajectory", "tool image"] if args.tools else []   # every turn and call, the first image a tool gave
    table = wandb.Table(columns=["image", "prompt", "completion", "reward", *args.reward_funcs, *tools])
    for g in groups:
        for c in g.completions:
            trajectory = [run.processor.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                          wandb.Image(c.images[0]) if c.images else None] if args.tools else []
            table.add_data(wandb.Image(g.sample["images"][0]) if g.sample["images"] else None,
                           run.processor.tokenizer.decode(g.sample["vllm_ids"]), c.text, scores(c)["reward"],
                           *[scores(c)["rewards"][n] for n in args.reward_funcs], *trajectory)
    wandb_call(run, run.wandb.log, {"completions": table}, step=step)


COMPLETIONS = "completions.jsonl"   # in the run folder, beside metrics.jsonl; the images in completions/step_<n>/


def write_trajectories(run, groups, step):
    """Append the first completion of each of the first --log_completions groups to output_dir/completions.jsonl,
    one row each (prompt, completion or trajectory and calls, rewards, advantage), so that a person can look
    without wandb. The images the model saw (the prompt's, downscaled; each video's frames; the tools') go to
    completions/step_<n>/ as PNG, named in the row."""
    args, decode = run.args, run.processor.tokenizer.decode
    folder = os.path.join(args.output_dir, "completions", f"step_{step}")
    with open(os.path.join(args.output_dir, COMPLETIONS), "a") as f:
        for i, g in enumerate(groups[:args.log_completions]):
            c, s = g.completions[0], g.sample
            seen = []
            # as the model saw them: a box in the completion refers to the downscaled image, not the data's
            pictures = [("prompt", im) for im in s["images"]] + [("video", frames_sheet(frames))
                                                                  for frames, _ in s.get("videos") or []]
            for j, (kind, im) in enumerate(pictures + [("tool", im) for im in c.images]):
                os.makedirs(folder, exist_ok=True)
                seen.append(os.path.join("completions", f"step_{step}", f"{i}_{j}_{kind}.png"))
                im.save(os.path.join(args.output_dir, seen[-1]))
            adv = c.advantage.tolist() if hasattr(c.advantage, "tolist") else c.advantage   # per token: a list
            f.write(json.dumps({"step": step, "where": s.get("where"), "id": s.get("id"),
                                "prompt": decode(s["vllm_ids"]), "completion": c.text,
                                "finish_reason": c.finish_reason, **scores(c), "advantage": adv,
                                **({"trajectory": decode(c.token_ids, skip_special_tokens=True),
                                    "calls": [{"call": call, "error": error, "kind": kind}
                                              for call, error, kind in c.calls]}
                                   if args.tools else {}),
                                "images": seen}, default=float) + "\n")


def scores(c):
    """A completion's reward and rewards for a person to read: null where a reward failed, and which failed."""
    failed = [n for n, f in c.failed.items() if f]
    return {"reward": None if failed else c.total, "rewards": {n: None if c.failed.get(n) else v
                                                                for n, v in c.rewards.items()},
            **({"unscored": f"{', '.join(failed)} failed"} if failed else {})}


def frames_sheet(frames):
    """A video's frames (n, h, w, 3) uint8 as one image: side by side, eight a row, in the order shown."""
    n, h, w = frames.shape[:3]
    cols = min(n, 8)
    sheet = Image.new("RGB", (cols * w, -(-n // cols) * h))
    for k, frame in enumerate(frames):
        sheet.paste(Image.fromarray(frame), ((k % cols) * w, (k // cols) * h))
    return sheet


def plot_rewards(metrics_path):
    """Train reward (sampled) and validation reward (greedy) against step, next to metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("reward/mean", "-"), ("val/reward", "o-")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=key, alpha=0.6 if key == "reward/mean" else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    png = os.path.join(os.path.dirname(metrics_path), "reward.png")
    fig.savefig(png, dpi=100, bbox_inches="tight")
    return png


def trim_metrics(path, step):
    """Keep the rows of metrics.jsonl up to `step` (the checkpoint's) and return them; a line torn by a kill
    mid-append is dropped."""
    if not os.path.exists(path):
        return []
    rows = []
    for i, line in enumerate(open(path), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"[resume] {path}:{i}: dropped a torn line (killed mid-write)")
    keep = [r for r in rows if r["step"] <= step]
    job.write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))
    return keep


def wandb_run_id(output_dir, fresh=False):
    """The output_dir's wandb run id, written at the first launch (or when `fresh`) before any step."""
    path = os.path.join(output_dir, "wandb_run_id")
    if fresh or not os.path.exists(path):
        job.write_atomic(path, secrets.token_hex(4))   # wandb's id alphabet; not `random`, which is seeded
    return open(path).read().strip()
