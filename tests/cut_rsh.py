"""An ``--rsh`` that cuts the connection: ``python cut_rsh.py up|down LIMIT SSH ARGS...``.

Runs the ssh command, passing on at most LIMIT bytes in one direction (``up``:
what dagsync sends to the other machine, ``down``: what comes back), then
kills ssh and exits 255 as ssh does when a connection is lost.
"""

from __future__ import annotations

import subprocess
import sys
import threading


def main() -> int:
    direction, limit, command = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr)
    assert child.stdin is not None and child.stdout is not None
    cut = threading.Event()

    def pump(src, dst, budget: int | None) -> None:
        passed = 0
        try:
            while True:
                block = src.read1(65536) if hasattr(src, "read1") else src.read(65536)
                if not block:
                    break
                if budget is not None and passed + len(block) > budget:
                    dst.write(block[: budget - passed])
                    dst.flush()
                    cut.set()
                    child.kill()
                    return
                dst.write(block)
                dst.flush()
                passed += len(block)
        except (BrokenPipeError, ValueError, OSError):
            pass
        finally:
            if dst is child.stdin:
                try:
                    dst.close()
                except OSError:
                    pass

    up = threading.Thread(target=pump, args=(sys.stdin.buffer, child.stdin, limit if direction == "up" else None), daemon=True)
    down = threading.Thread(target=pump, args=(child.stdout, sys.stdout.buffer, limit if direction == "down" else None), daemon=True)
    up.start()
    down.start()
    status = child.wait()
    down.join(5)
    if cut.is_set():
        sys.stderr.write("Connection to 127.0.0.1 closed by remote host.\n")
        return 255
    return status


if __name__ == "__main__":
    sys.exit(main())
