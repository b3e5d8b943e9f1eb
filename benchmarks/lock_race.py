"""lock_race: does dagsync's way of taking the write lock ever refuse an llm?

llm writes in deferred transactions (``BEGIN``, a read, then the first write
asks for RESERVED) with a 5 s busy timeout and no retry; in rollback-journal
mode SQLite refuses that upgrade at once while another connection holds
RESERVED. This runs such a writer against dagsync's ``write_transaction`` in
a loop of tiny transactions (as gc takes them), both on one file, beside
processes that keep the cores busy (a loaded machine is where the moment
of a try grows long enough to be met), and counts the writer's refusals.

    .venv/bin/python benchmarks/lock_race.py                      # 2 rounds of 120 s
    .venv/bin/python benchmarks/lock_race.py --baseline ../base   # this and ../base, alternating
    .venv/bin/python benchmarks/lock_race.py --seconds 30 --rounds 1 --load 0 --json

Not a test: a refusal is a matter of timing, so no count is asserted; the
mechanism is tested in ``tests/test_locks.py``. See docs/merge.md ("Crash
safety and a live writer").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import merge as bench  # noqa: E402  (benchmarks/merge.py: checkouts, versions)

LLM_WRITER = r"""
import json, random, sys, time, apsw
path, seconds = sys.argv[1], float(sys.argv[2])
conn = apsw.Connection(path)
conn.set_busy_timeout(5000)
done = refused = 0
waited = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    began = time.monotonic()
    try:
        conn.execute("BEGIN")
        conn.execute("SELECT count(*) FROM t").fetchall()
        conn.execute("INSERT INTO t (v) VALUES ('llm')")
        conn.execute("COMMIT")
        done += 1
    except apsw.BusyError:
        refused += 1
        waited.append(round(time.monotonic() - began, 4))
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    time.sleep(random.random() * 0.002)  # a gap, as between prompts
print(json.dumps({"llm_transactions": done, "refused": refused, "refused_after_seconds": waited}))
"""

DAGSYNC_WRITER = r"""
import json, sys, time, apsw
from dagsync import transactions
path, seconds = sys.argv[1], float(sys.argv[2])
conn = apsw.Connection(path)
transactions.patient(conn)
done = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    with transactions.write_transaction(conn):
        conn.execute("INSERT INTO t (v) VALUES ('dagsync')")
    done += 1
print(json.dumps({"dagsync_transactions": done}))
"""


def one_round(root: Path, seconds: float, load: int) -> dict:
    """One file, one llm-style writer, one dagsync writer (of the checkout at ``root``), ``load`` busy loops."""
    with tempfile.TemporaryDirectory(prefix="lock-race-") as tmp:
        path = Path(tmp) / "race.db"
        create = "import apsw, sys; apsw.Connection(sys.argv[1]).execute('CREATE TABLE t (id INTEGER PRIMARY KEY, v)')"
        subprocess.run([sys.executable, "-c", create, str(path)], check=True)
        env = {**os.environ, "PYTHONPATH": str(root)}
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
        try:
            writers = [
                subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                for code in (LLM_WRITER, DAGSYNC_WRITER)
            ]  # fmt: skip
            result: dict = {}
            for writer in writers:
                out, _ = writer.communicate(timeout=seconds + 120)
                result.update(json.loads(out))
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="length of one round (default 120)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per checkout (default 2)")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the writers (default 2)")
    parser.add_argument("--json", action="store_true", help="results as JSON on stdout")
    bench.add_baseline_arguments(parser, "the race", repeat=False)
    args = parser.parse_args()
    rounds: list[dict] = []
    for n in range(args.rounds):
        for which, root in bench.trees(args.baseline, n):
            result = one_round(root, args.seconds, args.load)
            result.update(which=which.strip() or "this", round=n + 1, dagsync=bench.dagsync_version(root))
            bench.log(
                f"round {n + 1} {which}{result['dagsync']}: {result['refused']} refused of "
                f"{result['llm_transactions'] + result['refused']} llm transactions, "
                f"{result['dagsync_transactions']} dagsync transactions"
                + (f"; refused after {result['refused_after_seconds']} s" if result["refused"] else "")
            )
            rounds.append(result)
            time.sleep(random.random())
    totals = {}
    for which in sorted({r["which"] for r in rounds}):
        mine = [r for r in rounds if r["which"] == which]
        totals[which] = {
            "dagsync": mine[0]["dagsync"],
            "refused": sum(r["refused"] for r in mine),
            "llm_transactions": sum(r["llm_transactions"] + r["refused"] for r in mine),
            "dagsync_transactions": sum(r["dagsync_transactions"] for r in mine),
        }
    report = {"seconds": args.seconds, "load": args.load, "rounds": rounds, "totals": totals}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for which, t in totals.items():
            print(f"{which} ({t['dagsync']}): {t['refused']} refused of {t['llm_transactions']} llm transactions, "
                  f"beside {t['dagsync_transactions']} dagsync transactions")  # fmt: skip


if __name__ == "__main__":
    main()
