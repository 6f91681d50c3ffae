"""Which GPUs `tandem up` may use, found without importing torch.

Order of precedence: the user's ``--gpus``, then ``CUDA_VISIBLE_DEVICES`` (its entries are passed on
to the children as they are, so UUIDs and MIG ids keep working), then ``nvidia-smi -L``. A
``CUDA_VISIBLE_DEVICES`` on a machine with no NVIDIA GPU at all (no driver, no device files, no
working nvidia-smi) is ignored, as vLLM's CPU build does: the workers run on the CPU.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping

_SMI_LINE = re.compile(r"^GPU (\d+):")


def parse_gpu_list(text: str) -> list[str]:
    """'0,1, 3' -> ['0', '1', '3']; an empty string or '-1' means no GPU (CUDA's convention)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or items[0] == "-1":
        return []
    return items


def parse_nvidia_smi(text: str) -> list[str]:
    """The indices listed by `nvidia-smi -L` ('GPU 0: NVIDIA H100 ... (UUID: ...)')."""
    return [m.group(1) for line in text.splitlines() if (m := _SMI_LINE.match(line.strip()))]


def nvidia_smi_list() -> str | None:
    """The output of `nvidia-smi -L`, or None when there is no working nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def nvidia_device_files() -> bool:
    """Whether the NVIDIA driver is loaded here (its /proc entry or /dev/nvidia* device files)."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def detect_gpus(
    requested: str | None,
    environ: Mapping[str, str] | None = None,
    smi: Callable[[], str | None] = nvidia_smi_list,
    driver: Callable[[], bool] = nvidia_device_files,
    note: Callable[[str], None] = _stderr,
) -> list[str]:
    """GPU ids to spread workers over (values for the children's CUDA_VISIBLE_DEVICES)."""
    if requested is not None:
        return parse_gpu_list(requested)
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        gpus = parse_gpu_list(env["CUDA_VISIBLE_DEVICES"])
        if gpus and not driver() and smi() is None:
            note(
                f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} is set but no NVIDIA GPU is "
                "present (no driver, no nvidia-smi), so the workers run on the CPU"
            )
            return []
        return gpus
    text = smi()
    return parse_nvidia_smi(text) if text else []
