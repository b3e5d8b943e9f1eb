"""Running a dagsync operation in a child process and killing it part-way (crash tests)."""

from __future__ import annotations

import subprocess
import sys
from typing import IO


def kill_after(script: str, args: list[str], lines: int, stderr: IO[str] | None = None) -> tuple[bool, int]:
    """Run ``python -c script args``, read ``lines`` lines of its output (one per
    progress event), then ``kill -9`` it, so the kill lands part-way through
    its work by construction. Returns (it was still running, its exit status).
    """
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    for _ in range(lines):
        if not process.stdout.readline():
            break
    alive = process.poll() is None
    process.kill()
    process.wait()
    process.stdout.close()
    return alive, process.returncode
