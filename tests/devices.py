"""Tests of what runs on CPU tensors and gloo run on a GPU host too: on the CPU, not skipped.

ftctl picks its device from ``torch.cuda.is_available()`` in the process and from
``CUDA_VISIBLE_DEVICES`` (:func:`ftctl.preflight.gpu_visible`) before torch loads; hiding the GPU from
both makes this process and every process it starts train on the CPU, as on a machine without one.
"""

from __future__ import annotations

import contextlib

import pytest


@contextlib.contextmanager
def cpu_only():
    import torch

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # children (torchrun, ftctl subprocesses) and gpu_visible()
        patch.setattr(torch.cuda, "is_available", lambda: False)  # this process, whose CUDA may be up already
        yield
