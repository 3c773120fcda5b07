"""What a measurement was taken on: the hardware fingerprint and the software version.

A time per step means nothing without the machine it was measured on, so every stored
cell carries this fingerprint, and its hash is part of the cell's key: re-running a suite
on other hardware measures again instead of reusing this machine's numbers.

Reading it costs one ``torch.cuda`` probe and two small ``/proc`` reads; the git commit
costs one ``git rev-parse`` (at most a second, None when partrain is not a git checkout).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    cpu_model: str
    cpu_cores: int  # usable by this process (its affinity mask), not the host's total
    memory_gib: int  # rounded, so that the odd megabyte the kernel reserves does not change the hash
    gpu: str | None  # name of the first GPU
    gpu_count: int
    backend: str  # the collective backend partrain picks here by default
    torch_version: str
    gpu_memory_mib: int | None = None  # per GPU (the first's total_memory); None without one

    @property
    def hash(self) -> str:
        # without a GPU the hash is the one this machine always had (gpu_memory_mib is newer):
        # its cached profiles and stored cells stay its own
        fields = {k: v for k, v in asdict(self).items() if not (k == "gpu_memory_mib" and v is None)}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def gpu_memory_bytes(self) -> int:
        return (self.gpu_memory_mib or 0) * 2**20

    def describe(self) -> str:
        memory = f" ({self.gpu_memory_mib / 1024:.0f} GiB)" if self.gpu_memory_mib else ""
        gpus = f"{self.gpu_count} x {self.gpu}{memory}" if self.gpu_count else "no GPU"
        return f"{self.cpu_model}, {self.cpu_cores} cores, {self.memory_gib} GiB, {gpus}, {self.backend}, torch {self.torch_version}"


@cache
def fingerprint() -> Hardware:
    """This machine, as far as it decides how fast training runs."""
    import torch

    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Hardware(
        cpu_model=_cpu_model(),
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        memory_gib=round(_memory_bytes() / 2**30),
        gpu=torch.cuda.get_device_name(0) if gpu_count else None,
        gpu_count=gpu_count,
        backend="nccl" if gpu_count else "gloo",
        torch_version=torch.__version__,
        gpu_memory_mib=torch.cuda.get_device_properties(0).total_memory // 2**20 if gpu_count else None,
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # reported in KiB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@cache
def git_commit() -> str | None:
    """The commit of the partrain checkout that measured, or None when it is not a checkout.

    An installed partrain may sit inside some other repository (a virtual environment in a
    project): that repository's commit would be a lie, so the checkout must be partrain's own.
    """
    package = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package, capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() / "src" / "partrain" != package:
        return None
    return lines[1]
