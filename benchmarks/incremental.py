"""Benchmark consolidation that costs what is new (issue 4/6), both formats,
against the DESIGN.md floor for the same databases measured in the same run.

    .venv/bin/python benchmarks/incremental.py                       # both formats, 55,000 and 5,500 conversations
    .venv/bin/python benchmarks/incremental.py --formats llm --scales 5500 --repeat 1
    .venv/bin/python benchmarks/incremental.py --quick                # a small smoke run

For each format and scale, the family of two machines that ``merge.py`` /
``merge_llm.py`` use (cached in ``bench-data/``): machine 1 is the target,
machine 2 the source. The target merges the source once (its marks are
recorded), then the source gains about 1% more rows (``fixtures`` ``grow``:
threads continued, their tips moved, and new ones). Each round, one after
another, each in its own child process:

* **floor**: the raw-SQLite copy of ``merge.py`` (machine 2 into a copy of machine 1);
* **(a) re-merge, nothing new**: the merged target, the same source again -
  the very file merged, untouched since (a hard link to it at the path it
  was merged from), and a fresh copy of it, whose new inode and time make
  the merge look at its pointer rows (``marks.file_state``);
* **(b) merge of the 1%**: the merged target, the grown source (from its
  marks); beside it, its own floor: raw SQLite inserting just the new rows
  into the merged target (what any merge of them must at least write);
* **(c) push of the 1%** over loopback ssh to a real sshd (``tests/sshd.py``),
  end to end: marks fetched, bundle made, sent, merged there. As a nightly
  push runs (this machine remembers the marks the last push left there, and
  makes the bundle while ssh connects), and after that memory was lost
  (cold). Beside it, what any push pays before it sends a byte: ``ssh HOST
  true``, and ``ssh HOST dagsync --version``. Bytes on the wire against the
  least any transfer must send (a SQLite file of just the new rows,
  VACUUMed, zstd level 3), and what ``rsync -az`` sends to bring a copy of
  the old source up to date (what people do today);
* **(d) merge of the 1% after a forget in the target**: the merged target,
  which then forgot 1% of the conversations the source still holds (the
  oldest ones that the 1% does not touch: `dagsync forget --id`), and the
  grown source, from its marks: the cost of a nightly merge on a server
  whose cron forgets old conversations (docs/forget.md). Whether it read
  the source from its marks is printed;
* peak RSS of each (the receiving dagsync's too, for the push).

Ratios are taken within a round; medians over rounds are reported. Nothing
here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import merge as M  # noqa: E402

GOALS = {"remerge": 0.01, "merge_1pct": 0.05, "push_1pct": 0.1, "wire_vs_least": 1.5, "rss_mb": 100}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- children ------------------------------------------------------------------------------


def child_push(source: str, host: str, target: str, rsh: str, remote_dagsync: str) -> dict:
    from dagsync.remote import Remote, Transport, push

    started = time.perf_counter()
    report = push(source, Remote(host, target), Transport(rsh, remote_dagsync))
    return {
        "seconds": time.perf_counter() - started, "peak_rss_mb": M.peak_rss_mb(), "sent_bytes": report.sent_bytes,
        "bundle_bytes": report.bundle_bytes, "rows": sum(report.rows.values()), "written": report.written,
        "against": report.against, "guessed": report.guessed,
    }  # fmt: skip


def remote_child(rss_file: str, argv: list[str]) -> None:
    """dagsync as run by ssh on the other end, writing its peak RSS to ``rss_file`` at exit."""
    import atexit

    from dagsync.cli import run

    atexit.register(lambda: Path(rss_file).write_text(str(M.peak_rss_mb())))
    run(argv)


# -- the least any transfer must send ----------------------------------------------------------


def least_bytes(target: Path, source: Path, fmt_name: str, work: Path) -> int:
    """A new file of the format holding only the source's rows beyond the target's marks (without
    the full-text index, which is derived), VACUUMed, zstd -3."""
    import apsw
    import zstandard

    from dagsync.db import open_target
    from dagsync.formats.dag import DAG
    from dagsync.formats.llm import LLM

    fmt = LLM if fmt_name == "llm" else DAG
    out = work / "least.db"
    out.unlink(missing_ok=True)
    open_target(out, create=fmt).close()
    conn = apsw.Connection(str(out))
    # No full-text index: derived, and rebuilt by the receiving side's own triggers (merge.derived).
    for (name,) in list(conn.execute("SELECT name FROM sqlite_schema WHERE type = 'trigger'")):
        conn.execute(f'DROP TRIGGER "{name}"')
    conn.execute("ATTACH DATABASE ? AS t", (str(target),))
    conn.execute("ATTACH DATABASE ? AS s", (str(source),))
    marks = marks_in(conn, "t", source)
    conn.execute("BEGIN")
    for table in fmt.merge_order:
        if table.name not in marks:
            continue
        cols = ", ".join(f'"{c}"' for c in fmt.columns[table.name])
        conn.execute(f'INSERT OR IGNORE INTO main."{table.name}" ({cols}) SELECT {cols} FROM s."{table.name}" WHERE rowid > ?', (marks[table.name],))
    conn.execute("COMMIT")
    conn.execute("DETACH DATABASE t")
    conn.execute("DETACH DATABASE s")
    conn.execute("VACUUM")
    conn.close()
    return len(zstandard.ZstdCompressor(level=3).compress(out.read_bytes()))


def marks_in(conn, schema: str, source: Path) -> dict[str, int]:
    """The marks the target attached as ``schema`` keeps of ``source``: table -> highest rowid merged."""
    from dagsync.merge.marks import where

    (entry,) = next(iter(conn.execute(f"SELECT id FROM {schema}._dagsync_sources WHERE path = ?", (where(source),))))
    return dict(conn.execute(f"SELECT tbl, mark FROM {schema}._dagsync_marks WHERE source = ?", (entry,)).fetchall())


def child_raw_new_rows(target: str, source: str, fmt_name: str) -> dict:
    """(b)'s own floor: raw SQLite copying just the source's rows beyond the
    marks into the merged target (``INSERT OR IGNORE ... SELECT * ... WHERE
    rowid > mark`` per table, integer-keyed rows under new ids, one
    transaction, dagsync's page cache). What
    any merge of the 1% must at least write: new rows into every index of
    a large file, each commit journalled. Timed: ATTACH + inserts + COMMIT."""
    import apsw

    from dagsync.db import CACHE_KIB
    from dagsync.formats import Key
    from dagsync.formats.dag import DAG
    from dagsync.formats.llm import LLM

    fmt = LLM if fmt_name == "llm" else DAG
    conn = apsw.Connection(target)
    conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    conn.execute("PRAGMA foreign_keys = OFF")
    marks = marks_in(conn, "main", Path(source))
    started = time.perf_counter()
    conn.execute("ATTACH DATABASE ? AS s", (source,))
    conn.execute("BEGIN")
    inserted = 0
    for table in fmt.merge_order:
        if table.name in marks:
            # An integer-keyed row gets a new id (its source id is another row's here), as merge.py's keeping floor.
            columns = ", ".join(f'"{c}"' for c in fmt.columns[table.name] if not (table.key is Key.INTEGER and c == "id"))
            conn.execute(
                f'INSERT OR IGNORE INTO main."{table.name}" ({columns}) SELECT {columns} FROM s."{table.name}" WHERE rowid > ?',
                (marks[table.name],),
            )
            inserted += conn.changes()
    conn.execute("COMMIT")
    seconds = time.perf_counter() - started
    conn.close()
    return {"seconds": seconds, "rows": inserted, "peak_rss_mb": M.peak_rss_mb()}


def rsync_bytes(old: Path, grown: Path, host: str, rsh: str, work: Path) -> int | None:
    if not shutil.which("rsync"):
        return None
    copy = work / "rsync-copy.db"
    M.fresh_copy(old, copy)
    done = subprocess.run(
        ["rsync", "-az", "--stats", "-e", rsh, str(grown), f"{host}:{copy}"], capture_output=True, text=True
    )
    copy.unlink(missing_ok=True)
    match = re.search(r"Total bytes sent: ([\d,]+)", done.stdout)
    return int(match.group(1).replace(",", "")) if match else None


# -- one format, one scale ---------------------------------------------------------------------


def prepare(fmt: str, data: Path, conversations: int, seed: int) -> dict:
    M.FORMAT = fmt
    m1, m2, meta = M.ensure_family(data, conversations, seed)
    work = data / "work" / f"incremental-{fmt}-n{conversations}"
    work.mkdir(parents=True, exist_ok=True)
    merged, before, grown = work / "target-merged.db", work / "source-before.db", work / "source-grown.db"
    source = work / "source.db"
    if not (merged.exists() and grown.exists() and before.exists()):
        from dagsync.merge import merge

        log(f"  preparing {work}: the target merges the source once, then the source grows by about 1%")
        M.fresh_copy(m2, source)
        M.fresh_copy(m1, merged)
        merge(merged, [source])
        # The very file merged is kept as it is (its inode, size and time are
        # in the marks, marks.file_state): (a) links it back to the path it
        # was merged from, as a laptop's logs.db nobody wrote to since.
        os.replace(source, before)
        shutil.copyfile(before, source)
        rows = meta["databases"][m2.name]["rows"]
        k = max(1, int(rows * 0.01 / 57))
        if fmt == "llm":
            from fixtures.llm_format import grow_llm as grow
        else:
            from fixtures.generate import grow
        grow(source, seed=seed, continued=k, new=k)
        shutil.copyfile(source, grown)
    forgot = work / "target-forgot.db"
    if not forgot.exists():
        _forget_untouched(merged, before, grown, forgot, fmt)
    grown_rows = sum(M.table_rows(grown).values())
    before_rows = sum(M.table_rows(before).values())
    return {
        "m1": m1, "m2": m2, "meta": meta, "work": work, "merged": merged, "before": before, "grown": grown,
        "source": source, "before_rows": before_rows, "new_rows": grown_rows - before_rows, "forgot": forgot,
    }  # fmt: skip


def _forget_untouched(merged: Path, before: Path, grown: Path, out: Path, fmt: str) -> None:
    """``out``: ``merged`` after forgetting 1% of its conversations, the oldest ones
    (lowest rowid) whose pointer row the source's growth left alone."""
    import sqlite3

    from dagsync.forget import Selector, forget

    table, pointer = ("threads", "tip_message_hash") if fmt == "llm" else ("conversations", "head_message_id")
    with sqlite3.connect(f"file:{before}?mode=ro", uri=True) as old, sqlite3.connect(f"file:{grown}?mode=ro", uri=True) as new:
        heads = dict(old.execute(f'SELECT id, "{pointer}" FROM "{table}"'))
        moved = {k for k, head in new.execute(f'SELECT id, "{pointer}" FROM "{table}"') if heads.get(k) != head}
        ids = [k for (k,) in old.execute(f'SELECT id FROM "{table}" ORDER BY rowid')]
    chosen = [k for k in ids if k not in moved][: max(1, len(ids) // 100)]
    log(f"  preparing {out}: the merged target forgets {len(chosen):,} of {len(ids):,} conversations")
    M.fresh_copy(merged, out)
    forget(out, Selector(ids=tuple(chosen)))


def one_round(p: dict, server, fmt: str, first: bool = True) -> dict:
    work, source = p["work"], p["source"]
    target, floor_db = work / "target.db", work / "floor.db"
    out: dict = {}
    M.FORMAT = fmt
    M.fresh_copy(p["m1"], floor_db)
    out["floor"] = M.run_child("floor", floor_db, p["m2"])
    floor_db.unlink()
    # (a) nothing new: the file merged, untouched since; and a copy of it,
    # whose new inode and time say nothing of whether it was written since.
    M.fresh_copy(p["merged"], target)
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{source}{suffix}").unlink(missing_ok=True)
    os.link(p["before"], source)
    out["remerge"] = M.run_child("merge", target, source)
    M.fresh_copy(p["merged"], target)
    M.fresh_copy(p["before"], source)
    out["remerge_copy"] = M.run_child("merge", target, source)
    # (b) the 1%
    M.fresh_copy(p["merged"], target)
    M.fresh_copy(p["grown"], source)
    out["merge_1pct"] = M.run_child("merge", target, source)
    out["least_bytes"] = least_bytes(p["merged"], source, fmt, work)
    # (d) the 1%, into a target that forgot 1% of what the source holds
    M.fresh_copy(p["forgot"], target)
    M.fresh_copy(p["grown"], source)
    out["merge_1pct_forgot"] = M.run_child("merge", target, source)
    M.fresh_copy(p["merged"], target)
    out["raw_1pct"] = M.run_script_child(__file__, ["raw", str(target), str(source), fmt], "raw copy of the new rows")
    # (c) the 1% pushed, to a copy of the merged target reached over ssh: as a
    # nightly push does (this machine remembers the marks the last push left
    # there: remote.MarksCache), and after the cache was lost (cold)
    from dagsync.bundle import marks_of
    from dagsync.remote import MarksCache, Remote

    rss_file = work / "remote-rss"
    remote = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} --remote-child {shlex.quote(str(rss_file))}"
    for kind in ("push_1pct_cold", "push_1pct"):
        M.fresh_copy(p["merged"], target)
        cache = MarksCache(Remote(server.host, str(target)), source)
        cache.path.unlink(missing_ok=True)
        if kind == "push_1pct":
            cache.write(marks_of(target))  # what the last push left there
        rss_file.unlink(missing_ok=True)
        out[kind] = M.run_script_child(__file__, ["push", str(source), server.host, str(target), server.rsh, remote], "push")
        out[kind]["remote_peak_rss_mb"] = float(rss_file.read_text()) if rss_file.exists() else None
    # What any push pays before it sends a byte: one ssh session, and dagsync starting there.
    out["ssh_alone"] = timed([*shlex.split(server.rsh), server.host, "true"])
    out["ssh_dagsync_version"] = timed([*shlex.split(server.rsh), server.host, f"{server.remote_dagsync} --version"])
    out["rsync_bytes"] = rsync_bytes(p["before"], p["grown"], server.host, server.rsh, work) if first else None
    target.unlink(missing_ok=True)
    floor = out["floor"]["seconds"]
    out["ratios"] = {
        k: out[k]["seconds"] / floor
        for k in ("remerge", "remerge_copy", "merge_1pct", "merge_1pct_forgot", "raw_1pct", "push_1pct", "push_1pct_cold")
    }
    out["wire_vs_least"] = out["push_1pct"]["sent_bytes"] / out["least_bytes"]
    return out


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - started


def summarise(fmt: str, conversations: int, p: dict, rounds: list[dict]) -> dict:
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    return {
        "format": fmt, "conversations": conversations, "rows_per_database": p["before_rows"],
        "new_rows": p["new_rows"], "new_fraction": round(p["new_rows"] / p["before_rows"], 4),
        "floor_seconds": round(med(lambda r: r["floor"]["seconds"]), 3),
        "remerge_seconds": round(med(lambda r: r["remerge"]["seconds"]), 3),
        "remerge_copy_seconds": round(med(lambda r: r["remerge_copy"]["seconds"]), 3),
        "merge_1pct_seconds": round(med(lambda r: r["merge_1pct"]["seconds"]), 3),
        "push_1pct_seconds": round(med(lambda r: r["push_1pct"]["seconds"]), 3),
        "push_1pct_cold_seconds": round(med(lambda r: r["push_1pct_cold"]["seconds"]), 3),
        "push_guessed": all(r["push_1pct"]["guessed"] for r in rounds),
        "raw_1pct_seconds": round(med(lambda r: r["raw_1pct"]["seconds"]), 3),
        "ratios": {
            k: round(med(lambda r, k=k: r["ratios"][k]), 4)
            for k in ("remerge", "remerge_copy", "merge_1pct", "merge_1pct_forgot", "raw_1pct", "push_1pct", "push_1pct_cold")
        },
        "merge_1pct_forgot_seconds": round(med(lambda r: r["merge_1pct_forgot"]["seconds"]), 3),
        "merge_1pct_forgot_incremental": all(r["merge_1pct_forgot"].get("incremental") for r in rounds),
        "merge_1pct_forgot_full_because": rounds[0]["merge_1pct_forgot"].get("full_because"),
        "ssh_alone_seconds": round(med(lambda r: r["ssh_alone"]), 3),
        "ssh_dagsync_version_seconds": round(med(lambda r: r["ssh_dagsync_version"]), 3),
        "merge_vs_raw_1pct": round(med(lambda r: r["merge_1pct"]["seconds"] / r["raw_1pct"]["seconds"]), 2),
        "sent_bytes": int(med(lambda r: r["push_1pct"]["sent_bytes"])),
        "least_bytes": int(med(lambda r: r["least_bytes"])),
        "wire_vs_least": round(med(lambda r: r["wire_vs_least"]), 3),
        "rsync_bytes": rounds[0]["rsync_bytes"],
        "peak_rss_mb": {
            "remerge": max(r["remerge"]["peak_rss_mb"] for r in rounds),
            "merge_1pct": max(r["merge_1pct"]["peak_rss_mb"] for r in rounds),
            "push_local": max(r[k]["peak_rss_mb"] for r in rounds for k in ("push_1pct", "push_1pct_cold")),
            "push_remote": max((r[k]["remote_peak_rss_mb"] or 0) for r in rounds for k in ("push_1pct", "push_1pct_cold")),
        },
        "rounds": [{k: v for k, v in r.items()} for r in rounds],
    }  # fmt: skip


def show(s: dict) -> None:
    ok = lambda good: "ok" if good else "OVER"  # noqa: E731
    r = s["ratios"]
    print(f"\n== {s['format']} format, {s['conversations']:,} conversations: {s['rows_per_database']:,} rows per database, "
          f"+{s['new_rows']:,} new rows ({s['new_fraction']:.2%})")
    print(f"  floor                     {s['floor_seconds']:8.2f} s")
    print(f"  (a) re-merge, nothing new {s['remerge_seconds']:8.3f} s = {r['remerge']:.4f}x floor   goal <= {GOALS['remerge']}x  {ok(r['remerge'] <= GOALS['remerge'])}")
    print(f"      the same source copied anew (a new inode and time): {s['remerge_copy_seconds']:.3f} s = {r['remerge_copy']:.4f}x floor")
    print(f"  (b) merge of the 1%       {s['merge_1pct_seconds']:8.3f} s = {r['merge_1pct']:.4f}x floor   goal <= {GOALS['merge_1pct']}x  {ok(r['merge_1pct'] <= GOALS['merge_1pct'])}")
    print(f"      raw SQLite copying just the new rows: {s['raw_1pct_seconds']:.3f} s = {r['raw_1pct']:.4f}x floor; (b) is {s['merge_vs_raw_1pct']:.2f}x it")
    how = "from its marks" if s["merge_1pct_forgot_incremental"] else f"WHOLE: {s['merge_1pct_forgot_full_because']}"
    print(f"  (d) the 1% after a forget {s['merge_1pct_forgot_seconds']:8.3f} s = {r['merge_1pct_forgot']:.4f}x floor   (read {how})")
    print(f"  (c) push of the 1%        {s['push_1pct_seconds']:8.3f} s = {r['push_1pct']:.4f}x floor   goal <= {GOALS['push_1pct']}x  {ok(r['push_1pct'] <= GOALS['push_1pct'])}")
    print(f"      the same after the marks cache was lost {s['push_1pct_cold_seconds']:.3f} s = {r['push_1pct_cold']:.4f}x floor"
          f"{'' if s['push_guessed'] else '   (the warm push did NOT use its guess)'}")
    print(f"      of which any push pays: ssh HOST true {s['ssh_alone_seconds']:.3f} s; ssh HOST dagsync --version {s['ssh_dagsync_version_seconds']:.3f} s")
    print(f"      on the wire {s['sent_bytes']:,} bytes; least {s['least_bytes']:,}: {s['wire_vs_least']:.2f}x   goal <= {GOALS['wire_vs_least']}x  {ok(s['wire_vs_least'] <= GOALS['wire_vs_least'])}")
    print(f"      rsync -az of the grown file onto the old one: {s['rsync_bytes']:,} bytes" if s["rsync_bytes"] else "      rsync: not installed")
    rss = s["peak_rss_mb"]
    print(f"  peak RSS MB: re-merge {rss['remerge']}, merge {rss['merge_1pct']}, push here {rss['push_local']}, there {rss['push_remote']}   goal <= {GOALS['rss_mb']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="dag,llm")
    parser.add_argument("--scales", default="55000,5500", help="conversations per machine (55,000: about 2M rows)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data", type=Path, default=ROOT / "bench-data")
    parser.add_argument("--quick", action="store_true", help="2,000 conversations, one round")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.scales, args.repeat = "2000", 1
    from tests import sshd

    # The marks push remembers (remote.MarksCache) go to a folder of this run's, not ~/.cache.
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="dagsync-bench-cache-")
    results = []
    with tempfile.TemporaryDirectory(prefix="dagsync-bench-sshd-") as d:
        server = sshd.start(Path(d))
        try:
            for fmt in args.formats.split(","):
                for n in [int(x) for x in args.scales.split(",")]:
                    log(f"{fmt}, {n} conversations")
                    p = prepare(fmt, args.data, n, args.seed)
                    rounds = []
                    for i in range(args.repeat):
                        log(f"  round {i + 1}")
                        rounds.append(one_round(p, server, fmt, first=i == 0))
                    summary = summarise(fmt, n, p, rounds)
                    summary["commit"] = M.dagsync_version()
                    show(summary)
                    results.append(summary)
        finally:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        print(json.dumps(child_push(*rest) if kind == "push" else child_raw_new_rows(*rest) if kind == "raw" else {}))
    elif len(sys.argv) > 1 and sys.argv[1] == "--remote-child":
        remote_child(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(main())
