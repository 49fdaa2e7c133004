"""Test tools that misbehave, for tests/test_tools.py: one that never returns and one that returns a huge image; a
test registers them into toolbox.TOOLS (monkeypatch.setitem). Run as a script, this is train.py with the zoom task's
crop replaced by one that never returns (the zoom model calls "crop"; its schema is crop's) and toolbox.TOOL_TIME_S
from the environment, so that a launch under DeepSpeed's launcher can show that a stuck tool holds no process:

    python -m deepspeed.launcher.launch ... tests/tool_probes.py --tiny_task zoom ...

(a script, not a plugin)."""
import functools
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from PIL import Image  # noqa: E402

import toolbox  # noqa: E402

NEVER = threading.Event()   # a test sets it at its end, so that its hung calls' threads end


def hang(sample, n: int) -> str:
    """Wait for ever.

    Args:
        n: any number: distinct calls are distinct threads
    """
    NEVER.wait()
    return "never"


def huge(sample, side: int):
    """An image of side x side pixels, as a tool that renders at its own size may return.

    Args:
        side: pixels a side
    """
    return Image.new("RGB", (side, side), (200, 30, 30))


@functools.wraps(toolbox.crop)
def crop_that_hangs(sample, *args, **kwargs):
    NEVER.wait()


if __name__ == "__main__":
    import job
    import tiny
    import train
    # built with the real crop first: the build's own calls must return (a clean checkout)
    tiny.ensure_default(task="zoom")
    toolbox.TOOLS["crop"] = crop_that_hangs
    toolbox.TOOL_TIME_S = float(os.environ.get("TOOL_TIME_S", toolbox.TOOL_TIME_S))
    job.run_then_exit(train.main)
