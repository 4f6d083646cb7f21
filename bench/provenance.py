"""What a result was measured on: the commit (and uncommitted changes) and the machine."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path

from testbed.harness import REPO_ROOT


def git_output(*argv: str) -> str:
    """`git -C <repo> argv...`'s output, stripped ("?" when git cannot run): the results
    name the commit they measured."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *argv], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" when unknown)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def machine() -> str:
    """e.g. "2 vCPUs (Intel Xeon ...), Python 3.11.7"."""
    return f"{os.cpu_count()} vCPUs ({cpu_model()}), Python {platform.python_version()}"
