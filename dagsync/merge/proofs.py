"""Rows proven by their own keys before a merge writes anything.

A source is untrusted: a row is copied only once what its key stands for is
checked, in the plan, so that a row that fails is named and nothing at all
is written. What is proven so far:

* **packed values.** A packed source's rows hold references to its blob
  store, and a packed target gets those blobs copied by key. Every blob a
  copied row refers to is read in bounded pieces and must hash to its key
  and have the size its row records (``packed.Blobs.problem``); a frame that
  claims more than that - a decompression bomb - is refused unread. A source
  that was packed and has lost its store is refused whole.

(Messages are re-hashed by ``dagsync verify``; proving every copied message
in the merge itself is issue 2/6's next step.)
"""

from __future__ import annotations

from dagsync.merge.core import SourceMerge
from dagsync.merge.references import is_new
from dagsync.packed import PREFIX, lost_store, lost_store_error, marker_sql, prove_referenced

__all__ = ["prove"]


def prove(run: SourceMerge) -> None:
    """:raises BlobError: naming the first blob a copied row refers to that fails its proof."""
    if not run.source_packed:
        if lost_store(run.conn, "src"):
            raise lost_store_error(str(run.source))
        return
    _prove_references(run)


def _prove_references(run: SourceMerge) -> None:
    c = run.conn
    c.execute("CREATE TEMP TABLE IF NOT EXISTS blob_refs (hash TEXT PRIMARY KEY) WITHOUT ROWID")
    reference = f"substr(CAST(s.\"{{column}}\" AS TEXT), {len(PREFIX) + 1})"
    for table in run.order:
        for packed in (p for p in run.fmt.packed if p.table == table.name):
            if not run.counts[table.name].added:
                continue
            for low, high in run.chunks(f'src."{table.name}"'):
                # The distinct blobs the rows to be copied refer to, each once.
                c.execute(
                    f"INSERT OR IGNORE INTO temp.blob_refs SELECT {reference.format(column=packed.column)} "
                    f'FROM src."{table.name}" s WHERE s.rowid BETWEEN ? AND ? AND {marker_sql(packed, "s")} '
                    f"AND {is_new(run, table)}",
                    (low, high),
                )
    prove_referenced(c, "src", "temp.blob_refs", lambda table: run.chunks(table))
