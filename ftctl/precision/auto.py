"""The one rule of ``precision=auto``, shared by training, the estimator and dry runs.

Torch-free (the CLI asks it before torch loads): it reads the CPU's flags from /proc/cpuinfo and
takes the GPU's bf16 support as an argument.
"""

from __future__ import annotations

import os
from functools import lru_cache

from ftctl.errors import ConfigError

CPU_BF16_ENV = "FTCTL_CPU_BF16"
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=4)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset:
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 in hardware (AVX512-BF16 or AMX); emulated bf16 is far slower than fp32.

    FTCTL_CPU_BF16=1 or 0 overrides the probe: for tests of both kinds of CPU on one machine, and for a
    virtual machine whose advertised flags are not what its host runs.
    """
    forced = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if forced in ("1", "true", "yes"):
        return True
    if forced in ("0", "false", "no"):
        return False
    if forced not in ("", "auto"):
        raise ConfigError(f"{CPU_BF16_ENV}={forced!r}: expected 1, 0 or auto (unset probes the CPU)")
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def auto_precision(device_type: str, cuda_bf16: bool = True) -> str:
    """What precision=auto means on a device: bf16 on GPUs that have it (fp16 on older ones), bf16 on CPUs
    that compute it natively (measured faster at the same held-out score, see the README), else fp32."""
    if device_type == "cuda":
        return "bf16" if cuda_bf16 else "fp16"
    if device_type == "cpu" and cpu_has_native_bf16():
        return "bf16"
    return "fp32"
