"""An example of --plugins (docs/plugins.md): a tool and a reward of your own, in a file of your own.

    deepspeed train.py --plugins my_plugins.py --tools crop quadrant --reward_funcs accuracy tool_use ...

A plugin is a plain Python file. Its module-level TOOLS and REWARDS ({name: function}) join the project's own
(toolbox.TOOLS, reward.REWARDS) by name; every rank imports it before it reads the flags. This file is a test too:
tests/test_tools.py runs its tool and its reward, and a two-step launch loads it from outside the repository.
"""
import data  # the project's own helpers: a launch runs train.py from the project's folder
import toolbox

QUARTERS = {"top_left": (0, 0), "top_right": (1, 0), "bottom_left": (0, 1), "bottom_right": (1, 1)}


def quadrant(sample, which: str):
    """See one quarter of the image at a higher resolution.

    Args:
        which: the quarter to see: top_left, top_right, bottom_left or bottom_right
    """
    if which not in QUARTERS:   # an exception is the model's error message; the run goes on
        raise ValueError(f"which must be one of {', '.join(QUARTERS)}")
    original = toolbox.opened(sample["sources"][0])   # the image before the downscale the model saw
    col, row = QUARTERS[which]
    w, h = original.width // 2, original.height // 2
    region = original.crop((col * w, row * h, col * w + w, row * h + h))
    return data.downscale(region, *sample["pixel_bounds"])   # as every image: vLLM and the trainer see the same


def tool_use(completions, tool_calls=None, tool_failures=None, **kwargs):
    """1.0 for a trajectory that called a tool and whose every call worked, else 0.0 (--tools runs give these
    columns; without them every completion scores 0)."""
    calls, failures = tool_calls or [0] * len(completions), tool_failures or [0] * len(completions)
    return [float(n > 0 and bad == 0) for n, bad in zip(calls, failures)]


TOOLS = {"quadrant": quadrant}
REWARDS = {"tool_use": tool_use}
