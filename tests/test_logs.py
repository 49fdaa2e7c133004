"""wandb starts in the mode the user chose (WANDB_MODE over everything), within a bounded time, and a start
that fails goes offline and says so: a wandb failure never stops the run. Real wandb 0.31, no network: an
unreachable WANDB_BASE_URL stands in for a server that does not answer."""
import os
import time
import types

import pytest

import logs
import train
from conftest import wandb_history

KEY = "x" * 40        # wandb checks only the length of a key before it talks to the server
NOWHERE = "http://127.0.0.1:9"   # the discard port: nothing listens, every connection is refused


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """A clean wandb environment for one test: its variables removed, its settings in tmp_path, its
    process-wide singleton torn down before and after (it reads the environment once, when it starts)."""
    import wandb
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield monkeypatch
    wandb.teardown()


def fake_run(out_dir):
    args = train.parse_args(["--output_dir", str(out_dir), "--report_to", "wandb", "--resume", "none"])
    return types.SimpleNamespace(args=args, master=True, start=0, wandb=None, wandb_failed=False)


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_mode_is_respected_with_an_api_key(tmp_path, wandb_env, mode):
    """An API key in the environment and WANDB_MODE exported: the user's mode, at once. (Before: forced online,
    it waited for the server and crashed the run; WANDB_INIT_TIMEOUT=5 makes that fail in seconds, not 100.)"""
    import wandb
    wandb_env.setenv("WANDB_API_KEY", KEY)
    wandb_env.setenv("WANDB_MODE", mode)
    wandb_env.setenv("WANDB_BASE_URL", NOWHERE)
    wandb_env.setenv("WANDB_INIT_TIMEOUT", "5")
    run = fake_run(tmp_path)
    t = time.monotonic()
    logs.open_logs(run, resumed=False)
    assert run.wandb.settings.mode == mode and time.monotonic() - t < 15   # a second or two: no server asked
    logs.write_metrics(run, {"reward/mean": 0.5}, step=1)
    run.wandb.finish()
    wandb.teardown()   # its service writes the last records as it exits
    assert not run.wandb_failed
    if mode == "offline":
        run_id = open(tmp_path / "wandb_run_id").read().strip()
        history = wandb_history(tmp_path)
        assert list(history) == [run_id] and list(history[run_id]) == [1] and "reward/mean" in history[run_id][1]


def test_a_failed_online_start_goes_offline_and_says_so(tmp_path, wandb_env, capsys):
    """Online (an API key, no WANDB_MODE) with a server that never answers: wandb.init gives up after
    logs.WANDB_INIT_TIMEOUT seconds (wandb's own default is 90, plus 10 of grace), the run goes on with an
    offline wandb run of the same id (`wandb sync` uploads it later), and the message says so."""
    import wandb
    wandb_env.setenv("WANDB_API_KEY", KEY)
    wandb_env.setenv("WANDB_BASE_URL", NOWHERE)
    wandb_env.setattr(logs, "WANDB_INIT_TIMEOUT", 3, raising=False)   # raising=False: code without it fails below
    run = fake_run(tmp_path)
    t = time.monotonic()
    logs.open_logs(run, resumed=False)
    took = time.monotonic() - t
    assert run.wandb.settings.mode == "offline" and took < 30, took
    out = capsys.readouterr().out
    assert "[wandb] could not start online" in out and "continuing offline" in out and "wandb sync" in out
    logs.write_metrics(run, {"reward/mean": 0.5}, step=1)
    run.wandb.finish()
    wandb.teardown()   # its service writes the last records as it exits
    run_id = open(tmp_path / "wandb_run_id").read().strip()
    history = wandb_history(tmp_path)   # the failed online attempt left no offline run of its own
    assert run.wandb.id == run_id and list(history) == [run_id] and "reward/mean" in history[run_id][1]
