"""The text reports: each operation's report, as a person reads it.

Pure functions from a report to text; ``cli`` prints them (``--json`` prints
the report itself). Each shows what happened and leaves out what did not.
"""

from __future__ import annotations

from dagsync.blobs import PackReport
from dagsync.bundle import BundleReport
from dagsync.canonicalise import CanonicaliseReport
from dagsync.forget.report import ForgetReport, RestoreReport
from dagsync.gc import GcReport
from dagsync.merge import MergeReport
from dagsync.remote import RemoteSyncReport, TransferReport
from dagsync.stats import Stats
from dagsync.sync import SyncReport
from dagsync.unpack import UnpackReport
from dagsync.verify import VerifyReport

__all__ = [
    "canonicalise", "duration", "gc", "human_bytes", "merge", "pack", "stats", "sync", "unpack", "verify",
]  # fmt: skip


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def stats(s: Stats) -> str:
    """In the format's own words (threads and turns for llm's), with the tables
    that hold rows; --json lists every table."""
    held = {name: rows for name, rows in s.tables.items() if rows}
    empty = len(s.tables) - len(held)
    width = max((len(name) for name in held), default=0)
    lines = [
        f"{s.path}  ({s.format} format, {human_bytes(s.file_bytes)})",
        f"  {s.conversation_table:<14} {s.conversations:>12,}",
        f"  {s.call_table:<14} {s.calls:>12,}",
        f"  {'messages':<14} {s.messages:>12,}",
        f"  {'chain ends':<14} {s.chains:>12,}   (messages nothing continues)",
        f"  {'branch points':<14} {s.forks:>12,}   (messages continued in two or more ways)",
        "  rows per table" + (f" ({empty} empty not shown; --json lists every table):" if empty else ":"),
        *(f"    {name:<{width}}  {rows:>12,}" for name, rows in held.items()),
    ]
    if s.fork_rows:
        lines.append(f"  forks ({s.conversation_table} that fork another):")
        lines += [f"    {f.id}  {f.name!r}, from {f.forked_from}" for f in s.fork_rows]
    return "\n".join(lines)


# Why a source is read whole when that is only to be expected (merge.marks).
FIRST_MERGES = ("first merge of this source", "a new target")


def merge(report: MergeReport) -> str:
    n = len(report.sources)
    what = f"{n} source" if n == 1 else f"{n} sources"
    if report.created:
        verb = "would be created from" if report.dry_run else "created from"
        lines = [f"{report.target}: {verb} {what} in {report.seconds:.1f}s"]
    else:
        verb = "would merge" if report.dry_run else "merged"
        lines = [f"{report.target}: {verb} {what} in {report.seconds:.1f}s"]
    for source in report.sources:
        if source.incremental:
            how = " (only what lies beyond the target's marks of it)"
        elif source.full_because in FIRST_MERGES:
            how = ""
        else:
            how = f" (read whole: {source.full_because})"
        lines.append(f"  from {source.source}{how}:")
        if source.forgotten:
            lines.append(f"    kept out {source.forgotten:,} row(s) of conversations forgotten here (dagsync forget)")
        if not source.written:
            lines.append("    nothing new: the target already holds all of it")
            continue
        shown = [t for t in source.tables if t.added or t.mapped or t.updated or t.forked or t.moved]
        for t in shown:
            bits = [f"{t.added:,} added"]
            if t.mapped:
                bits.append(f"{t.mapped:,} mapped onto existing rows")
            if t.updated:
                bits.append(f"{t.updated:,} fast-forwarded")
            if t.forked:
                bits.append(f"{t.forked:,} forked (diverged)")
            if t.moved:
                bits.append(f"{t.moved:,} moved onto their branch's row")
            lines.append(f"    {t.table:<26} {', '.join(bits)}")
        for f in source.forks:
            lines.append(f"    fork {f.fork} of {f.original}: {f.name!r}, holding the {f.side}'s branch (tip {f.head[:12]})")
    return "\n".join(lines)


def canonicalise(r: CanonicaliseReport) -> str:
    verb = "would collapse" if r.dry_run else "collapsed"
    lines = [
        f"{r.path}: {verb} {r.collapsed:,} duplicate message(s) in {r.groups:,} group(s), "
        f"{r.levels} level(s) deep",
        f"  parts removed {r.parts_removed:,}; calls rewritten {r.calls_rewritten:,}; "
        f"conversations rewritten {r.conversations_rewritten:,}",
    ]
    if r.index_created:
        lines.append(f"  unique index on (parent_id, content_hash) {'would be ' if r.dry_run else ''}created")
    return "\n".join(lines)


def sync(r: SyncReport) -> str:
    text = "\n".join(merge(m) for m in (r.into_a, r.into_b, r.settle) if m)
    if r.into_a.dry_run:
        text += "\n  (a dry run: the forks the first merge would add to A are not in the second)"
    return text


def verify(r: VerifyReport) -> str:
    if r.ok:
        return f"{r.path}: ok ({r.format} format, {r.messages:,} messages; every check passed)"
    lines = [f"{r.path}: {sum(r.counts.values()):,} problem(s) ({r.format} format, {r.messages:,} messages)"]
    lines += [f"  {p}" for p in r.problems]
    more = sum(r.counts.values()) - len(r.problems)
    if more:
        lines.append(f"  ... and {more:,} more")
    return "\n".join(lines)


def gc(r: GcReport) -> str:
    verb = "would delete" if r.dry_run else "deleted"
    grace = duration(r.grace_seconds)
    lines = [
        f"{r.path}: {verb} {r.deleted:,} row(s), {human_bytes(r.deleted_bytes)} "
        f"({r.format} format, grace {grace}, {r.seconds:.1f}s)",
        f"  messages: {r.reachable:,} reachable from {r.roots:,} root(s), {r.unreachable:,} unreachable, "
        f"{r.kept_by_grace:,} of those kept by the grace period",
    ]
    for t in r.tables:
        if t.deleted or t.waiting:
            bits = [f"{t.deleted:,} {verb} ({human_bytes(t.bytes)})"] if t.deleted else []
            if t.waiting:
                bits.append(f"{t.waiting:,} waiting out the grace period")
            lines.append(f"    {t.table:<18} {', '.join(bits)}")
    if r.merge_in_progress:
        lines.append("  a merge into this file was under way: unreachable messages were left for the next run")
    if r.kept_as_new:
        lines.append(f"  kept {r.kept_as_new:,} message(s) that became reachable while gc ran")
    if r.vacuum:
        v = r.vacuum
        lines.append(f"  vacuum ({v.mode}): {human_bytes(v.bytes_before)} -> {human_bytes(v.bytes_after)}")
        if v.grew:
            lines.append(f"  {v.grew}")
    return "\n".join(lines)


def forget(r: ForgetReport) -> str:
    verb = "would forget" if r.dry_run else "forgot"
    lines = [
        f"{r.path}: {verb} {len(r.conversations):,} conversation(s), deleting {r.deleted:,} row(s), "
        f"{human_bytes(r.deleted_bytes)} ({r.format} format, {r.seconds:.1f}s)",
    ]
    shown = r.conversations[:20]
    for c in shown:
        lines.append(f"    {c.id}  {c.latest or 'undated':<20}  {(c.name or '')[:60]!r}")
    if len(r.conversations) > len(shown):
        lines.append(f"    ... and {len(r.conversations) - len(shown):,} more (--json lists them all)")
    lines.append(
        f"  messages: {r.messages:,} only they reached {'would go' if r.dry_run else 'deleted'}, "
        f"{r.shared_messages:,} kept: another thread, call or message uses them"
    )
    for t in r.tables:
        lines.append(f"    {t.table:<24} {t.deleted:,} ({human_bytes(t.bytes)})")
    lines.append(f"  {r.tombstones:,} conversation(s) kept forgotten in this file")
    if r.merge_in_progress or r.pending:
        lines.append(
            f"  a merge into this file was under way: {r.pending:,} unlinked row(s) are left for the next forget"
        )
    return "\n".join(lines)


def restore(r: RestoreReport) -> str:
    verb = "would stop" if r.dry_run else "stopped"
    lines = [f"{r.path}: {verb} keeping {len(r.restored):,} conversation(s) forgotten; {r.tombstones:,} still are"]
    lines += [f"    {key}" for key in r.restored]
    if r.restored and not r.dry_run:
        lines.append("  to bring them back: dagsync merge --full THIS_FILE A_FILE_THAT_STILL_HOLDS_THEM")
    return "\n".join(lines)


def duration(seconds: float) -> str:
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def pack(r: PackReport) -> str:
    verb = "would pack" if r.dry_run else "packed"
    lines = [
        f"{r.path}: {verb} {sum(c.packed for c in r.columns):,} payload(s), {human_bytes(r.payload_bytes)} "
        f"({r.format} format, zstd level {r.level}, threshold {r.threshold} B"
        + (f", dictionary {r.dictionary[:12]}" if r.dictionary else "")
        + f", {r.seconds:.1f}s)",
        f"  distinct payloads {r.distinct_payloads:,} ({human_bytes(r.distinct_bytes)}): dedup {r.dedup_ratio:.2f}x",
        f"  new blobs {r.new_blobs:,}, stored in {human_bytes(r.stored_bytes)}: compression {r.compression_ratio:.2f}x",
    ]
    shown = [c for c in r.columns if c.packed or c.inline]
    for c in shown:
        lines.append(f"    {c.table + '.' + c.column:<28} {c.packed:>10,} packed  {c.inline:>10,} left inline (short)")
    if len(shown) < len(r.columns):
        lines.append(f"    ({len(r.columns) - len(shown)} column(s) with no payloads not shown; --json lists every one)")
    if r.dropped_indexes:
        some = len(r.dropped_indexes) > 1
        lines.append(
            f"  {'would drop' if r.dry_run else 'dropped'} the full-text index{'es' if some else ''} "
            f"{', '.join(r.dropped_indexes)} (kept, {'they' if some else 'it'} would index blob references); "
            f"unpack makes {'them' if some else 'it'} again"
        )
    lines.append(f"  file {human_bytes(r.file_bytes_before)} -> {human_bytes(r.file_bytes_after)}")
    if r.vacuum:
        lines[-1] += f" (vacuum: {r.vacuum.mode})"
    if r.grew:
        lines.append(f"  {r.grew}")
    return "\n".join(lines)


def unpack(r: UnpackReport) -> str:
    verb = "would restore" if r.dry_run else "restored"
    tail = f" (vacuum: {r.vacuum.mode})" if r.vacuum else ""
    return (
        f"{r.path}: {verb} {r.values:,} payload(s), {human_bytes(r.payload_bytes)}, from {r.blobs_removed:,} blob(s) "
        f"({r.format} format, {r.seconds:.1f}s)\n  file {human_bytes(r.file_bytes_before)} -> "
        f"{human_bytes(r.file_bytes_after)}{tail}"
        + (f"\n  {'would make' if r.dry_run else 'made'} the full-text "
           f"index{'es' if len(r.rebuilt_indexes) > 1 else ''} {', '.join(r.rebuilt_indexes)} again"
           if r.rebuilt_indexes else "")
    )  # fmt: skip


def marks(doc: dict) -> str:
    if not doc.get("exists", True):
        return f"{doc['target']}: no such database yet (a push creates it)"
    if not doc["sources"]:
        return f"{doc['target']}: no marks yet (no source merged since dagsync began keeping them)"
    lines = [f"{doc['target']}: marks of {len(doc['sources'])} source(s)"]
    for entry in doc["sources"]:
        held = entry["marks"]
        messages = held.get("messages", [0])[0]
        calls = max((held.get(t, [0])[0] for t in ("turns", "calls")), default=0)
        lines.append(
            f"  {entry['label']:<16} {entry['path']}  merged {entry['merged_at']}  "
            f"(messages to row {messages:,}, calls to row {calls:,})"
        )
    return "\n".join(lines)


def bundle(r: BundleReport) -> str:
    against = f"beyond the marks {r.against} left" if r.against else f"the whole source ({r.why_whole})"
    lines = [f"{r.bundle}: {r.total_rows:,} rows of {r.source}, {r.bytes:,} bytes: {against}"]
    lines += [f"  {t:<26} {n:,}" for t, n in r.rows.items() if n]
    return "\n".join(lines)


def transfer(r: TransferReport) -> str:
    rows = sum(r.rows.values())
    verb = ("would push" if r.dry_run else "pushed") if r.direction == "push" else ("would pull" if r.dry_run else "pulled")
    sent = f"{r.sent_bytes:,} bytes {'to send' if r.dry_run else 'sent'}, {r.bundle_bytes:,} uncompressed"
    what = f"{verb} {rows:,} rows in {r.seconds:.1f}s ({sent})" if rows else f"nothing new to {r.direction} ({sent})"
    lines = [f"{r.source} -> {r.target}: {what}"]
    if r.against is None:
        lines.append(f"  the whole source: {r.why_whole}")
    if r.all_pointers:
        lines.append("  sent again with every pointer row: the first bundle left out one its source moved in place")
    lines += [f"    {t:<26} {n:,}" for t, n in r.rows.items() if n]
    if r.merged is not None and not r.dry_run and rows:
        where = "there" if r.direction == "push" else "here"
        lines.append(f"  merged {where}: {r.written:,} rows written")
    return "\n".join(lines)


def remote_sync(r: RemoteSyncReport) -> str:
    return "\n".join(transfer(t) for t in (r.pulled, r.pushed, r.settle) if t)
