"""Benchmark `dagsync forget` against the merge floor, measured in the same run.

    .venv/bin/python benchmarks/forget.py                  # dag format, >= 1M rows
    .venv/bin/python benchmarks/forget.py --format llm     # llm 0.36 logs.db
    .venv/bin/python benchmarks/forget.py --quick          # small smoke run
    .venv/bin/python benchmarks/forget.py --json

The subject is the first database of the family benchmarks/merge.py
generates and caches (``ensure_family``: ``laptop-1.db``, or ``machine-1.db``
for llm). A user forgets a third of its conversations: every ``--every``-th
conversation (thread) by rowid, the set benchmarks/gc.py deletes by hand,
given to ``forget`` by id (``--id`` x N; the ids are read before the clock
starts).

Each round (``--repeat``, default 3), each in its own child process (peak RSS
is the operation's own ``VmHWM``):

1. **floor** - merge.py's floor: a copy of the family's first database,
   ``ATTACH`` the second and ``INSERT OR IGNORE ... SELECT *`` per table in one
   transaction. forget's time is given as a ratio to it (goal <= 1x). In the
   llm format also merge.py's **keeping floor** (integer-keyed rows whose id
   is taken get new ids instead of being dropped: the floor drops most of
   that format's rows), and the goal is taken against it, as a merge's is.
2. **forget** - a copy of the subject; ``dagsync.forget.forget(copy,
   Selector(ids=...))``: unlink the conversations, then collect what only they
   reached, in one command (goal: peak RSS <= 100 MB).

The ratio is taken within each round and the median reported; the forget's
report (rows and messages deleted, shared messages kept) is printed from the
last round, with the time in each of forget's steps. These are measurements,
not tests: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import sqlite3
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import merge as bench  # noqa: E402  (benchmarks/merge.py: family cache, floor child, RSS, copies)

ROOT = bench.ROOT
GOAL_RATIO = 1.0
GOAL_RSS_MB = 100
DEFAULT_EVERY = 3
log = bench.log

# forget's steps, timed by wrapping them in the child (nested steps are also
# inside their caller's time).
STEPS = {
    "select": "dagsync.forget:select",
    "listing": "dagsync.forget:_listing",
    "unlink": "dagsync.forget.unlink:Unlink.run",
    "collect": "dagsync.forget.collect:Collect.run",
    "sweep": "dagsync.gc.sweep:sweep",
    "sweep_shared": "dagsync.gc.sweep:sweep_shared",
    "report": "dagsync.forget:_report",
}


def time_steps(steps: dict[str, list]) -> None:
    import importlib

    for name, place in STEPS.items():
        module_name, _, attribute = place.partition(":")
        owner = importlib.import_module(module_name)
        *path, last = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, last)

        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            started = time.perf_counter()
            try:
                return __fn(*args, **kwargs)
            finally:
                entry = steps.setdefault(__name, [0.0, 0])
                entry[0] += time.perf_counter() - started
                entry[1] += 1

        setattr(owner, last, functools.wraps(fn)(wrapper))


def chosen_ids(subject: Path, fmt: str, every: int) -> list[str]:
    """Every ``every``-th conversation (thread) by rowid: what gc.py deletes by hand."""
    table = "threads" if fmt == "llm" else "conversations"
    conn = sqlite3.connect(f"file:{subject}?mode=ro", uri=True)
    try:
        return [i for (i,) in conn.execute(f"SELECT id FROM {table} WHERE rowid % ? = 0 ORDER BY rowid", (every,))]
    finally:
        conn.close()


def child_forget(target: str, ids_file: str) -> dict:
    import dagsync
    from dagsync.forget import Selector, forget

    ids = tuple(Path(ids_file).read_text().split())
    steps: dict[str, list] = {}
    time_steps(steps)
    real_sleep = time.sleep
    slept = [0.0]

    def counted_sleep(seconds: float) -> None:
        slept[0] += seconds
        real_sleep(seconds)

    time.sleep = counted_sleep
    started = time.perf_counter()
    report = forget(target, Selector(ids=ids))
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "sleep_seconds": round(slept[0], 3),
        "peak_rss_mb": bench.peak_rss_mb(),
        "dagsync_path": str(Path(dagsync.__file__).parent),
        "report": {
            "conversations": len(report.conversations),
            "messages": report.messages,
            "shared_messages": report.shared_messages,
            "deleted": report.deleted,
            "deleted_bytes": report.deleted_bytes,
            "pending": report.pending,
            "tombstones": report.tombstones,
        },
        "tables": {t.table: [t.deleted, t.bytes] for t in report.tables},
        "steps": {name: [round(sec, 3), n] for name, (sec, n) in steps.items()},
    }


def bench_run(args: argparse.Namespace, conversations: int) -> dict:
    fmt = args.format
    bench.FORMAT = fmt
    first, second, meta = bench.ensure_family(args.data, conversations, args.seed)
    work = args.data / "work"
    work.mkdir(parents=True, exist_ok=True)
    floor_db = work / f"forget-floor-{fmt}-n{conversations}.db"
    forget_db = work / f"forget-{fmt}-n{conversations}.db"
    ids_file = work / f"forget-{fmt}-n{conversations}-every{args.every}.ids"
    ids = chosen_ids(first, fmt, args.every)
    ids_file.write_text("\n".join(ids))
    for db in (first, second):
        bench.warm(db)
    rows = meta["databases"][first.name]["rows"]
    rounds = []
    try:
        for n in range(1, args.repeat + 1):
            kinds = ("floor", "keeping-floor") if fmt == "llm" else ("floor",)
            order = (*kinds, "forget") if n % 2 else ("forget", *kinds)
            measured: dict = {}
            for kind in order:
                if kind in ("floor", "keeping-floor"):
                    what = "INSERT OR IGNORE" if kind == "floor" else "INSERT, integer-keyed rows with new ids"
                    log(f"[round {n}/{args.repeat}] {kind}: a copy of {first.name}, ATTACH {second.name}, {what}")
                    bench.fresh_copy(first, floor_db)
                    floor = bench.run_child(kind, floor_db, second)
                    measured[f"{kind.replace('-', '_')}_seconds"] = round(floor["seconds"], 3)
                    log(f"  {floor['seconds']:.2f}s")
                else:
                    log(f"[round {n}/{args.repeat}] forget: {len(ids):,} of the conversations of a copy of {first.name}")
                    bench.fresh_copy(first, forget_db)
                    run = bench.run_script_child(__file__, ["forget", str(forget_db), str(ids_file)], "forget")
                    measured["forget"] = run
                    log(
                        f"  {run['seconds']:.2f}s, peak RSS {run['peak_rss_mb']} MB, "
                        f"deleted {run['report']['deleted']:,} rows"
                    )
            measured["ratio"] = round(measured["forget"]["seconds"] / measured["floor_seconds"], 3)
            if "keeping_floor_seconds" in measured:
                measured["keeping_ratio"] = round(measured["forget"]["seconds"] / measured["keeping_floor_seconds"], 3)
            rounds.append(measured)
    finally:
        for db in (floor_db, forget_db):
            for suffix in ("", "-journal", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
    return {
        "format": fmt,
        "conversations": conversations,
        "seed": args.seed,
        "every": args.every,
        "subject": str(first),
        "subject_rows": rows,
        "subject_bytes": first.stat().st_size,
        "forgotten": len(ids),
        "rounds": rounds,
        "ratio": round(statistics.median(r["ratio"] for r in rounds), 3),
        "keeping_ratio": round(statistics.median(r["keeping_ratio"] for r in rounds), 3) if fmt == "llm" else None,
        "peak_rss_mb": max(r["forget"]["peak_rss_mb"] for r in rounds),
        "dagsync": bench.dagsync_version(),
    }


def print_run(r: dict, out=sys.stdout) -> None:
    say = functools.partial(print, file=out)
    mark = bench.mark
    say(f"\n== forget, {r['format']} format, {r['conversations']:,} conversations (seed {r['seed']}), dagsync {r['dagsync']}")
    say(
        f"  subject: {Path(r['subject']).name}, {r['subject_rows']:,} rows, {r['subject_bytes'] / 2**20:,.0f} MiB; "
        f"forgetting 1 in {r['every']} conversations: {r['forgotten']:,}"
    )
    keeping = r["keeping_ratio"] is not None
    say(
        f"\n  {'round':<6} {'floor s':>9}" + (f" {'keeping s':>10}" if keeping else "")
        + f" {'forget s':>9} {'x floor':>8}" + (f" {'x keeping':>10}" if keeping else "")
        + f" {'peak RSS MB':>12} {'sleeping s':>11}"
    )
    for i, m in enumerate(r["rounds"], 1):
        f = m["forget"]
        say(
            f"  {i:<6} {m['floor_seconds']:>9.2f}" + (f" {m['keeping_floor_seconds']:>10.2f}" if keeping else "")
            + f" {f['seconds']:>9.2f} {m['ratio']:>8.2f}" + (f" {m['keeping_ratio']:>10.2f}" if keeping else "")
            + f" {f['peak_rss_mb']:>12.1f} {f['sleep_seconds']:>11.2f}"
        )
    # In the llm format the floor drops the integer-keyed rows whose ids are
    # taken (most of them); the keeping floor does the work (DESIGN.md).
    ratio = r["keeping_ratio"] if keeping else r["ratio"]
    against = "the keeping floor" if keeping else "the floor"
    say(
        f"  median {ratio:.2f}x {against} (goal <= {GOAL_RATIO}x: {mark(ratio <= GOAL_RATIO)})"
        + (f"; {r['ratio']:.2f}x the floor" if keeping else "")
        + f"; peak RSS {r['peak_rss_mb']} MB (goal <= {GOAL_RSS_MB}: {mark(r['peak_rss_mb'] <= GOAL_RSS_MB)})"
    )
    last = r["rounds"][-1]["forget"]
    rep = last["report"]
    say(
        f"\n  deleted {rep['deleted']:,} rows ({rep['deleted_bytes'] / 2**20:,.1f} MiB of values), "
        f"{rep['messages']:,} messages; {rep['shared_messages']:,} shared messages kept; pending after: {rep['pending']}"
    )
    for table, (rows, size) in last["tables"].items():
        say(f"    {table:<26} {rows:>10,} ({size / 2**20:,.1f} MiB)")
    say("  steps (s, calls; nested steps are inside their caller's time):")
    for name, (sec, n) in last["steps"].items():
        say(f"    {sec:>8.2f} x{n:<5} {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "bench-data", help="cache of generated databases")
    parser.add_argument("--format", choices=("dag", "llm"), default="dag")
    parser.add_argument(
        "--conversations", type=int, default=bench.DEFAULT_CONVERSATIONS,
        help=f"conversations per family (default {bench.DEFAULT_CONVERSATIONS}: >= 1M rows)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {bench.QUICK_CONVERSATIONS} conversations")
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY, help="forget every K-th conversation")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of floor and forget, alternating (default 3)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "TARGET", "IDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # internal: `--child forget TARGET IDS_FILE`
        json.dump(child_forget(args.child[1], args.child[2]), sys.stdout)
        return 0
    args.data.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.repeat = 1
    result = bench_run(args, bench.QUICK_CONVERSATIONS if args.quick else args.conversations)
    if args.json:
        json.dump({"python": sys.version.split()[0], "results": [result]}, sys.stdout, indent=2)
        print()
    print_run(result, sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
