"""A torch function mode that catches device mix-ups in calid's own code, with or without a GPU.

    with DeviceDiscipline():
        engine.generate(requests)

Inside it, every tensor factory called from code under calid/ (torch.zeros, torch.tensor, torch.rand,
...) must name its device: a bare call puts the tensor on the CPU, which breaks the moment the model
lives on a GPU, and that default is what this catches on a CPU-only machine. Every op called from
calid/ must also take all its tensors and its generator on one device kind (the check that bites on a
GPU). Calls from torch or other libraries are not judged.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

CALID = str(Path(__file__).resolve().parents[1])
FACTORIES = frozenset({torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand,
                       torch.randn, torch.randint, torch.as_tensor, torch.eye, torch.linspace})


class DeviceMixError(AssertionError):
    """calid code built a tensor on an implicit device, or mixed devices in one op."""


class DeviceDiscipline(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.checked = 0  # ops judged (calls from calid/)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = sys._getframe(1)
        if frame.f_code.co_filename.startswith(CALID):
            self.checked += 1
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            if func in FACTORIES and "device" not in kwargs:
                raise DeviceMixError(f"{func.__name__} without device= at {where}")
            devices = {a.device.type for a in _tensors(args, kwargs)}
            if kwargs.get("generator") is not None:
                devices.add(torch.device(kwargs["generator"].device).type)
            if "device" in kwargs and kwargs["device"] is not None and devices:
                devices.add(torch.device(kwargs["device"]).type)
            if len(devices) > 1:
                raise DeviceMixError(f"{getattr(func, '__name__', func)} mixes devices {sorted(devices)} at {where}")
        return func(*args, **kwargs)


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))
