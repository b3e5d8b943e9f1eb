"""Benchmark `dagsync gc` against the merge floor, measured in the same run.

    .venv/bin/python benchmarks/gc.py                  # dag format, >= 1M rows, >= 20% unreachable
    .venv/bin/python benchmarks/gc.py --format llm     # llm 0.36 logs.db
    .venv/bin/python benchmarks/gc.py --quick          # small smoke run
    .venv/bin/python benchmarks/gc.py --json

The subject is one database of the family benchmarks/merge.py generates and
caches (``ensure_family``: ``laptop-1.db``, or ``machine-1.db`` for llm), in
which a user has deleted every ``--every``-th conversation (thread) by hand,
with SQL, the way one would: its conversation (thread) row, its calls
(turns), and the rows pointing at those (the legacy responses and their link
rows; turn_search, turn_fragments, turn_tools, tool_instantiations, and
``forked_from`` nulled). That leaves their messages unreachable, and
fragments, attachments and tools only they used unreferenced. The subject is
then VACUUMed, so that the bytes reclaimed below are gc's alone, and cached
under ``--data`` (``gc-<format>-seed<S>-n<N>-every<K>/subject.db``).

Then, each in its own child process (peak RSS is the operation's own ``VmHWM``):

1. **floor** - merge.py's floor: a copy of the family's first database,
   ``ATTACH`` the second and ``INSERT OR IGNORE ... SELECT *`` per table in one
   transaction. gc's time is given as a ratio to it (goal <= 1x).
2. **gc** - a copy of the subject; ``dagsync.gc.gc(copy, grace="0s")``.
   For llm, whose messages carry no time, the first run only records when it
   first saw the unreachable messages, so gc runs twice (``gc-1``, ``gc-2``):
   both are timed, and the ratio is given for the deleting run and the total.
3. **vacuum** - ``gc(copy, grace="0s", vacuum=True)`` on the collected copy:
   one more gc (in the dag format it deletes the fragments and attachments
   the first run found unreferenced - their references went by hand - and
   started the grace clock for), then the first ``--vacuum``, which on a file
   not in incremental auto-vacuum mode is one full ``VACUUM`` (it switches
   the file to incremental mode). File size before and after = bytes reclaimed.
4. **incremental** (unless ``--no-incremental``) - a copy of the subject
   first switched to incremental auto-vacuum (not timed), then
   ``gc(copy, grace="0s", vacuum=True)`` (twice for llm): collect and give
   the space back in short steps, as every ``--vacuum`` after the first does.

gc runs at the real time, except that its clock (the ``now`` argument) is
moved past the subject's newest message when the generator has dated some
messages in the future (the dag family of 55,000 conversations reaches into
2027): otherwise those would be kept as new whatever the grace period.
``--real-clock`` turns that off.

Printed per run: gc's steps (methods of ``dagsync.gc._Gc``, wrapped in the
child, exact), the time gc spent in its polite pauses after commits
(``time.sleep``), and with ``--phases`` the phases of gc's progress callback
(approximate: gc reports progress after each chunk). ``--statements`` also
times every SQL statement (see merge.py). These are measurements, not tests:
nothing asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sqlite3
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import merge as bench  # noqa: E402  (benchmarks/merge.py: family cache, floor child, RSS, copies)

ROOT = bench.ROOT
GOAL_RATIO = 1.0
GOAL_RSS_MB = 200
GOAL_UNREACHABLE = 0.20
# Every 3rd conversation deleted by hand leaves >= 20% of the messages unreachable
# in both formats (the run prints the fraction; raise or lower --every to change it).
DEFAULT_EVERY = 3
log = bench.log


# -- the subject: a family database with conversations deleted by hand -------------------


def delete_by_hand_dag(conn: sqlite3.Connection, every: int) -> dict[str, int]:
    """Every ``every``-th conversation, deleted as a user would in the sqlite3 shell."""
    conn.executescript(
        f"""
        CREATE TEMP TABLE gone_conv AS SELECT id FROM conversations WHERE rowid % {every} = 0;
        CREATE TEMP TABLE gone_resp AS
            SELECT id FROM calls WHERE conversation_id IN (SELECT id FROM gone_conv)
            UNION SELECT id FROM responses WHERE conversation_id IN (SELECT id FROM gone_conv);
        """
    )
    statements = [
        ("tool_results_attachments", "tool_result_id IN (SELECT id FROM tool_results WHERE response_id IN (SELECT id FROM temp.gone_resp))"),
        *(
            (table, "response_id IN (SELECT id FROM temp.gone_resp)")
            for table in (
                "tool_results", "tool_calls", "tool_responses", "prompt_fragments", "system_fragments",
                "prompt_attachments", "parts",
            )
        ),
        ("responses", "id IN (SELECT id FROM temp.gone_resp)"),
        ("calls", "conversation_id IN (SELECT id FROM temp.gone_conv)"),
        ("conversations", "id IN (SELECT id FROM temp.gone_conv)"),
    ]  # fmt: skip
    return _delete(conn, statements)


def delete_by_hand_llm(conn: sqlite3.Connection, every: int) -> dict[str, int]:
    """Every ``every``-th thread, deleted as a user would (as tests/test_real_llm_gc.py does)."""
    conn.executescript(
        f"""
        CREATE TEMP TABLE gone_thread AS SELECT id FROM threads WHERE rowid % {every} = 0;
        CREATE TEMP TABLE gone_turn AS SELECT id FROM turns WHERE thread_id IN (SELECT id FROM gone_thread);
        """
    )
    turns = "turn_id IN (SELECT id FROM temp.gone_turn)"
    statements = [
        *((t, turns) for t in ("turn_search", "turn_fragments", "turn_tools", "tool_instantiations")),
        ("turns", "id IN (SELECT id FROM temp.gone_turn)"),
    ]
    counts = _delete(conn, statements)
    with conn:
        conn.execute("UPDATE threads SET forked_from = NULL WHERE forked_from IN (SELECT id FROM temp.gone_thread)")
        counts["threads.forked_from nulled"] = conn.execute("SELECT changes()").fetchone()[0]
    counts.update(_delete(conn, [("threads", "id IN (SELECT id FROM temp.gone_thread)")]))
    return counts


def _delete(conn: sqlite3.Connection, statements: list[tuple[str, str]]) -> dict[str, int]:
    present = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    counts = {}
    with conn:
        for table, where in statements:
            if table in present:
                counts[table] = conn.execute(f'DELETE FROM "{table}" WHERE {where}').rowcount
    return counts


def ensure_subject(data: Path, fmt: str, conversations: int, seed: int, every: int) -> tuple[Path, Path, Path, dict]:
    """(subject, family db 1, family db 2, meta): the subject made once, then reused."""
    bench.FORMAT = fmt
    first, second, family_meta = bench.ensure_family(data, conversations, seed)
    out = data / f"gc-{fmt}-seed{seed}-n{conversations}-every{every}"
    subject = out / "subject.db"
    meta_path = out / "meta.json"
    if meta_path.exists():
        log(f"reusing {subject}")
        return subject, first, second, json.loads(meta_path.read_text())
    building = data / f".building-{out.name}"
    building.mkdir(parents=True, exist_ok=True)
    log(f"making the gc subject: {first.name}, 1 in {every} conversations deleted by hand, then VACUUM ...")
    started = time.perf_counter()
    bench.fresh_copy(first, building / "subject.db")
    conn = sqlite3.connect(building / "subject.db", isolation_level=None)
    try:
        # Foreign keys are checked once afterwards, not per deleted row: most of
        # the referencing columns have no index, so per-row checks would scan.
        conn.execute("PRAGMA cache_size = -262144")
        counts = (delete_by_hand_llm if fmt == "llm" else delete_by_hand_dag)(conn, every)
        broken = conn.execute("PRAGMA foreign_key_check").fetchall()
        assert not broken, f"the deleting SQL left dangling references: {broken[:5]}"
        conn.execute("VACUUM")  # start compact: what --vacuum reclaims is then gc's alone
    finally:
        conn.close()
    rows = bench.table_rows(building / "subject.db")
    meta = {
        "format": fmt,
        "family": str(first),
        "every": every,
        "deleted_by_hand": counts,
        "rows": sum(rows.values()),
        "tables": rows,
        "bytes": (building / "subject.db").stat().st_size,
        "family_databases": family_meta["databases"],
        "prepare_seconds": round(time.perf_counter() - started, 1),
    }
    (building / "meta.json").write_text(json.dumps(meta, indent=2))
    out.mkdir(parents=True, exist_ok=True)
    (building / "subject.db").rename(subject)
    (building / "meta.json").rename(meta_path)
    building.rmdir()
    log(f"  made in {meta['prepare_seconds']:.0f}s: {meta['rows']:,} rows, {meta['bytes'] / 2**20:,.0f} MiB")
    return subject, first, second, meta


# -- children: one measurement each ---------------------------------------------------------


# gc's steps, timed by wrapping them in the child: exact where the progress
# phases are not (gc reports progress after each chunk, so a phase's first
# chunk is counted in the row before it). Nested steps (protect and delete
# inside sweep, say) are also inside their caller's time. Each step is found
# where this checkout keeps it: a function of dagsync.gc.mark or
# dagsync.gc.sweep, a method of dagsync.gc.run.GcRun, or (in checkouts from
# before gc was a package) a method of dagsync.gc._Gc.
STEPS = {
    "mark_messages": ("dagsync.gc.mark:_messages", "dagsync.gc:_Gc.mark_messages"),
    "mark_candidates": ("dagsync.gc.mark:_candidates", "dagsync.gc:_Gc.mark_candidates"),
    "mark_shared": ("dagsync.gc.mark:_shared", "dagsync.gc:_Gc.mark_shared"),
    "dying": ("dagsync.gc.mark:dying", "dagsync.gc:_Gc.dying"),
    "sweep": ("dagsync.gc.sweep:sweep", "dagsync.gc:_Gc.sweep"),
    "mark_dying_as_old": ("dagsync.gc.sweep:_mark_dying_as_old", "dagsync.gc:_Gc.mark_dying_as_old"),
    "protect": ("dagsync.gc.sweep:_protect", "dagsync.gc:_Gc.protect"),
    "delete_owned": ("dagsync.gc.sweep:_delete_owned", "dagsync.gc:_Gc.delete_owned"),
    "delete": ("dagsync.gc.run:GcRun.delete", "dagsync.gc:_Gc.delete"),
    "sweep_shared": ("dagsync.gc.sweep:sweep_shared", "dagsync.gc:_Gc.sweep_shared"),
    "record": ("dagsync.gc.sweep:record", "dagsync.gc:_Gc.record"),
    "tables": ("dagsync.gc.run:GcRun.tables", "dagsync.gc:_Gc.tables"),
    "drop_temp": ("dagsync.gc.run:GcRun.drop_temp", "dagsync.gc:_Gc.drop_temp"),
    # The vacuum after the collection, whatever gc calls it.
    "vacuum": ("dagsync.gc:vacuum_file", "dagsync.gc:_vacuum"),
    "open_target": ("dagsync.gc:open_target",),
}


def time_steps(steps: dict[str, list]) -> None:
    """Wrap gc's steps so each call adds to ``steps`` ({name: [seconds, calls]})."""
    import importlib

    def timed(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = steps.setdefault(name, [0.0, 0])
                entry[0] += time.perf_counter() - started
                entry[1] += 1

        return wrapper

    for name, places in STEPS.items():
        for place in places:
            module_name, _, attribute = place.partition(":")
            try:
                owner = importlib.import_module(module_name)
            except ImportError:
                continue
            *path, last = attribute.split(".")
            for part in path:
                owner = getattr(owner, part, None)
            if callable(getattr(owner, last, None)):
                setattr(owner, last, timed(name, getattr(owner, last)))
                break


def child_gc(target: str, vacuum: bool, statements: bool, now: float | None) -> dict:
    import dagsync
    from dagsync.gc import gc

    steps: dict[str, list] = {}
    time_steps(steps)

    # [phase, start, SQL ns, sleep s]: until the first progress call, opening the file.
    phases: list[list] = [["opening", 0.0, 0, 0.0]]
    sql_time: dict[str, list] = {}
    if statements:
        bench.watch_statements(sql_time, phases)  # also counts time.sleep per phase
    else:
        real_sleep, main_thread = time.sleep, threading.main_thread()

        def counted_sleep(seconds: float) -> None:
            if threading.current_thread() is main_thread:
                phases[-1][3] += seconds
            real_sleep(seconds)

        time.sleep = counted_sleep
    started = time.perf_counter()

    def progress(phase: str, done: int, total: int) -> None:
        if phases[-1][0] != phase:
            phases.append([phase, time.perf_counter() - started, 0, 0.0])
            log(f"    [{phases[-1][1]:8.2f}s] {phase}")

    report = gc(target, grace="0s", vacuum=vacuum, now=now, progress=progress)
    seconds = time.perf_counter() - started
    durations = []
    for i, (phase, at, sql_ns, slept) in enumerate(phases):
        end = phases[i + 1][1] if i + 1 < len(phases) else seconds
        durations.append([phase, round(end - at, 4), round(sql_ns / 1e9, 4), round(slept, 4)])
    vacuum_seconds = steps.get("vacuum", [0.0])[0]
    out = {
        "seconds": seconds,
        "vacuum_seconds": round(vacuum_seconds, 3),
        "gc_seconds": round(seconds - vacuum_seconds, 3),  # without the vacuum
        "sleep_seconds": round(sum(p[3] for p in phases), 3),
        "peak_rss_mb": bench.peak_rss_mb(),
        "dagsync_path": str(Path(dagsync.__file__).parent),
        "report": {
            k: getattr(report, k)
            for k in (
                "format", "roots", "reachable", "unreachable", "kept_by_grace", "kept_as_new",
                "deleted", "deleted_bytes", "file_bytes", "seconds",
            )
        },  # fmt: skip
        "tables": {t.table: {"deleted": t.deleted, "bytes": t.bytes, "waiting": t.waiting} for t in report.tables},
        "vacuum": None
        if report.vacuum is None
        else {
            "mode": report.vacuum.mode,
            "bytes_before": report.vacuum.bytes_before,
            "bytes_after": report.vacuum.bytes_after,
        },
        "phases": durations,
        "steps": {name: [round(sec, 4), n] for name, (sec, n) in steps.items()},
    }
    if statements:
        top = sorted(sql_time.items(), key=lambda kv: -kv[1][0])
        out["sql_seconds"] = round(sum(v[0] for v in sql_time.values()) / 1e9, 3)
        out["statements"] = [
            {"seconds": round(ns / 1e9, 3), "count": n, "sql": sql[:300]} for sql, (ns, n) in top[:25]
        ]
    return out


def run_gc_child(
    target: Path, now: float | None, vacuum: bool = False, statements: bool = False, root: Path = ROOT
) -> dict:
    args = ["gc", str(target)]
    if now is not None:
        args += ["--now", repr(now)]
    if vacuum:
        args.append("--vacuum")
    if statements:
        args.append("--statements")
    return bench.run_script_child(__file__, args, "gc", root)


# -- one run ------------------------------------------------------------------------------


def make_incremental(path: Path) -> float:
    """Switch a file to incremental auto-vacuum (one VACUUM); return how long it took."""
    started = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.execute("VACUUM")
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    finally:
        conn.close()
    os.sync()
    return time.perf_counter() - started


def gc_clock_offset(subject: Path) -> float:
    """Seconds to run gc's clock ahead so that no message of the subject is in the future.

    The dag family's generator dates messages forward from a fixed start, so
    the bigger families reach past today (55,000 conversations: into 2027); gc
    would keep those as new whatever the grace period. gc is run at
    ``now + offset`` (its ``now`` argument) instead, so that grace 0s makes every
    unreachable message old. 0 for the llm format (no message times) and when
    every message is already in the past.
    """
    import apsw

    conn = apsw.Connection(str(subject), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(messages)")}
        if "created_at" not in columns:
            return 0.0
        ((newest,),) = conn.execute("SELECT max(unixepoch(created_at, 'subsec')) FROM messages").fetchall()
    finally:
        conn.close()
    return max(0.0, (newest or 0) + 60 - time.time())


def unlink_db(path: Path) -> None:
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def bench_run(args: argparse.Namespace, conversations: int) -> dict:
    fmt = args.format
    subject, first, second, meta = ensure_subject(args.data, fmt, conversations, args.seed, args.every)
    work = args.data / "work"
    work.mkdir(parents=True, exist_ok=True)
    floor_db = work / f"gc-floor-{fmt}-n{conversations}.db"
    gc_db = work / f"gc-{fmt}-n{conversations}.db"
    inc_db = work / f"gc-incremental-{fmt}-n{conversations}.db"
    for db in (first, second, subject):
        bench.warm(db)
    version = bench.dagsync_version()
    offset = 0.0 if args.real_clock else gc_clock_offset(subject)

    def now() -> float | None:
        return None if not offset else time.time() + offset

    result: dict = {
        "format": fmt,
        "conversations": conversations,
        "seed": args.seed,
        "every": args.every,
        "subject": {k: v for k, v in meta.items() if k not in ("tables", "family_databases")},
        "subject_tables": meta["tables"],
        "clock_offset_seconds": round(offset, 1),
    }
    try:
        log(f"floor: a copy of {first.name}, ATTACH {second.name}, INSERT OR IGNORE ... SELECT * per table")
        bench.fresh_copy(first, floor_db)
        floor = bench.run_child("floor", floor_db, second)
        unlink_db(floor_db)
        log(f"  {floor['seconds']:.2f}s")
        result["floor_seconds"] = round(floor["seconds"], 3)
        result["floor_peak_rss_mb"] = floor["peak_rss_mb"]

        log(f"gc: a copy of the subject ({meta['rows']:,} rows), gc(copy, grace='0s')")
        bench.fresh_copy(subject, gc_db)
        runs = [run_gc_child(gc_db, now(), statements=args.statements)]
        log(f"  {runs[0]['seconds']:.2f}s, peak RSS {runs[0]['peak_rss_mb']} MB, deleted {runs[0]['report']['deleted']:,} rows")
        if fmt == "llm":
            log("gc again: llm's messages carry no time, so the first run only recorded them")
            os.sync()
            runs.append(run_gc_child(gc_db, now(), statements=args.statements))
            log(f"  {runs[1]['seconds']:.2f}s, peak RSS {runs[1]['peak_rss_mb']} MB, deleted {runs[1]['report']['deleted']:,} rows")
        result["gc_runs"] = runs
        deleting = max(runs, key=lambda r: r["report"]["deleted"])
        total = sum(r["seconds"] for r in runs)
        report = deleting["report"]
        result.update(
            gc_seconds=round(deleting["seconds"], 3),
            gc_ratio=round(deleting["seconds"] / floor["seconds"], 2),
            gc_total_seconds=round(total, 3),
            gc_total_ratio=round(total / floor["seconds"], 2),
            gc_peak_rss_mb=max(r["peak_rss_mb"] for r in runs),
            unreachable=report["unreachable"],
            kept_by_grace=report["kept_by_grace"],
            unreachable_fraction=round(report["unreachable"] / max(1, report["unreachable"] + report["reachable"]), 4),
        )
        result["rows_after_gc"] = sum(bench.table_rows(gc_db).values())

        log("vacuum: gc(copy, grace='0s', vacuum=True) on the collected copy (the first --vacuum: one full VACUUM)")
        os.sync()
        vac = run_gc_child(gc_db, now(), vacuum=True)
        log(f"  {vac['seconds']:.2f}s (vacuum {vac['vacuum_seconds']:.2f}s), peak RSS {vac['peak_rss_mb']} MB")
        result["vacuum_run"] = vac
        result.update(
            vacuum_mode=vac["vacuum"]["mode"],
            vacuum_seconds=vac["vacuum_seconds"],
            vacuum_peak_rss_mb=vac["peak_rss_mb"],
            bytes_before_vacuum=vac["vacuum"]["bytes_before"],
            bytes_after_vacuum=vac["vacuum"]["bytes_after"],
            bytes_reclaimed=vac["vacuum"]["bytes_before"] - vac["vacuum"]["bytes_after"],
            subject_bytes=subject.stat().st_size,
        )
        # The vacuum run is one more gc: it deletes the shared rows the first saw unreferenced.
        every_run = [*runs, vac]
        result.update(
            deleted_rows=sum(r["report"]["deleted"] for r in every_run),
            deleted_bytes=sum(r["report"]["deleted_bytes"] for r in every_run),
            deleted_messages=sum(r["tables"].get("messages", {}).get("deleted", 0) for r in every_run),
            deleted_tables={
                name: {
                    "deleted": sum(r["tables"].get(name, {}).get("deleted", 0) for r in every_run),
                    "bytes": sum(r["tables"].get(name, {}).get("bytes", 0) for r in every_run),
                    "waiting_after": vac["tables"].get(name, {}).get("waiting", 0),
                }
                for name in dict.fromkeys(n for r in every_run for n in r["tables"])
            },
        )
        unlink_db(gc_db)

        if args.incremental:
            log("incremental: a copy of the subject switched to incremental auto-vacuum (not timed), then gc --vacuum")
            bench.fresh_copy(subject, inc_db)
            switch = make_incremental(inc_db)
            log(f"  switched in {switch:.1f}s")
            inc_runs = [run_gc_child(inc_db, now(), vacuum=True)]
            if fmt == "llm":
                os.sync()
                inc_runs.append(run_gc_child(inc_db, now(), vacuum=True))
            last = inc_runs[-1]
            log(
                f"  {sum(r['seconds'] for r in inc_runs):.2f}s in all (vacuum {last['vacuum_seconds']:.2f}s), "
                f"peak RSS {max(r['peak_rss_mb'] for r in inc_runs)} MB"
            )
            result["incremental_runs"] = inc_runs
            result.update(
                incremental_switch_seconds=round(switch, 3),
                incremental_gc_seconds=last["gc_seconds"],
                incremental_vacuum_seconds=last["vacuum_seconds"],
                incremental_peak_rss_mb=max(r["peak_rss_mb"] for r in inc_runs),
                incremental_bytes_before=last["vacuum"]["bytes_before"],
                incremental_bytes_after=last["vacuum"]["bytes_after"],
                incremental_mode=last["vacuum"]["mode"],
            )
    finally:
        if not args.keep:
            for db in (floor_db, gc_db, inc_db):
                unlink_db(db)
    result["dagsync"] = version if bench.dagsync_version() == version else f"{version} -> {bench.dagsync_version()}"
    return result


def compare(args: argparse.Namespace, conversations: int) -> dict:
    """``--baseline``: rounds of the floor and of gc on a fresh copy of the subject
    with this checkout's dagsync and with the baseline's, in alternating order;
    each ratio is taken within its round, the medians reported."""
    fmt = args.format
    subject, first, second, _ = ensure_subject(args.data, fmt, conversations, args.seed, args.every)
    work = args.data / "work"
    floor_db, gc_db = work / f"gc-floor-{fmt}-n{conversations}.db", work / f"gc-compare-{fmt}-n{conversations}.db"
    offset = 0.0 if args.real_clock else gc_clock_offset(subject)
    now = None if not offset else time.time() + offset
    rounds = []
    try:
        for n in range(1, args.repeat + 1):
            log(f"[comparison round {n}/{args.repeat}] floor")
            bench.fresh_copy(first, floor_db)
            floor = bench.run_child("floor", floor_db, second)["seconds"]
            unlink_db(floor_db)
            measured = {"floor_seconds": round(floor, 3)}
            for which, root in bench.trees(args.baseline, n):
                which = which.strip() or "this"
                bench.fresh_copy(subject, gc_db)
                runs = [run_gc_child(gc_db, now, root=root)]
                if fmt == "llm":  # the first run only records; the second deletes
                    os.sync()
                    runs.append(run_gc_child(gc_db, now, root=root))
                unlink_db(gc_db)
                deleting = max(runs, key=lambda r: r["report"]["deleted"])
                measured[which] = {
                    "gc_seconds": round(deleting["seconds"], 3),
                    "total_seconds": round(sum(r["seconds"] for r in runs), 3),
                    "deleted": sum(r["report"]["deleted"] for r in runs),
                    "dagsync_path": runs[0]["dagsync_path"],
                }
                log(f"  {which}: gc {deleting['seconds']:.2f}s = {deleting['seconds'] / floor:.2f}x the floor ({floor:.2f}s)")
            rounds.append(measured)
    finally:
        unlink_db(floor_db)
        unlink_db(gc_db)

    def median(key: str, which: str) -> float:
        return round(statistics.median(r[which][key] / r["floor_seconds"] for r in rounds), 2)

    return {
        "rounds": rounds,
        "baseline_dagsync": bench.dagsync_version(args.baseline),
        **{f"{which}_{key}_ratio": median(f"{key}_seconds", which) for which in ("this", "baseline") for key in ("gc", "total")},
    }


def print_comparison(c: dict, fmt: str, out=sys.stdout) -> None:
    say = functools.partial(print, file=out)
    say(f"\n== gc against the baseline {c['baseline_dagsync']}, {len(c['rounds'])} rounds, alternating (x floor, medians)")
    say(f"  this:     gc {c['this_gc_ratio']:.2f}x" + (f", both runs {c['this_total_ratio']:.2f}x" if fmt == "llm" else ""))
    say(f"  baseline: gc {c['baseline_gc_ratio']:.2f}x" + (f", both runs {c['baseline_total_ratio']:.2f}x" if fmt == "llm" else ""))
    for i, r in enumerate(c["rounds"], 1):
        say(
            f"    round {i}: floor {r['floor_seconds']:.2f}s, this {r['this']['gc_seconds']:.2f}s, "
            f"baseline {r['baseline']['gc_seconds']:.2f}s; deleted {r['this']['deleted']:,} / {r['baseline']['deleted']:,}"
        )


# -- output ---------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def print_run(r: dict, out=sys.stdout, show_phases: bool = False) -> None:
    say = functools.partial(print, file=out)
    mark = bench.mark
    s = r["subject"]
    say(f"\n== gc, {r['format']} format, {r['conversations']:,} conversations (seed {r['seed']}), dagsync {r['dagsync']}")
    say(
        f"  subject: {Path(s['family']).name} with 1 in {r['every']} conversations deleted by hand, "
        f"{s['rows']:,} rows, {mib(s['bytes'])}"
    )
    say("    deleted by hand: " + ", ".join(f"{t} {n:,}" for t, n in s["deleted_by_hand"].items() if n))
    frac = r["unreachable_fraction"]
    say(
        f"  unreachable messages: {r['unreachable']:,} of {r['unreachable'] + r['gc_runs'][-1]['report']['reachable']:,} "
        f"= {frac:.1%} (goal >= {GOAL_UNREACHABLE:.0%}: {mark(frac >= GOAL_UNREACHABLE)}); "
        f"kept by the grace period in the deleting run: {r['kept_by_grace']:,}"
    )
    if r["clock_offset_seconds"]:
        say(
            f"  gc ran with its clock {r['clock_offset_seconds'] / 86400:,.1f} days ahead, past the subject's "
            "newest message (the generator dates messages into the future; --real-clock to not)"
        )
    say()
    say(f"  {'':<22} {'seconds':>9} {'x floor':>8} {'goal':>6} {'peak RSS MB':>12} {'sleeping s':>11}")
    say(f"  {'floor':<22} {r['floor_seconds']:>9.2f} {1.0:>8.2f} {'':>6} {r['floor_peak_rss_mb']:>12.1f}")
    for i, run in enumerate(r["gc_runs"]):
        label = "gc" if len(r["gc_runs"]) == 1 else f"gc run {i + 1}"
        ratio = run["seconds"] / r["floor_seconds"]
        say(
            f"  {label:<22} {run['seconds']:>9.2f} {ratio:>8.2f} {'<=' + str(GOAL_RATIO):>6} "
            f"{run['peak_rss_mb']:>12.1f} {run['sleep_seconds']:>11.2f}   deleted {run['report']['deleted']:,} rows; "
            f"time {mark(ratio <= GOAL_RATIO)}, memory {mark(run['peak_rss_mb'] <= GOAL_RSS_MB)}"
        )
    if len(r["gc_runs"]) > 1:
        say(f"  {'gc, both runs':<22} {r['gc_total_seconds']:>9.2f} {r['gc_total_ratio']:>8.2f}")
    vac = r["vacuum_run"]
    say(
        f"  {'gc --vacuum (' + r['vacuum_mode'] + ')':<22} {vac['seconds']:>9.2f} {vac['seconds'] / r['floor_seconds']:>8.2f} "
        f"{'':>6} {vac['peak_rss_mb']:>12.1f} {vac['sleep_seconds']:>11.2f}   of which vacuum {r['vacuum_seconds']:.2f}s"
    )
    if "incremental_runs" in r:
        total = sum(x["seconds"] for x in r["incremental_runs"])
        say(
            f"  {'incremental gc --vacuum':<22} {total:>9.2f} {total / r['floor_seconds']:>8.2f} {'':>6} "
            f"{r['incremental_peak_rss_mb']:>12.1f} {sum(x['sleep_seconds'] for x in r['incremental_runs']):>11.2f}"
            f"   of which vacuum {r['incremental_vacuum_seconds']:.2f}s ({r['incremental_mode']}; "
            f"switching the file first took {r['incremental_switch_seconds']:.1f}s, not timed)"
        )
    say()
    say(
        f"  deleted, all runs: {r['deleted_rows']:,} rows ({r['deleted_messages']:,} messages), "
        f"{mib(r['deleted_bytes'])} of values; rows after gc {r['rows_after_gc']:,}"
    )
    for name, t in r["deleted_tables"].items():
        if t["deleted"] or t["waiting_after"]:
            say(f"    {name:<20} {t['deleted']:>10,} deleted ({mib(t['bytes'])}), {t['waiting_after']:,} still waiting")
    say("    (grace 0s: the rows the first run saw unreferenced, or unreachable without a time, go in the next)")
    say(
        f"  file: {mib(r['bytes_before_vacuum'])} before --vacuum, {mib(r['bytes_after_vacuum'])} after: "
        f"{mib(r['bytes_reclaimed'])} reclaimed ({r['bytes_reclaimed'] / r['bytes_before_vacuum']:.1%})"
    )
    if "incremental_runs" in r:
        say(
            f"  incremental file: {mib(r['incremental_bytes_before'])} before, "
            f"{mib(r['incremental_bytes_after'])} after"
        )
    runs = [(f"gc run {i + 1}" if len(r["gc_runs"]) > 1 else "gc", x) for i, x in enumerate(r["gc_runs"])]
    runs.append(("gc --vacuum", vac))
    if "incremental_runs" in r:
        runs += [(f"incremental run {i + 1}", x) for i, x in enumerate(r["incremental_runs"])]
    for label, run in runs:
        detail = "statements" in run
        say(f"\n  {label}: {run['seconds']:.2f}s, of which sleeping after commits {run['sleep_seconds']:.2f}s; steps (s, calls):")
        steps = run["steps"]
        for name in ("open_target", *STEPS, "vacuum"):
            if name in steps:
                say(f"    {steps[name][0]:>8.2f} x{steps[name][1]:<6} {name}")
        if show_phases:
            say(f"  {label} progress phases (seconds; {'SQL, ' if detail else ''}sleeping):")
            for phase, seconds, sql, slept in run["phases"]:
                say(f"    {seconds:>8.2f}" + (f" {sql:>8.2f}" if detail else "") + f" {slept:>6.2f}  {phase}")
        if detail:
            say(f"  {label}: SQL {run['sql_seconds']:.2f}s of {run['seconds']:.2f}s; slowest statements:")
            for st in run["statements"][:10]:
                say(f"    {st['seconds']:>8.2f}s x{st['count']:<5} {st['sql'][:200]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "bench-data", help="cache of generated databases")
    parser.add_argument("--format", choices=("dag", "llm"), default="dag")
    parser.add_argument(
        "--conversations", type=int, default=bench.DEFAULT_CONVERSATIONS,
        help=f"conversations per family (default {bench.DEFAULT_CONVERSATIONS}: >= 1M rows)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {bench.QUICK_CONVERSATIONS} conversations")
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY, help="delete every K-th conversation by hand")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument("--keep", action="store_true", help="keep the copies in DATA/work")
    parser.add_argument("--statements", action="store_true", help="time every SQL statement of the gc run(s)")
    parser.add_argument(
        "--no-incremental", dest="incremental", action="store_false",
        help="skip the run on a file already in incremental auto-vacuum mode",
    )  # fmt: skip
    parser.add_argument("--phases", action="store_true", help="also print gc's progress phases with their times")
    bench.add_baseline_arguments(parser, "instead of the full run: rounds of floor and gc")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "TARGET"), help=argparse.SUPPRESS)
    parser.add_argument("--vacuum", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--now", type=float, help=argparse.SUPPRESS)
    parser.add_argument(
        "--real-clock", action="store_true",
        help="run gc at the real time; by default, past the newest message of the subject (see gc_clock_offset)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    if args.child:  # internal: `--child gc TARGET [--vacuum] [--statements]`
        json.dump(child_gc(args.child[1], args.vacuum, args.statements, args.now), sys.stdout)
        return 0
    args.data.mkdir(parents=True, exist_ok=True)
    conversations = bench.QUICK_CONVERSATIONS if args.quick else args.conversations
    if args.baseline:
        args.baseline = args.baseline.resolve()
        comparison = compare(args, conversations)
        if args.json:
            json.dump({"python": sys.version.split()[0], "comparison": comparison}, sys.stdout, indent=2)
            print()
        print_comparison(comparison, args.format, sys.stderr if args.json else sys.stdout)
        return 0
    result = bench_run(args, conversations)
    if args.json:
        json.dump({"python": sys.version.split()[0], "results": [result]}, sys.stdout, indent=2)
        print()
    print_run(result, sys.stderr if args.json else sys.stdout, args.phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
