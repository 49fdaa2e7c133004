"""Does a demo learn on more than one seed? Runs `make demo [TASK=grounding|zoom|motion]`'s command (2 processes,
the embedded defaults) once per seed, stops a run once greedy validation has reached the threshold
at two validations in a row (SIGTERM: it checkpoints and exits 75), and prints the report's table.
The seeds change the data order and the samples; the tiny model's weights are the same in every run.
`--control` runs the zoom and motion demos' controls instead (controls(): the same model without what the task needs);
`--plot PNG` draws the runs already in runs/ for --seeds, each beside its control (docs/demos.md's pictures).

    OMP_NUM_THREADS=1 .venv/bin/python tools/seeds.py --task colour --seeds 0 1 2 3 4 [-- --learning_rate 2e-3]
Runs go to runs/seeds-<task>[-control]-<S>; flags after `--` are passed to train.py (explicit flags win, as ever)."""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import tiny  # noqa: E402


def controls(task):
    """The flags of a demo's control (docs/demos.md): the zoom task without its tool (the shown image alone, where
    the dots' colour is gone); the motion task's clips each made of its first frame (tiny.build_motion_task)."""
    if task == "zoom":
        return ["--tools"]
    folder = os.path.dirname(tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"), task="motion")[1])
    return ["--train_data", os.path.join(folder, "train_first_frame.jsonl"),
            "--val_data", os.path.join(folder, "val_first_frame.jsonl")]


def validations(path, key="val/reward"):
    """[(step, value)] of the validation rows in a run's metrics.jsonl so far (`key`: their metric)."""
    if not os.path.exists(path):
        return []
    rows = [json.loads(line) for line in open(path) if line.endswith("\n")]
    return [(r["step"], r[key]) for r in rows if key in r]


def run(task, seed, threshold, extra, procs, tag="", key="val/reward"):
    out = os.path.join(ROOT, "runs", f"seeds-{task}{tag}-{seed}")
    shutil.rmtree(out, ignore_errors=True)   # a fresh run each time: --resume auto would continue an old one
    with socket.socket() as sock:   # a free port: two sweeps side by side must not share a rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [os.path.join(ROOT, ".venv", "bin", "deepspeed"), "--num_gpus", str(procs), "--master_port", str(port),
           "train.py", "--output_dir", out, "--seed", str(seed), "--tiny_task", task, "--val_freq", "10",
           "--ds_set", "zero_optimization.stage3_param_persistence_threshold=0", "--no-save_final_model", *extra]
    start = time.time()
    with open(out + ".log", "w") as log:
        job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true"))
        while job.poll() is None:
            time.sleep(5)
            val = validations(os.path.join(out, "metrics.jsonl"), key)
            if len(val) >= 2 and min(v for _, v in val[-2:]) >= threshold:
                os.killpg(job.pid, signal.SIGTERM)   # held twice: enough for the report; checkpoint, exit 75
                job.wait()
        while True:   # the ranks finish their step after the launcher has gone: the next seed starts on a quiet machine
            try:
                os.killpg(job.pid, 0)
                time.sleep(0.5)
            except ProcessLookupError:
                break
    val = validations(os.path.join(out, "metrics.jsonl"), key)
    first = next((s for s, v in val if v >= threshold), None)
    return dict(seed=seed, first=first, best=max(val, key=lambda sv: sv[1]) if val else None,
                last=val[-1] if val else None, minutes=(time.time() - start) / 60, rc=job.returncode, val=val)


def plot(task, seeds, png):
    """Greedy validation, train reward and (zoom) calls a trajectory of each seed's run in runs/seeds-<task>-<S>,
    beside its control's in runs/seeds-<task>-control-<S>, as one PNG."""
    import matplotlib  # only for --plot
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [("val/reward", "greedy validation"), ("reward/mean", "train reward")]
    keys += [("tools/calls_mean", "tool calls a trajectory")] if task == "zoom" else []
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), sharex=True)
    for tag, colour, name in (("", "C0", task), ("-control", "C3", "control")):
        for seed in seeds:
            path = os.path.join(ROOT, "runs", f"seeds-{task}{tag}-{seed}", "metrics.jsonl")
            rows = [json.loads(line) for line in open(path) if line.endswith("\n")]
            for ax, (key, title) in zip(axes, keys):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    ax.plot(*zip(*pts), "o-" if key == "val/reward" else "-", color=colour, alpha=0.7, markersize=3,
                            label=name if seed == seeds[0] else None)
                ax.set_title(title, fontsize=10)
                ax.set_xscale("symlog", linthresh=10)   # the first 10 steps linear: a demo may learn there
                ax.set_xlabel("step (linear to 10, then log)")
                ax.set_ylim(-0.02, 1.02)
                ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{task}: seeds {', '.join(map(str, seeds))}, each beside its control", fontsize=10, y=1.03)
    fig.savefig(png, dpi=100, bbox_inches="tight")
    print(png)


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="colour", choices=["colour", "grounding", "zoom", "motion"])
    p.add_argument("--control", action="store_true", help="the zoom or motion demo's control (controls())")
    p.add_argument("--plot", default=None,
                   help="draw the runs of --seeds and their controls into this PNG; run nothing")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--threshold", type=float, default=0.9,
                   help="greedy validation reward (the grounding task's is its IoU)")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--metric", default="val/reward",
                   help="the validation metric the threshold reads (val/accuracy where the reward's weight is 0)")
    p.add_argument("--tag", default="",
                   help="runs/seeds-<task><tag>-<seed>: two sweeps side by side need their own folders")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.plot:
        return plot(a.task, a.seeds, a.plot)
    if a.control:
        extra, a.tag = controls(a.task) + extra, a.tag + "-control"
    results = []
    for seed in a.seeds:
        results.append(run(a.task, seed, a.threshold, extra, a.procs, a.tag, a.metric))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{a.task}, {a.procs} processes, flags: {' '.join(extra) or '(the defaults)'}; "
          "greedy validation every 10 steps")
    print("| seed | first step at >= %g | best (step) | last (step) | minutes |\n"
          "| --- | --- | --- | --- | --- |" % a.threshold)
    for r in results:
        best = "%.2f (%d)" % (r["best"][1], r["best"][0]) if r["best"] else "-"
        last = "%.2f (%d)" % (r["last"][1], r["last"][0]) if r["last"] else "-"
        first = r['first'] if r['first'] is not None else 'never'
        print(f"| {r['seed']} | {first} | {best} | {last} | {r['minutes']:.1f} |")
    print(f"{sum(r['first'] is not None for r in results)} of {len(results)} seeds reach {a.threshold}")


if __name__ == "__main__":
    main()
