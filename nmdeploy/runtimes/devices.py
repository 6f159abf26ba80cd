"""Where torch work runs: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (the GPU when torch sees one), checked up front."""

from __future__ import annotations

import re

from nmdeploy.errors import InputError

DEVICE_CHOICES = "cpu, cuda, cuda:N or auto"
_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def check_device(device: str) -> str:
    """``device`` when it is well formed (torch not imported); otherwise an InputError naming the choices."""
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise InputError(f"device {device!r}: choose {DEVICE_CHOICES}")
    return device


def resolve_device(device: str) -> str:
    """The torch device ``device`` names on this machine: ``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``;
    a CUDA device torch cannot see is an InputError."""
    import torch

    check_device(device)
    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if device.startswith("cuda"):
        if not available:
            raise InputError(
                f"--device {device}: torch {torch.__version__} sees no CUDA device; use --device cpu (or auto), or "
                "install a CUDA build of torch on a machine with an NVIDIA GPU"
            )
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s), from cuda:0")
    return device
