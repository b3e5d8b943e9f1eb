"""Benchmark `dagsync merge` against the raw-SQLite floor, measured in the same run.

    .venv/bin/python benchmarks/merge.py              # >= 1M rows per database
    .venv/bin/python benchmarks/merge.py --quick      # small smoke run
    .venv/bin/python benchmarks/merge.py --scales 2000,20000,55000 --json

Two dag-format databases are generated as a *family* (``fixtures.family``,
two machines sharing a synced history, then diverging) and cached under
``--data`` (default ``bench-data/`` in the project root, gitignored). Then,
for each scale:

1. **floor** - laptop-1.db copied to a fresh file; apsw ``ATTACH`` laptop-2.db
   and, in one transaction, ``INSERT OR IGNORE INTO main.<t> SELECT * FROM
   src.<t>`` for every table of ``DAG.merge_order``. Timed: ATTACH + inserts +
   COMMIT (not the copy).
2. **merge** - laptop-1.db copied to a fresh file; ``dagsync.merge.merge(copy,
   [laptop-2.db])`` timed in a child process, which reports its peak RSS
   (``VmHWM``).
3. **re-merge** - the same source merged again into the merged copy (must
   write nothing), also in a child process.

Steps 1-3 run ``--repeat`` times (default 3), one after another; each
ratio is taken within a round and the median over rounds is reported (this
machine's timings drift by 20% from minute to minute, the floor's too).

Each measurement runs in its own child process, so peak RSS is that of the
operation alone (Python + apsw + the operation), never the generator's.
Timings are ``time.perf_counter`` inside the child around the operation only.
Goals (DESIGN.md, "Performance"): merge <= 1.5x floor, re-merge <= 0.3x floor,
peak RSS <= 200 MB and flat as the databases grow. These are measurements,
not tests: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A child measuring another checkout (--baseline) is told which with
# DAGSYNC_BENCH_ROOT: its dagsync must come from there, not from this one.
IMPORT_ROOT = os.environ.get("DAGSYNC_BENCH_ROOT", str(ROOT))
if IMPORT_ROOT not in sys.path:
    sys.path.insert(0, IMPORT_ROOT)

# About 9.5 messages and ~36 rows (all tables) per conversation: 55,000 gives
# ~520k messages and ~2M rows per database.
DEFAULT_CONVERSATIONS = 55_000
QUICK_CONVERSATIONS = 2_000
SHARED_FRACTION = 0.5

GOAL_MERGE = 1.5
GOAL_REMERGE = 0.3
GOAL_RSS_MB = 200


# -- helpers ----------------------------------------------------------------------


def dagsync_version(root: Path = ROOT) -> str:
    """The commit measured (of the checkout at ``root``), marked dirty when dagsync/ has uncommitted changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "dagsync"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def table_rows(path: Path) -> dict[str, int]:
    """Rows per real table (no FTS virtual or shadow tables, no sqlite_* tables)."""
    import apsw

    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        names = [
            name
            for schema, name, kind, *_ in conn.execute("PRAGMA main.table_list")
            if schema == "main" and kind == "table" and not name.startswith("sqlite_")
        ]
        return {
            name: conn.execute(f'SELECT count(*) FROM "{name}"').fetchall()[0][0] for name in sorted(names)
        }
    finally:
        conn.close()


def warm(path: Path) -> None:
    """Read a file once so every measurement starts with it in the page cache."""
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def fresh_copy(src: Path, dst: Path) -> None:
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{dst}{suffix}").unlink(missing_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o600)
    # Write the copy out now, so its writeback does not land inside a timing.
    os.sync()


# The benchmark runs on either format: generator, directory prefix, file names.
FORMAT = "dag"


def machine_files(out: Path) -> tuple[Path, Path]:
    if FORMAT == "llm":
        return out / "machine-1.db", out / "machine-2.db"
    return out / "laptop-1.db", out / "laptop-2.db"


def ensure_family(data: Path, conversations: int, seed: int) -> tuple[Path, Path, dict]:
    """The two databases for a scale, generated once and then reused."""
    prefix = "merge-llm-family" if FORMAT == "llm" else "merge-family"
    out = data / f"{prefix}-seed{seed}-n{conversations}"
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        log(f"reusing {out} (generated in {meta['generate_seconds']:.1f}s)")
        return *machine_files(out), meta
    if FORMAT == "llm":
        from fixtures import family_llm as family
    else:
        from fixtures import family

    building = data / f".building-{out.name}"
    shutil.rmtree(building, ignore_errors=True)
    log(f"generating {conversations} conversations (seed {seed}) into {out} ...")
    started = time.perf_counter()
    reports = family(
        building, seed=seed, machines=2, conversations=conversations, shared_fraction=SHARED_FRACTION
    )
    seconds = time.perf_counter() - started
    meta = {
        "conversations": conversations,
        "seed": seed,
        "shared_fraction": SHARED_FRACTION,
        "generate_seconds": round(seconds, 1),
        "databases": {},
    }
    for r in reports:
        rows = table_rows(Path(r.path))
        meta["databases"][Path(r.path).name] = {
            "conversations": r.conversations,
            "messages": r.messages,
            "calls": r.calls,
            "rows": sum(rows.values()),
            "tables": rows,
            "bytes": Path(r.path).stat().st_size,
        }
    (building / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    building.rename(out)
    log(f"generated in {seconds:.1f}s")
    return *machine_files(out), meta


# -- children: one measurement each ---------------------------------------------------


def child_floor(target: str, source: str, cache_mib: int | None, keep_rows: bool = False) -> dict:
    """The floor; with ``keep_rows``, the floor that keeps every row (see KEEPING_FLOOR)."""
    import apsw

    from dagsync.db import open_source
    from dagsync.formats import Key

    with open_source(source) as checked:  # only to learn the format's tables
        fmt = checked.format
    conn = apsw.Connection(target)
    if cache_mib:
        conn.execute(f"PRAGMA cache_size = -{cache_mib * 1024}")
    conn.execute("PRAGMA foreign_keys = OFF")
    started = time.perf_counter()
    conn.execute("ATTACH DATABASE ? AS src", (source,))
    present = {name for (name,) in conn.execute("SELECT name FROM src.sqlite_schema WHERE type = 'table'")}
    inserted, by_table = {}, {}
    conn.execute("BEGIN")
    for table in fmt.merge_order:
        if table.name not in present:
            continue
        table_started = time.perf_counter()
        if keep_rows and table.key is Key.INTEGER:
            # New ids from SQLite; a row is dropped only by a unique natural key.
            columns = ", ".join(f'"{c}"' for c in fmt.columns[table.name] if c != "id")
            conn.execute(
                f'INSERT OR IGNORE INTO main."{table.name}" ({columns}) SELECT {columns} FROM src."{table.name}"'
            )
        else:
            conn.execute(f'INSERT OR IGNORE INTO main."{table.name}" SELECT * FROM src."{table.name}"')
        inserted[table.name] = conn.changes()
        by_table[table.name] = round(time.perf_counter() - table_started, 3)
    commit_started = time.perf_counter()
    conn.execute("COMMIT")
    by_table["COMMIT"] = round(time.perf_counter() - commit_started, 3)
    seconds = time.perf_counter() - started
    conn.execute("DETACH DATABASE src")
    conn.close()
    return {"seconds": seconds, "inserted": inserted, "by_table": by_table, "peak_rss_mb": peak_rss_mb()}


def child_merge(target: str, source: str, statements: bool) -> dict:

    import dagsync
    from dagsync.merge import merge

    # [name, start, SQL ns, sleep s]; until the first progress call: check
    # the source, open the target, attach.
    phases: list[list] = [["opening", 0.0, 0, 0.0]]
    sql_time: dict[str, list] = {}
    if statements:
        watch_statements(sql_time, phases)
    started = time.perf_counter()

    def progress(phase: str, done: int, total: int) -> None:
        # The time each phase starts; a phase lasts until the next one starts.
        if phases[-1][0] != phase:
            phases.append([phase, time.perf_counter() - started, 0, 0.0])
            log(f"    [{phases[-1][1]:8.2f}s] {phase}")

    report = merge(target, [source], progress=progress)
    seconds = time.perf_counter() - started
    # [phase, seconds, of which SQL, of which sleeping] (the last two with --statements)
    durations = []
    for i, (phase, at, sql_ns, slept) in enumerate(phases):
        end = phases[i + 1][1] if i + 1 < len(phases) else seconds
        durations.append([phase, round(end - at, 4), round(sql_ns / 1e9, 4), round(slept, 4)])
    (src,) = report.sources
    out = {
        "seconds": seconds,
        "peak_rss_mb": peak_rss_mb(),
        "dagsync_path": str(Path(dagsync.__file__).parent),
        "written": src.written,
        "incremental": src.incremental,
        "full_because": src.full_because,
        "tables": {
            t.table: {
                "added": t.added,
                "mapped": t.mapped,
                "existing": t.existing,
                "updated": t.updated,
                "forked": t.forked,
            }
            for t in src.tables
        },
        "phases": durations,
    }
    if statements:
        top = sorted(sql_time.items(), key=lambda kv: -kv[1][0])
        out["sql_seconds"] = round(sum(v[0] for v in sql_time.values()) / 1e9, 3)
        out["sleep_seconds"] = round(sum(p[3] for p in phases), 3)
        out["statements"] = [
            {"seconds": round(ns / 1e9, 3), "count": n, "sql": sql[:300]} for sql, (ns, n) in top[:25]
        ]
    return out


def watch_statements(sql_time: dict[str, list], phases: list[list]) -> None:
    """Time every top-level SQL statement of every connection dagsync opens.

    Totals per statement text go into ``sql_time`` ({sql: [ns, count]}), and
    each statement's time is added to the phase running when it ended (the
    last entry of ``phases``: [name, start, sql_ns, sleep_s]). Time dagsync
    spends in ``time.sleep`` (its polite pauses after commits) is added to
    the phase too. A
    watchdog thread also logs any statement still running after 10 s (SQLite
    runs without the GIL), so a run that never finishes still says where it is.
    """
    import threading

    import apsw

    running: dict[int, tuple[str, float]] = {}

    def trace(event: dict) -> None:
        if event.get("trigger"):
            return
        if event["code"] == apsw.SQLITE_TRACE_STMT:
            running[event["id"]] = (event["sql"], time.perf_counter())
        elif event["code"] == apsw.SQLITE_TRACE_PROFILE:
            running.pop(event["id"], None)
            key = " ".join(event["sql"].split())
            entry = sql_time.setdefault(key, [0, 0])
            entry[0] += event["nanoseconds"]
            entry[1] += 1
            phases[-1][2] += event["nanoseconds"]

    apsw.connection_hooks.append(
        lambda conn: conn.trace_v2(apsw.SQLITE_TRACE_STMT | apsw.SQLITE_TRACE_PROFILE, trace)
    )

    def watchdog() -> None:
        last = time.perf_counter()
        while True:
            time.sleep(10)
            now = time.perf_counter()
            for sql, since in list(running.values()):
                if now - since > 10:
                    log(f"    still running after {now - since:.0f}s: {' '.join(sql.split())[:400]}")
            if now - last >= 60:
                # Where the time has gone so far: a long run of short statements shows here.
                last = now
                count = sum(n for _, n in list(sql_time.values()))
                top = max(list(sql_time.items()), key=lambda kv: kv[1][0], default=None)
                if top:
                    log(
                        f"    {count} statements so far; most time: {top[1][0] / 1e9:.1f}s "
                        f"x{top[1][1]} {top[0][:300]}"
                    )

    threading.Thread(target=watchdog, daemon=True).start()

    real_sleep = time.sleep
    main_thread = threading.main_thread()

    def counted_sleep(seconds: float) -> None:
        if threading.current_thread() is main_thread:  # not the watchdog's own naps
            phases[-1][3] += seconds
        real_sleep(seconds)

    time.sleep = counted_sleep  # this child only: dagsync calls time.sleep


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB.

    Not ``ru_maxrss`` from ``wait4``/``RUSAGE_CHILDREN``: Linux carries the
    parent's high-water mark into a forked (or vforked) child across exec, so
    a child of a parent that generated the fixtures would report the parent's
    peak. VmHWM belongs to the exec'd process's own address space.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)  # kB
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_script_child(script: str, args: list[str], label: str, root: Path = ROOT) -> dict:
    """Run ``python SCRIPT --child ARGS...`` (one measurement in its own process,
    so its peak memory is its own) and return the JSON it prints, with the
    child's wall time, interpreter start-up and imports included. The child
    imports dagsync from the checkout at ``root`` (``--baseline``: another commit's)."""
    cmd = [sys.executable, str(Path(script).resolve()), "--child", *args]
    env = dict(
        os.environ,
        DAGSYNC_BENCH_ROOT=str(root),
        PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    )
    started = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{label} child failed with exit status {proc.returncode}")
    result = json.loads(proc.stdout)
    result["wall_seconds"] = round(wall, 3)
    measured = result.get("dagsync_path")
    if measured and Path(measured).resolve().parent != Path(root).resolve():
        raise SystemExit(f"{label} child imported dagsync from {measured}, not from {root}")
    return result


def run_child(
    kind: str, target: Path, source: Path, statements: bool = False, cache_mib: int | None = None, root: Path = ROOT
) -> dict:
    """One floor or merge measurement in a child process (dagsync from ``root``)."""
    args = [kind, str(target), str(source)]
    if statements:
        args.append("--statements")
    if cache_mib:
        args += ["--floor-cache-mib", str(cache_mib)]
    return run_script_child(__file__, args, kind, root)


def add_baseline_arguments(parser: argparse.ArgumentParser, what: str, repeat: bool = True) -> None:
    """``--baseline DIR`` (and ``--repeat N``): ``what`` measured with another checkout's dagsync too."""
    parser.add_argument(
        "--baseline", type=Path, metavar="DIR",
        help=f"{what} with this checkout and the dagsync of DIR (e.g. `git worktree add DIR COMMIT`), alternating",
    )  # fmt: skip
    if repeat:
        parser.add_argument("--repeat", type=int, default=3, help="rounds of the --baseline comparison (default 3)")


def trees(baseline: Path | None, round_number: int) -> list[tuple[str, Path]]:
    """The checkouts a round measures, in the order it measures them: with a
    baseline, they alternate from round to round, so neither always goes first."""
    if baseline is None:
        return [("", ROOT)]
    pair = [("", ROOT), ("baseline ", baseline)]
    return pair if round_number % 2 else pair[::-1]


# -- one scale ---------------------------------------------------------------------------


def bench_scale(
    data: Path, conversations: int, seed: int, keep: bool, statements: bool, floor_cache_mib: int | None,
    repeat: int = 1, keeping_floor: bool = False, baseline: Path | None = None,
) -> dict:  # fmt: skip
    laptop1, laptop2, meta = ensure_family(data, conversations, seed)
    work = data / "work"
    work.mkdir(parents=True, exist_ok=True)
    # The format is in the names, so merge.py and merge_llm.py can run side by side.
    floor_db = work / f"floor-{FORMAT}-n{conversations}.db"
    merge_db = work / f"merge-{FORMAT}-n{conversations}.db"
    keeping_db = work / f"keeping-floor-{FORMAT}-n{conversations}.db" if keeping_floor else None
    for db in (laptop1, laptop2):
        warm(db)

    try:
        return measure(
            laptop1, laptop2, floor_db, merge_db, meta, conversations, seed, statements, floor_cache_mib, repeat,
            keeping_db, baseline,
        )  # fmt: skip
    finally:
        if not keep:
            for db in (floor_db, merge_db, keeping_db):
                if db is None:
                    continue
                for suffix in ("", "-journal", "-wal", "-shm"):
                    Path(f"{db}{suffix}").unlink(missing_ok=True)


def measure(
    laptop1: Path, laptop2: Path, floor_db: Path, merge_db: Path, meta: dict, conversations: int, seed: int,
    statements: bool, floor_cache_mib: int | None, repeat: int, keeping_db: Path | None = None,
    baseline: Path | None = None,
) -> dict:  # fmt: skip
    """``repeat`` rounds of floor, (keeping floor,) merge, re-merge, one after another.

    Each ratio is taken within a round (the floor and the merge measured
    seconds apart, under the same machine weather), and the figures reported
    are the medians over the rounds; every round is in the JSON. With a
    ``baseline`` checkout, each round also merges and re-merges with its
    dagsync, the two in alternating order, and the same figures are given
    for it under ``baseline``.
    """
    version = dagsync_version()
    rounds = []
    base_rounds = []
    keepings: list[dict | None] = []
    for n in range(1, repeat + 1):
        label = f"[round {n}/{repeat}] " if repeat > 1 else ""
        log(f"{label}floor: copy, then ATTACH + INSERT OR IGNORE ... SELECT * per table in one transaction")
        fresh_copy(laptop1, floor_db)
        floor = run_child("floor", floor_db, laptop2, cache_mib=floor_cache_mib)
        log(f"  {floor['seconds']:.2f}s")

        keeping = None
        if keeping_db:
            log(f"{label}keeping floor: the floor, but integer-keyed rows get new ids instead of being dropped")
            fresh_copy(laptop1, keeping_db)
            keeping = run_child("keeping-floor", keeping_db, laptop2, cache_mib=floor_cache_mib)
            log(f"  {keeping['seconds']:.2f}s ({keeping['seconds'] / floor['seconds']:.2f}x the floor)")

        measured = {}
        for which, root in trees(baseline, n):
            log(f"{label}{which}merge: copy, then dagsync.merge.merge(copy, [{laptop2.name}])")
            fresh_copy(laptop1, merge_db)
            merged = run_child("merge", merge_db, laptop2, statements, root=root)
            log(f"  {merged['seconds']:.2f}s ({merged['seconds'] / floor['seconds']:.2f}x), peak RSS {merged['peak_rss_mb']} MB")

            log(f"{label}{which}re-merge: the same source into the merged copy again")
            os.sync()
            remerged = run_child("merge", merge_db, laptop2, statements, root=root)
            log(
                f"  {remerged['seconds']:.2f}s ({remerged['seconds'] / floor['seconds']:.2f}x), "
                f"peak RSS {remerged['peak_rss_mb']} MB, wrote {remerged['written']} rows"
            )
            measured[which] = (floor, merged, remerged)
        rounds.append(measured[""])
        if baseline is not None:
            base_rounds.append(measured["baseline "])
        keepings.append(keeping)

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    floors, merges, remerges = zip(*rounds, strict=True)
    result = {
        # Which dagsync was measured; "A -> B" if it changed during the run.
        "dagsync": version if dagsync_version() == version else f"{version} -> {dagsync_version()}",
        "conversations": conversations,
        "seed": seed,
        "databases": {name: {k: v for k, v in d.items() if k != "tables"} for name, d in meta["databases"].items()},
        "floor_cache_mib": floor_cache_mib,  # None: SQLite's default (2 MiB)
        "rounds": [
            {"floor_seconds": round(f["seconds"], 3), "merge_seconds": round(m["seconds"], 3),
             "remerge_seconds": round(r["seconds"], 3)}
            | ({"keeping_floor_seconds": round(k["seconds"], 3)} if k else {})
            for (f, m, r), k in zip(rounds, keepings, strict=True)
        ],  # fmt: skip
        "floor_seconds": median([f["seconds"] for f in floors]),
        "floor_peak_rss_mb": max(f["peak_rss_mb"] for f in floors),
        "floor_inserted": floors[-1]["inserted"],
        # Seconds per table's insert (and the commit) in the last round: what the copy is weighed against.
        "floor_by_table": floors[-1]["by_table"],
        "merge_seconds": median([m["seconds"] for m in merges]),
        "merge_ratio": round(median([m["seconds"] / f["seconds"] for f, m, _ in rounds]), 2),
        "merge_peak_rss_mb": max(m["peak_rss_mb"] for m in merges),
        "remerge_seconds": median([r["seconds"] for r in remerges]),
        "remerge_ratio": round(median([r["seconds"] / f["seconds"] for f, _, r in rounds]), 2),
        "remerge_peak_rss_mb": max(r["peak_rss_mb"] for r in remerges),
        "remerge_written": max(r["written"] for r in remerges),
        "merge": merges[-1],
        "remerge": remerges[-1],
        "rows_after": {"floor": sum(table_rows(floor_db).values()), "merge": sum(table_rows(merge_db).values())},
    }
    if keeping_db:
        pairs = list(zip(rounds, keepings, strict=True))
        result["keeping_floor_seconds"] = median([k["seconds"] for _, k in pairs])
        result["keeping_floor_ratio"] = round(median([k["seconds"] / f["seconds"] for (f, _, _), k in pairs]), 2)
        result["merge_ratio_keeping"] = round(median([m["seconds"] / k["seconds"] for (_, m, _), k in pairs]), 2)
        result["remerge_ratio_keeping"] = round(median([r["seconds"] / k["seconds"] for (_, _, r), k in pairs]), 2)
        result["rows_after"]["keeping_floor"] = sum(table_rows(keeping_db).values())
    if baseline is not None:
        result["baseline"] = {
            "dagsync": dagsync_version(baseline),
            "dagsync_path": base_rounds[-1][1]["dagsync_path"],
            "rounds": [
                {"merge_seconds": round(m["seconds"], 3), "remerge_seconds": round(r["seconds"], 3)}
                for _, m, r in base_rounds
            ],
            "merge_seconds": median([m["seconds"] for _, m, _ in base_rounds]),
            "merge_ratio": round(median([m["seconds"] / f["seconds"] for f, m, _ in base_rounds]), 2),
            "merge_peak_rss_mb": max(m["peak_rss_mb"] for _, m, _ in base_rounds),
            "remerge_seconds": median([r["seconds"] for _, _, r in base_rounds]),
            "remerge_ratio": round(median([r["seconds"] / f["seconds"] for f, _, r in base_rounds]), 2),
            "remerge_peak_rss_mb": max(r["peak_rss_mb"] for _, _, r in base_rounds),
            # This checkout's time over the baseline's, within each round.
            "merge_speedup": round(median([bm["seconds"] / m["seconds"] for (_, m, _), (_, bm, _) in zip(rounds, base_rounds, strict=True)]), 3),
            "remerge_speedup": round(median([br["seconds"] / r["seconds"] for (_, _, r), (_, _, br) in zip(rounds, base_rounds, strict=True)]), 3),
        }
    return result


# -- output ------------------------------------------------------------------------------------


def mark(ok: bool) -> str:
    return "ok" if ok else "OVER"


def print_scale(r: dict, out=sys.stdout) -> None:
    say = functools.partial(print, file=out)
    say(f"\n== {r['conversations']} conversations per family (seed {r['seed']}), dagsync {r['dagsync']}")
    for name, d in r["databases"].items():
        say(
            f"  {name}: {d['rows']:,} rows ({d['messages']:,} messages, {d['calls']:,} calls, "
            f"{d['conversations']:,} conversations), {d['bytes'] / 2**20:,.0f} MiB"
        )
    say()
    say(f"  {'':<10} {'seconds':>9} {'x floor':>8} {'goal':>7} {'peak RSS MB':>12}")
    cache = f"page cache {r['floor_cache_mib']} MiB" if r["floor_cache_mib"] else "SQLite's default page cache"
    say(
        f"  {'floor':<10} {r['floor_seconds']:>9.2f} {1.0:>8.2f} {'':>7} {r['floor_peak_rss_mb']:>12.1f}   ({cache})"
    )
    say(
        f"  {'merge':<10} {r['merge_seconds']:>9.2f} {r['merge_ratio']:>8.2f} {'<=' + str(GOAL_MERGE):>7} "
        f"{r['merge_peak_rss_mb']:>12.1f}   time {mark(r['merge_ratio'] <= GOAL_MERGE)}, "
        f"memory {mark(r['merge_peak_rss_mb'] <= GOAL_RSS_MB)}"
    )
    say(
        f"  {'re-merge':<10} {r['remerge_seconds']:>9.2f} {r['remerge_ratio']:>8.2f} {'<=' + str(GOAL_REMERGE):>7} "
        f"{r['remerge_peak_rss_mb']:>12.1f}   time {mark(r['remerge_ratio'] <= GOAL_REMERGE)}, "
        f"memory {mark(r['remerge_peak_rss_mb'] <= GOAL_RSS_MB)}; wrote {r['remerge_written']} rows"
    )
    if "keeping_floor_seconds" in r:
        say(
            f"  {'keeping floor':<10} {r['keeping_floor_seconds']:>6.2f} {r['keeping_floor_ratio']:>8.2f}"
            f"   (the floor, but integer-keyed rows get new ids instead of being dropped)"
        )
        say(
            f"  against the keeping floor: merge {r['merge_ratio_keeping']:.2f}x, "
            f"re-merge {r['remerge_ratio_keeping']:.2f}x"
        )
    if "baseline" in r:
        b = r["baseline"]
        say(
            f"  baseline {b['dagsync']} ({b['dagsync_path']}), the same rounds, alternating: "
            f"merge {b['merge_seconds']:.2f}s = {b['merge_ratio']:.2f}x, re-merge {b['remerge_seconds']:.2f}s = "
            f"{b['remerge_ratio']:.2f}x; baseline time / this time: merge {b['merge_speedup']:.3f}, "
            f"re-merge {b['remerge_speedup']:.3f}"
        )
    rows = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in r["rows_after"].items())
    say(f"  rows after: {rows}")
    say("\n  merge report (added / mapped / existing / updated / forked):")
    for name, t in r["merge"]["tables"].items():
        if any(t.values()):
            say(
                f"    {name:<26} +{t['added']:<9,} mapped {t['mapped']:<8,} existing {t['existing']:<9,} "
                f"updated {t['updated']:<6,} forked {t['forked']:,}"
            )
    slowest = sorted(r["floor_by_table"].items(), key=lambda kv: -kv[1])[:8]
    say("\n  floor by table (seconds, last round): " + ", ".join(f"{name} {sec:.2f}" for name, sec in slowest))
    for label, run in (("merge", r["merge"]), ("re-merge", r["remerge"])):
        detail = "statements" in run
        say(f"\n  {label} phases (seconds{'; of which SQL, sleeping' if detail else ''}):")
        for phase, seconds, sql, slept in sorted(run["phases"], key=lambda p: -p[1])[:12]:
            say(f"    {seconds:>8.2f}" + (f" {sql:>8.2f} {slept:>6.2f}" if detail else "") + f"  {phase}")
        if detail:
            say(
                f"  {label}: SQL {run['sql_seconds']:.2f}s, sleeping {run['sleep_seconds']:.2f}s "
                f"of {run['seconds']:.2f}s; slowest statements:"
            )
            for s in run["statements"][:10]:
                say(f"    {s['seconds']:>8.2f}s x{s['count']:<5} {s['sql'][:160]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "bench-data", help="cache of generated databases")
    parser.add_argument(
        "--format", choices=("dag", "llm"), default="dag",
        help="generate dag-format laptops (default) or llm 0.36 logs.db files (benchmarks/merge_llm.py)",
    )  # fmt: skip
    parser.add_argument(
        "--conversations", type=int, default=DEFAULT_CONVERSATIONS,
        help=f"conversations per family (default {DEFAULT_CONVERSATIONS}: >= 1M rows per database)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_CONVERSATIONS} conversations")
    parser.add_argument("--scales", help="comma-separated conversation counts, e.g. 2000,20000,55000")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--repeat", type=int, default=3,
        help="rounds of floor, merge, re-merge; the ratios are medians of each round's (default 3; --quick: 1)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument("--keep", action="store_true", help="keep the merged copies in DATA/work")
    parser.add_argument(
        "--statements", action="store_true",
        help="time every SQL statement of the merge (apsw set_profile) and show the slowest",
    )  # fmt: skip
    parser.add_argument(
        "--floor-cache-mib", type=int,
        help="give the floor's connection this page cache (dagsync's target uses its own; default: SQLite's 2 MiB)",
    )  # fmt: skip
    parser.add_argument(
        "--keeping-floor", action=argparse.BooleanOptionalAction, default=None,
        help="also time the floor that keeps every row: integer-keyed rows get new ids instead of being "
        "dropped (default: on for --format llm, whose floor drops them)",
    )  # fmt: skip
    add_baseline_arguments(parser, "every round also merges and re-merges", repeat=False)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "TARGET", "SOURCE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    global FORMAT
    FORMAT = args.format
    if args.child:  # internal: one measurement, `--child floor|merge TARGET SOURCE`
        kind, target, source = args.child
        if kind in ("floor", "keeping-floor"):
            out = child_floor(target, source, args.floor_cache_mib, keep_rows=kind == "keeping-floor")
        else:
            out = child_merge(target, source, args.statements)
        json.dump(out, sys.stdout)
        return 0

    if args.scales:
        scales = [int(s) for s in args.scales.split(",") if s.strip()]
    elif args.quick:
        scales = [QUICK_CONVERSATIONS]
    else:
        scales = [args.conversations]
    args.data.mkdir(parents=True, exist_ok=True)
    results = [
        bench_scale(
            args.data, n, args.seed, args.keep, args.statements, args.floor_cache_mib, 1 if args.quick else args.repeat,
            args.keeping_floor if args.keeping_floor is not None else FORMAT == "llm",
            args.baseline.resolve() if args.baseline else None,
        )  # fmt: skip
        for n in scales
    ]
    if args.json:
        json.dump({"python": sys.version.split()[0], "results": results}, sys.stdout, indent=2)
        print()
    # With --json the tables go to stderr, so stdout stays one JSON document.
    out = sys.stderr if args.json else sys.stdout
    for r in results:
        print_scale(r, out)
    if len(results) > 1:
        print("\n== peak RSS by scale (MB): should stay flat", file=out)
        for r in results:
            rows = max(d["rows"] for d in r["databases"].values())
            print(
                f"  {r['conversations']:>8,} conversations, {rows:>10,} rows/db: "
                f"merge {r['merge_peak_rss_mb']:>7.1f}  re-merge {r['remerge_peak_rss_mb']:>7.1f}  "
                f"floor {r['floor_peak_rss_mb']:>7.1f}",
                file=out,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
