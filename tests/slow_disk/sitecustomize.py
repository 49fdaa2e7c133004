"""A disk slow enough to kill mid-save, for test_resume's SIGKILLs aimed at a checkpoint being written.

On PYTHONPATH of those launches only. A checkpoint is written as checkpoint-<step>.tmp and renamed
(checkpoint.save_checkpoint); where the disk is fast that window is a few milliseconds and a poll can
miss it (a CI run did). Here the rename waits while <output_dir>/checkpoint-<step>.hold exists, so the
kill lands in the window on a machine of any speed. An audit hook (os.rename and os.replace raise
"os.rename"): nothing in the code under test is patched."""
import os
import sys
import time


def _hold(event, args):
    if event == "os.rename" and str(args[0]).endswith(".tmp"):
        while os.path.exists(f"{args[1]}.hold"):
            time.sleep(0.05)


sys.addaudithook(_hold)
