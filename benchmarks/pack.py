"""Benchmark `dagsync pack`: file size, dictionary gain, throughput, memory, in one run.

    .venv/bin/python benchmarks/pack.py                   # >= 1M rows (the merge benchmark's data)
    .venv/bin/python benchmarks/pack.py --quick           # small smoke run
    .venv/bin/python benchmarks/pack.py --format llm --json
    .venv/bin/python benchmarks/pack.py --quick --thresholds 128,256,512,1024   # choose the threshold

The subject is one machine of the merge benchmark's generated family
(``benchmarks/merge.py``'s cache under ``bench-data/``: text from the fixture
generator, >= 1M rows at the default size). Each measurement runs in its own
child process (peak RSS is its own ``VmHWM``):

1. **raw** - the payloads ``pack`` would pack (values of ``Format.packed``
   columns at least the threshold long), read from the file and compressed
   one by one with ``zstandard`` at the same level in one loop; only the
   compress calls are timed. Payload MB/s.
2. **pack** - ``dagsync.blobs.pack(copy, dictionary=True, vacuum=True)`` on a
   fresh copy: time (without the vacuum), payload MB/s, file size before and
   after pack + vacuum.
3. **dictionary** - the payloads under 1 KiB that pack packs, compressed one
   by one without and with a dictionary trained the way ``pack --dict`` trains
   it: total compressed bytes each way.
4. **SQLite's share** - on another fresh copy, in one transaction: a blob row
   per distinct payload (random key, pack's measured stored size) and every
   packed value rewritten to a marker, nothing hashed or compressed. Raw
   zstandard's time over this is the best throughput ratio any pack could
   reach on this machine.

Goals (issue 5/6): file after pack + vacuum <= 45% of before (dag), <= 50%
(llm); what a packed payload costs all in (``size after - (size before - raw
payload bytes)``, over those bytes) <= 0.45; dictionary >= 1.5x smaller than
plain zstd on payloads under 1 KiB; pack throughput >= 0.5x raw zstandard;
peak RSS <= 150 MB; and ``dbstat`` shares after packing, so what remains is
visible. Measurements, not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# merge.py puts the checkout to measure first (DAGSYNC_BENCH_ROOT, for --baseline).
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import merge as merge_bench  # noqa: E402  (benchmarks/merge.py: data cache and helpers)

# Issue 5/6: the file after pack --dict --vacuum, by format; what a packed
# payload costs all in (frames, keys, index, references), as a fraction of
# its bytes; throughput against raw zstandard on one core; peak RSS.
GOAL_SIZE = {"dag": 0.45, "llm": 0.50}
GOAL_COST = 0.45
GOAL_DICT = 1.5
GOAL_THROUGHPUT = 0.5
GOAL_RSS_MB = 150


def dbstat(path: str) -> dict[str, int]:
    """Bytes of pages per table, its indexes and (for a full-text index) its shadow tables counted with it."""
    import apsw

    conn = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
    try:
        owner = {name: tbl for name, tbl in conn.execute("SELECT name, tbl_name FROM sqlite_schema")}
        virtual = [n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE sql LIKE 'CREATE VIRTUAL TABLE%'")]
        out: dict[str, int] = {}
        for name, size in conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"):
            table = owner.get(name, name)
            table = next((v for v in virtual if table.startswith(v + "_")), table)
            out[table] = out.get(table, 0) + size
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
    finally:
        conn.close()


def _payloads(path: str, threshold: int, below: int | None = None):
    """Every value pack would pack, as bytes, streamed from the file."""
    import apsw

    from dagsync.db import open_source

    with open_source(path, quick_check=False) as db:
        conn = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
        for column in db.format.packed:
            value = f'"{column.column}"'
            upper = f" AND length(CAST({value} AS BLOB)) < {below}" if below else ""
            try:
                rows = conn.execute(
                    f'SELECT CAST({value} AS BLOB) FROM "{column.table}" WHERE typeof({value}) = ? '
                    f"AND length(CAST({value} AS BLOB)) >= ?{upper}",
                    (column.holds, threshold),
                )
                yield from (bytes(v) for (v,) in rows)
            except apsw.SQLError:
                continue  # a table this file does not have


def child_raw(path: str, level: int, threshold: int) -> dict:
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    seconds = 0.0
    total = stored = count = 0
    for payload in _payloads(path, threshold):
        started = time.perf_counter()
        frame = compressor.compress(payload)
        seconds += time.perf_counter() - started
        total += len(payload)
        stored += len(frame)
        count += 1
    return {"seconds": round(seconds, 3), "payloads": count, "payload_bytes": total, "stored_bytes": stored,
            "mb_per_s": round(total / 1e6 / seconds, 1) if seconds else None, "peak_rss_mb": merge_bench.peak_rss_mb()}  # fmt: skip


def child_pack(path: str, level: int, threshold: int) -> dict:
    import dagsync
    from dagsync.blobs import pack
    from dagsync.db import open_target

    try:
        from dagsync.vacuum import vacuum
    except ImportError:  # a --baseline checkout from before vacuum.py
        from dagsync.db import vacuum

    before = os.path.getsize(path)
    shares_before = dbstat(path)
    started = time.perf_counter()
    report = pack(path, dictionary=True, level=level, threshold=threshold)
    seconds = time.perf_counter() - started
    started = time.perf_counter()
    db = open_target(path)
    try:
        try:  # as `pack --vacuum` does it, on pack's own connection
            from dagsync.blobs import PACK_CACHE_KIB

            db.conn.execute(f"PRAGMA cache_size = -{PACK_CACHE_KIB}")
        except ImportError:  # a --baseline checkout from before
            pass
        vacuumed = vacuum(db)
    finally:
        db.close()
    return {
        "seconds": round(seconds, 3), "vacuum_seconds": round(time.perf_counter() - started, 3),
        "payload_bytes": report.payload_bytes, "distinct_payloads": report.distinct_payloads,
        "distinct_bytes": report.distinct_bytes, "stored_bytes": report.stored_bytes,
        "dedup_ratio": report.dedup_ratio, "compression_ratio": report.compression_ratio,
        "file_before": before, "file_after": os.path.getsize(path), "vacuum_mode": vacuumed.mode,
        "mb_per_s": round(report.payload_bytes / 1e6 / seconds, 1) if seconds else None,
        "peak_rss_mb": merge_bench.peak_rss_mb(), "dagsync_path": str(Path(dagsync.__file__).parent),
        "dbstat_before": shares_before, "dbstat_after": dbstat(path),
        "dropped_indexes": list(getattr(report, "dropped_indexes", ())),
    }  # fmt: skip


def child_dictionary(path: str, level: int, threshold: int) -> dict:
    import zstandard

    from dagsync.blobs import DICT_SAMPLES, DICT_SIZE, SMALL

    # The sample pack --dict trains on: an even spread, at most DICT_SAMPLES.
    small = list(_payloads(path, threshold, below=SMALL))
    step = max(1, len(small) // DICT_SAMPLES)
    trained = zstandard.train_dictionary(DICT_SIZE, small[::step][:DICT_SAMPLES], level=level)
    plain = zstandard.ZstdCompressor(level=level, write_content_size=True)
    with_dict = zstandard.ZstdCompressor(level=level, dict_data=trained, write_content_size=True)
    plain_bytes = sum(len(plain.compress(p)) for p in small)
    dict_bytes = sum(len(with_dict.compress(p)) for p in small)
    return {"payloads": len(small), "payload_bytes": sum(map(len, small)), "plain_bytes": plain_bytes,
            "dict_bytes": dict_bytes, "gain": round(plain_bytes / dict_bytes, 2) if dict_bytes else None,
            "peak_rss_mb": merge_bench.peak_rss_mb()}  # fmt: skip


def child_sqlite(path: str, level: int, threshold: int, distinct: int = 0, stored_bytes: int = 0) -> dict:
    """SQLite's own share of pack, as a lower bound: in one transaction, a blob
    row per distinct payload (random key, the stored size pack measured) and
    every packed value rewritten to a marker of the real length. No hashing,
    no compression, no short transactions."""
    import apsw

    from dagsync.db import open_source

    with open_source(path, quick_check=False) as db:
        packed, fmt = db.format.packed, db.format
    conn = apsw.Connection(path)
    try:  # as pack does (dagsync.fts): no full-text index left to index the markers
        from dagsync import fts

        with conn:
            for name in fts.over_packed(fmt, list(packed)):
                fts.drop(conn, fmt, name)
    except ImportError:  # a --baseline checkout from before fts.py
        pass
    size = stored_bytes // max(distinct, 1)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS blobs_floor (hash TEXT PRIMARY KEY, size INTEGER NOT NULL, dict INTEGER, data BLOB NOT NULL)"
    )
    started = time.perf_counter()
    conn.execute("BEGIN")
    left = distinct
    for column in packed:
        value = f'"{column.column}"'
        where = f"typeof({value}) = '{column.holds}' AND length(CAST({value} AS BLOB)) >= {int(threshold)}"
        try:
            conn.execute(
                f"INSERT INTO blobs_floor SELECT lower(hex(randomblob(32))), length(CAST({value} AS BLOB)), NULL, "
                f'zeroblob({size}) FROM "{column.table}" WHERE {where} LIMIT {left}'
            )
            left -= conn.changes()
            # References as pack writes them (dagsync/packed.py): in a column of text
            # a 40-byte BLOB, in a column of bytes 72 characters of TEXT.
            marker = (
                "unhex('64616773796e633a' || hex(randomblob(32)))" if column.holds == "text"
                else "'dagsync:' || lower(hex(randomblob(32)))"
            )  # fmt: skip
            conn.execute(f'UPDATE "{column.table}" SET {value} = {marker} WHERE {where}')
        except apsw.SQLError:
            continue  # a table this file does not have
    conn.execute("COMMIT")
    seconds = time.perf_counter() - started
    conn.close()
    return {"seconds": round(seconds, 3), "peak_rss_mb": merge_bench.peak_rss_mb()}


CHILDREN = {"raw": child_raw, "pack": child_pack, "dictionary": child_dictionary, "sqlite": child_sqlite}


def run_child(kind: str, path: Path, level: int, threshold: int, *extra: int, root: Path = ROOT) -> dict:
    args = [kind, str(path), str(level), str(threshold), *map(str, extra)]
    return merge_bench.run_script_child(__file__, args, kind, root)


def compare(args: argparse.Namespace, source: Path, copy: Path) -> dict:
    """``--baseline``: rounds of raw zstandard and of pack on a fresh copy with this
    checkout's dagsync and with the baseline's, in alternating order; the
    throughput ratio (pack MB/s over raw MB/s) is taken within each round."""
    import statistics

    rounds = []
    for n in range(1, args.repeat + 1):
        raw = run_child("raw", source, args.level, args.threshold)
        measured = {"raw_seconds": raw["seconds"], "raw_mb_per_s": raw["mb_per_s"]}
        for which, root in merge_bench.trees(args.baseline, n):
            which = which.strip() or "this"
            merge_bench.fresh_copy(source, copy)
            p = run_child("pack", copy, args.level, args.threshold, root=root)
            measured[which] = {k: p[k] for k in ("seconds", "mb_per_s", "file_after", "peak_rss_mb")}
            measured[which]["ratio"] = round(p["mb_per_s"] / raw["mb_per_s"], 3)
            merge_bench.log(f"[round {n}] {which}: pack {p['seconds']}s, {p['mb_per_s']} MB/s = {measured[which]['ratio']}x raw")
        rounds.append(measured)
    return {
        "rounds": rounds,
        "baseline_dagsync": merge_bench.dagsync_version(args.baseline),
        **{f"{w}_throughput_ratio": round(statistics.median(r[w]["ratio"] for r in rounds), 2) for w in ("this", "baseline")},
        **{f"{w}_pack_seconds": round(statistics.median(r[w]["seconds"] for r in rounds), 2) for w in ("this", "baseline")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["dag", "llm"], default="dag")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--threshold", type=int, default=192)  # blobs.DEFAULT_THRESHOLD
    parser.add_argument("--thresholds", default=None, help="Comma-separated: file size after pack + vacuum for each.")
    parser.add_argument("--data", type=Path, default=ROOT / "bench-data")
    parser.add_argument("--json", action="store_true")
    merge_bench.add_baseline_arguments(parser, "instead of the full run: rounds of raw zstandard and pack")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # KIND PATH LEVEL THRESHOLD [N...]
    args = parser.parse_args(argv)
    if args.child:
        kind, path, level, threshold, *extra = args.child
        print(json.dumps(CHILDREN[kind](path, int(level), int(threshold), *map(int, extra))))
        return 0

    merge_bench.FORMAT = args.format
    conversations = args.conversations or (merge_bench.QUICK_CONVERSATIONS if args.quick else merge_bench.DEFAULT_CONVERSATIONS)
    source, _, meta = merge_bench.ensure_family(args.data, conversations, args.seed)
    work = args.data / "work"
    work.mkdir(parents=True, exist_ok=True)
    copy = work / f"pack-{args.format}-n{conversations}.db"
    merge_bench.warm(source)
    rows = sum(merge_bench.table_rows(source).values())
    results: dict = {"format": args.format, "conversations": conversations, "rows": rows, "level": args.level}

    if args.baseline:
        args.baseline = args.baseline.resolve()
        c = compare(args, source, copy)
        copy.unlink(missing_ok=True)
        if args.json:
            print(json.dumps(c, indent=2))
            return 0
        print(f"pack against the baseline {c['baseline_dagsync']}, {args.format} format, {rows:,} rows, {args.repeat} rounds:")
        for w in ("this", "baseline"):
            print(f"  {w}: pack {c[w + '_pack_seconds']}s, throughput {c[w + '_throughput_ratio']}x raw zstandard (median)")
        return 0
    if args.thresholds:
        sizes = {}
        for threshold in (int(t) for t in args.thresholds.split(",")):
            merge_bench.fresh_copy(source, copy)
            r = run_child("pack", copy, args.level, threshold)
            sizes[threshold] = {"file_after": r["file_after"], "fraction": round(r["file_after"] / r["file_before"], 4),
                                "seconds": r["seconds"]}  # fmt: skip
            merge_bench.log(f"threshold {threshold}: {sizes[threshold]}")
        results["thresholds"] = sizes
    else:
        results["threshold"] = args.threshold
        results["raw"] = run_child("raw", source, args.level, args.threshold)
        merge_bench.log(f"raw zstandard: {results['raw']}")
        merge_bench.fresh_copy(source, copy)
        results["pack"] = run_child("pack", copy, args.level, args.threshold)
        merge_bench.log(f"pack: {results['pack']}")
        results["dictionary"] = run_child("dictionary", source, args.level, args.threshold)
        merge_bench.log(f"dictionary: {results['dictionary']}")
        p, raw, d = results["pack"], results["raw"], results["dictionary"]
        merge_bench.fresh_copy(source, copy)
        results["sqlite"] = run_child(
            "sqlite", copy, args.level, args.threshold, p["distinct_payloads"], p["stored_bytes"]
        )
        merge_bench.log(f"SQLite's share alone: {results['sqlite']}")
        results["size_fraction"] = round(p["file_after"] / p["file_before"], 4)
        # What a packed payload costs all in (frames, keys, index, references):
        # the file after, less what it holds besides the payloads, over their bytes.
        results["cost_all_in"] = round((p["file_after"] - (p["file_before"] - p["payload_bytes"])) / p["payload_bytes"], 3)
        # The same without the full-text indexes pack dropped (what their pages gave back).
        dropped = sum(p["dbstat_before"].get(n, 0) for n in p.get("dropped_indexes", ()))
        results["cost_all_in_index_kept"] = round(
            (p["file_after"] + dropped - (p["file_before"] - p["payload_bytes"])) / p["payload_bytes"], 3
        )
        results["throughput_ratio"] = round(p["mb_per_s"] / raw["mb_per_s"], 2) if raw["mb_per_s"] else None
        # The best any pack could do here if hashing and compressing cost nothing
        # and it wrote in one transaction.
        results["throughput_ratio_bound"] = round(raw["seconds"] / results["sqlite"]["seconds"], 2)
    copy.unlink(missing_ok=True)
    if args.json:
        print(json.dumps(results, indent=2))
    elif "thresholds" not in results:
        p, raw, d = results["pack"], results["raw"], results["dictionary"]
        print(f"pack benchmark, {args.format} format, {rows:,} rows, zstd level {args.level}, threshold {args.threshold} B")
        print(f"  file after pack + vacuum: {p['file_after'] / 1e6:.1f} MB of {p['file_before'] / 1e6:.1f} MB "
              f"= {results['size_fraction']:.1%} (goal <= {GOAL_SIZE[args.format]:.0%})")  # fmt: skip
        print(f"  a packed payload costs all in {results['cost_all_in']} of its bytes (goal <= {GOAL_COST}); "
              f"{results['cost_all_in_index_kept']} counting the full-text index pack dropped "
              f"({', '.join(p.get('dropped_indexes', ())) or 'none'})")  # fmt: skip
        total = sum(p["dbstat_after"].values())
        print("  dbstat after: " + ", ".join(f"{t} {b / total:.1%}" for t, b in list(p["dbstat_after"].items())[:10]))
        print(f"  dictionary on {d['payloads']:,} payloads under 1 KiB: {d['plain_bytes'] / 1e6:.2f} MB plain, "
              f"{d['dict_bytes'] / 1e6:.2f} MB with it = {d['gain']}x smaller (goal >= {GOAL_DICT}x)")  # fmt: skip
        print(f"  throughput: pack {p['mb_per_s']} MB/s, raw zstandard {raw['mb_per_s']} MB/s = "
              f"{results['throughput_ratio']}x (goal >= {GOAL_THROUGHPUT}x); pack {p['seconds']}s, vacuum {p['vacuum_seconds']}s ({p['vacuum_mode']})")  # fmt: skip
        print(f"  SQLite's share alone (blob rows + rewritten values, one transaction, nothing hashed or compressed): "
              f"{results['sqlite']['seconds']}s, so no pack can pass {results['throughput_ratio_bound']}x here")  # fmt: skip
        print(f"  payloads {p['payload_bytes'] / 1e6:.1f} MB, dedup {p['dedup_ratio']}x, compression {p['compression_ratio']}x")
        print(f"  peak RSS: pack {p['peak_rss_mb']} MB (goal <= {GOAL_RSS_MB})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
