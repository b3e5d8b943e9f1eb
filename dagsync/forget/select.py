"""Which conversations a ``forget`` names: selectors, combined with AND.

A conversation is known by the id llm shows (``llm logs list``'s
``conversation_id``): a thread's, in the llm format, and any legacy
conversation of the same id; a conversation's, in the dag format. The
tables, times, models and full-text indexes each selector reads are data
in the format (``Format.conversations``).

Each selector is read in one pass per table into a temp table (a table's
column that names the conversation need not be indexed), then the sets are
intersected into ``temp.fg_sel``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import apsw

from dagsync.errors import DagsyncError
from dagsync.formats import Format

__all__ = ["Selector", "add_merge_forks", "create_selection", "latest", "parse_date", "select"]


@dataclass(frozen=True)
class Selector:
    """What to forget: every field given must hold (AND); an empty selector names nothing."""

    ids: tuple[str, ...] = ()
    # Unix time: conversations whose latest activity is before it. One with
    # no time at all (nothing dated) is never selected by age.
    before: float | None = None
    models: tuple[str, ...] = ()
    # Full-text queries (SQLite FTS5 syntax, as `llm logs -q`), each of which must match.
    queries: tuple[str, ...] = ()
    # How the selector was written, for the report.
    written: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def empty(self) -> bool:
        return not (self.ids or self.before is not None or self.models or self.queries)


def parse_date(text: str) -> float:
    """Unix time of ``2026-01-31`` (midnight UTC) or an ISO 8601 time (UTC unless it says otherwise).

    :raises DagsyncError: anything else.
    """
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise DagsyncError(
            f"invalid date {text!r}: give a day (2026-01-31) or a time (2026-01-31T12:00:00), in UTC"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def select(conn: apsw.Connection, fmt: Format, selector: Selector, present: set[str]) -> int:
    """Fill ``temp.fg_sel (key)`` with the ids of the conversations ``selector`` names; return how many.

    :raises DagsyncError: a query the file cannot answer (no full-text index,
        a packed file, FTS5 syntax).
    """
    spec = fmt.conversations
    assert spec is not None
    create_selection(conn)
    tables = [t for t in spec.tables if t in present]
    everything = " UNION ".join(f'SELECT "id" AS key FROM main."{t}"' for t in tables)
    conditions: list[str] = []
    params: list[object] = []
    if selector.ids:
        conditions.append(f"k.key IN ({', '.join('?' * len(selector.ids))})")
        params += selector.ids
    if selector.before is not None:
        latest(conn, spec.times, present)
        conditions.append("k.key IN (SELECT key FROM temp.fg_latest WHERE latest < ?)")
        params.append(selector.before)
    if selector.models:
        _models(conn, spec.models, present, selector.models)
        conditions.append("k.key IN (SELECT key FROM temp.fg_model)")
    for n, query in enumerate(selector.queries):
        _search(conn, fmt, present, query, n)
        conditions.append(f"k.key IN (SELECT key FROM temp.fg_found_{n})")
    if not tables or not conditions:
        return 0
    conn.execute(
        f"INSERT INTO temp.fg_sel (key) SELECT DISTINCT k.key FROM ({everything}) k "
        f"WHERE k.key IS NOT NULL AND {' AND '.join(conditions)}",
        params,
    )
    add_merge_forks(conn, fmt, present, "SELECT key FROM temp.fg_sel")
    return next(conn.execute("SELECT count(*) FROM temp.fg_sel"))[0]


def create_selection(conn: apsw.Connection) -> None:
    """``temp.fg_sel``: the conversations to forget; ``fork`` is 1 for a fork a merge
    made of one (``add_merge_forks``), which goes with it but gets no tombstone of its own."""
    conn.execute("DROP TABLE IF EXISTS temp.fg_sel")
    conn.execute("CREATE TEMP TABLE fg_sel (key TEXT PRIMARY KEY, fork INTEGER NOT NULL DEFAULT 0)")


def add_merge_forks(conn: apsw.Connection, fmt: Format, present: set[str], seed: str) -> None:
    """Add to ``temp.fg_sel`` every fork row a merge made of a conversation ``seed``
    (SQL selecting ids) names, and the forks of those forks.

    When two files continued one conversation differently, a merge keeps one
    branch in the conversation's row and gives the other a fork row
    (``_dagsync_forks``: the other machine's branch of the same conversation).
    It goes with the conversation: else forgetting it would keep that branch
    or not depending on whether a merge saw both branches before the forget
    reached it. A fork made with llm is a conversation of its own and stays.
    """
    spec = fmt.conversations
    assert spec is not None
    if "_dagsync_forks" not in present:
        return
    tables = [t for t in spec.tables if t in present]
    marks = ", ".join("?" * len(tables))
    if not tables:
        return
    conn.execute("DROP TABLE IF EXISTS temp.fg_fam")
    # UNION, not UNION ALL: a cycle a hand-made file might hold ends.
    conn.execute(
        "CREATE TEMP TABLE fg_fam AS WITH RECURSIVE fam(key) AS "
        f"(SELECT f.fork_key FROM main._dagsync_forks f WHERE f.pointer_table IN ({marks}) AND f.key IN ({seed}) "
        f"UNION SELECT f.fork_key FROM main._dagsync_forks f JOIN fam ON f.key = fam.key WHERE f.pointer_table IN ({marks})) "
        "SELECT key FROM fam",
        (*tables, *tables),
    )
    for table in tables:
        conn.execute(
            f'INSERT OR IGNORE INTO temp.fg_sel (key, fork) SELECT c."id", 1 FROM main."{table}" c '
            'WHERE c."id" IN (SELECT key FROM temp.fg_fam)'
        )
    conn.execute("DROP TABLE temp.fg_fam")


def latest(
    conn: apsw.Connection,
    times: tuple[tuple[str, str, str], ...],
    present: set[str],
    name: str = "fg_latest",
    within: str | None = None,
) -> None:
    """``temp.<name>``: each conversation's latest time (unix), one pass per table (the
    conversation columns need no index); only those in table ``within``, if given."""
    conn.execute(f"DROP TABLE IF EXISTS temp.{name}")
    conn.execute(f"CREATE TEMP TABLE {name} (key TEXT PRIMARY KEY, latest REAL NOT NULL)")
    for table, conversation, column in times:
        if table not in present:
            continue
        only = f' AND "{conversation}" IN (SELECT key FROM {within})' if within else ""
        # unixepoch() reads every spelling llm writes; a time it cannot read is left out.
        conn.execute(
            f'INSERT INTO temp.{name} SELECT "{conversation}", max(unixepoch("{column}", \'subsec\')) '
            f'FROM main."{table}" WHERE "{conversation}" IS NOT NULL AND unixepoch("{column}", \'subsec\') IS NOT NULL{only} '
            f'GROUP BY "{conversation}" '
            "ON CONFLICT (key) DO UPDATE SET latest = max(latest, excluded.latest)"
        )


def _models(
    conn: apsw.Connection, models: tuple[tuple[str, str, str], ...], present: set[str], wanted: tuple[str, ...]
) -> None:
    """``temp.fg_model``: conversations any row of which names one of the ``wanted`` models."""
    conn.execute("DROP TABLE IF EXISTS temp.fg_model")
    conn.execute("CREATE TEMP TABLE fg_model (key TEXT PRIMARY KEY)")
    marks = ", ".join("?" * len(wanted))
    for table, conversation, column in models:
        if table in present:
            conn.execute(
                f'INSERT OR IGNORE INTO temp.fg_model SELECT "{conversation}" FROM main."{table}" '
                f'WHERE "{column}" IN ({marks}) AND "{conversation}" IS NOT NULL',
                wanted,
            )


def _search(conn: apsw.Connection, fmt: Format, present: set[str], query: str, n: int) -> None:
    """``temp.fg_found_<n>``: conversations a full-text index finds ``query`` in."""
    assert fmt.conversations is not None
    conn.execute(f"DROP TABLE IF EXISTS temp.fg_found_{n}")
    conn.execute(f"CREATE TEMP TABLE fg_found_{n} (key TEXT PRIMARY KEY)")
    indexes = [(fts, content, expr) for fts, content, expr in fmt.conversations.search if fts in present]
    if not indexes:
        from dagsync import packed

        if packed.is_packed(conn):
            raise DagsyncError(
                f"{conn.db_filename('main')} is packed, and pack set its full-text indexes aside: "
                "run `dagsync unpack` on it first to search it with -q/--query"
            )
        raise DagsyncError(
            f"{conn.db_filename('main')} has no full-text index to search with -q/--query "
            f"({' or '.join(f for f, _, _ in fmt.conversations.search)}); select by --id, --model or age instead"
        )
    for fts, content, expr in indexes:
        try:
            conn.execute(
                f'INSERT OR IGNORE INTO temp.fg_found_{n} SELECT {expr} FROM main."{content}" c '
                f'WHERE c.rowid IN (SELECT rowid FROM main."{fts}" WHERE "{fts}" MATCH ?) AND {expr} IS NOT NULL',
                (query,),
            )
        except apsw.SQLError as exc:
            raise DagsyncError(
                f"invalid search {query!r} ({exc}): -q/--query takes SQLite full-text syntax, as `llm logs -q` "
                'does; put a phrase in double quotes: -q \'"exact words"\''
            ) from None
