"""The two file formats dagsync reads, described as data.

A ``Format`` names its tables, how each one is keyed, which columns hold the
message DAG, and the DDL a new file of that format gets. Operations (stats,
merge, gc, verify) are written once against these descriptions; a format
module never imports an operation.

Columns are not listed by hand: they are read from the format's own DDL
(``*_schema.sql`` beside this file, copied from ``shared/spec``), so the
description and the schema cannot drift apart.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources

import apsw

__all__ = [
    "Collect", "Conversations", "Format", "JsonRef", "Key", "KeyProof", "PackedColumn", "PayloadRef", "Table",
    "normalise_sql",
]  # fmt: skip


class Key(enum.Enum):
    """How a table's rows are identified, which decides how it merges."""

    TEXT = "text"  # immutable text key (ULID, content hash): copy rows whose key is new
    INTEGER = "integer"  # surrogate integer id: never copied, matched by natural key or renumbered
    COMPOSITE = "composite"  # link rows keyed by the keys of the rows they join
    DAG_MESSAGE = "dag-message"  # ULID id, identity (parent_id, content_hash)
    HASH_MESSAGE = "hash-message"  # Merkle hash key: the key is the identity
    DERIVED = "derived"  # FTS index kept by triggers: rebuilt, never copied


class Collect(enum.Enum):
    """What gc does with a table's rows."""

    KEEP = "keep"  # never deleted by gc
    UNREACHABLE = "unreachable"  # the message DAG: deleted when no root reaches a row
    WITH_OWNER = "with-owner"  # deleted together with the row ``owned_by`` points at
    UNREFERENCED = "unreferenced"  # shared rows: deleted when nothing references them


@dataclass(frozen=True)
class PayloadRef:
    """Keys of ``target`` held inside a JSON column, at the paths ``path`` matches.

    ``path`` is a JSON path in which ``[#]`` stands for any array index, so
    ``$.text_ref[#].fragment`` matches ``$.text_ref[0].fragment``, ``$.text_ref[1].fragment`` ...
    """

    table: str
    column: str
    path: str
    target: str

    @property
    def glob(self) -> str:
        """``path`` as a GLOB pattern over ``json_tree``'s ``fullkey``."""
        return self.path.replace("[#]", "[[][0-9]*[]]")


@dataclass(frozen=True)
class PackedColumn:
    """A payload column ``pack`` may move into the blob store.

    ``holds`` is the storage class llm writes there ("text" or "blob"); a
    packed value is stored with the other one (see dagsync/packed.py).
    """

    table: str
    column: str
    holds: str = "text"


@dataclass(frozen=True)
class KeyProof:
    """A table keyed by a hash of its own content: ``recipe`` (a name in
    ``merkle.KEY_RECIPES``) of ``columns`` gives ``key``, or None where the
    file does not hold what the key was made from."""

    table: str
    key: str
    recipe: str
    columns: tuple[str, ...]


@dataclass(frozen=True)
class Conversations:
    """What ``forget`` selects and deletes: conversations, by the id llm shows.

    ``tables`` hold one row per conversation under that id (a thread, and the
    legacy conversation of the same id); everything that hangs off them by
    foreign key goes with them (``Format.cascade``). The selectors read:

    * ``times``: (table, column naming the conversation, time column); a
      conversation's age is its latest time;
    * ``models``: (table, column naming the conversation, model column);
    * ``search``: (full-text index, its content table, SQL over the content
      row ``c`` that gives the conversation's id).
    """

    tables: tuple[str, ...]
    times: tuple[tuple[str, str, str], ...]
    models: tuple[tuple[str, str, str], ...]
    search: tuple[tuple[str, str, str], ...]


@dataclass(frozen=True)
class JsonRef:
    """Integer ids of ``table`` inside JSON text: ``{list_key: [{id_key: N}, ...]}``."""

    column: str
    table: str
    list_key: str
    id_key: str

    def ids(self, text: str) -> list[int]:
        data = json.loads(text)
        pieces = data.get(self.list_key) if isinstance(data, dict) else None
        return [p[self.id_key] for p in pieces or () if isinstance(p, dict) and self.id_key in p]

    def rewrite(self, text: str, new_id: Callable[[int], int]) -> str:
        """The same JSON with each id replaced by ``new_id(id)``; nothing else changes.

        Text written by ``json.dumps`` (as llm writes it) dumps back to the same
        bytes, so only the ids differ.
        """
        data = json.loads(text)
        pieces = data.get(self.list_key) if isinstance(data, dict) else None
        if not pieces:
            return text
        for piece in pieces:
            if isinstance(piece, dict) and self.id_key in piece:
                piece[self.id_key] = new_id(piece[self.id_key])
        return json.dumps(data)


@dataclass(frozen=True)
class Table:
    name: str
    key: Key
    # Columns whose values, taken together, identify the row across files.
    natural_key: tuple[str, ...] = ()
    # A source of the format must have this table; optional tables are read
    # when present and treated as empty when absent.
    required: bool = False
    # A mutable pointer into the message DAG (a conversation head, a thread tip).
    pointer: str | None = None
    # (column, table): rows are copied only together with the row they belong
    # to, and only when that row is new (a message's parts).
    owner: tuple[str, str] | None = None
    # Columns compared when a key is on both sides; None means every column
    # but the key and the pointer. () means rows with the same key never conflict.
    compare: tuple[str, ...] | None = None
    # Integer ids of another table held inside a JSON column.
    json_refs: tuple[JsonRef, ...] = ()
    # What gc does with the rows; for WITH_OWNER, the column naming the owner.
    collect: Collect = Collect.KEEP
    owned_by: str | None = None


@dataclass(frozen=True)
class Format:
    name: str
    # The columns of ``messages`` that identify the format.
    marker_columns: frozenset[str]
    schema_resource: str
    tables: tuple[Table, ...]
    # The message DAG: table, key column, parent column. A chain ends at a
    # parent equal to ``root_parent`` (the dag sentinel) or NULL (llm).
    message_key: str
    parent_column: str
    root_id: str | None
    conversation_table: str
    call_table: str
    part_table: str
    # Migration names a new file of this format records in _llm_migrations.
    migrations: tuple[str, ...] = field(default=())
    # Refuse a source that has had a migration the target has not (its
    # schema may hold what the target's cannot), comparing migrations by
    # "name", or by "number" (m001...) where only the numbers are known for sure.
    migration_gate: str | None = None
    # The column that says when a message was stored, for gc's grace period;
    # None when messages carry no time (gc then records when it first saw them).
    message_time: str | None = None
    # Keys held inside JSON columns, which gc counts as references.
    payload_refs: tuple[PayloadRef, ...] = ()
    # Payload columns the blob store may hold.
    packed: tuple[PackedColumn, ...] = ()
    # Tables (besides messages) whose key a merge re-computes for every row it copies.
    proven: tuple[KeyProof, ...] = ()
    # Branches (merge.branches): when a conversation's pointer diverged, the
    # branch whose tip is newest keeps the conversation, by ``branch_time``
    # (table, tip column, time column, and the column naming the
    # conversation, if the rows have one: the latest time of the rows at
    # that tip); and each call follows the branch whose chain holds its
    # ``call_tip``, through its ``call_conversation`` column.
    branch_time: tuple[str, str, str, str | None] | None = None
    call_conversation: str | None = None
    call_tip: str | None = None
    # What a message's key is a hash of, compared where both files hold the
    # message (merge.shared): columns of its row, and of each of its parts,
    # a part matched by its message and ``part_order``.
    message_content: tuple[str, ...] = ()
    part_content: tuple[str, ...] = ()
    part_order: str = "order"
    # What ``forget`` selects and deletes.
    conversations: Conversations | None = None

    @cached_property
    def schema_sql(self) -> str:
        return resources.files(__package__).joinpath(self.schema_resource).read_text()

    @cached_property
    def _schema(self) -> apsw.Connection:
        """The format's DDL made in an in-memory database: what its tables,
        triggers and keys are is read from there, once."""
        conn = apsw.Connection(":memory:")
        conn.execute(self.schema_sql)
        return conn

    @cached_property
    def columns(self) -> dict[str, tuple[str, ...]]:
        """Every table and view of the schema mapped to its column names, in order."""
        names = [
            name
            for (name,) in self._schema.execute(
                "SELECT name FROM sqlite_schema WHERE type IN ('table', 'view') ORDER BY name"
            )
        ]
        return {
            name: tuple(row[1] for row in self._schema.execute("SELECT * FROM pragma_table_info(?)", (name,)))
            for name in names
        }

    @cached_property
    def triggers(self) -> dict[str, tuple[str, str]]:
        """Trigger name -> (its table, its SQL normalised) as the format's DDL creates them."""
        return {
            name: (tbl, normalise_sql(sql))
            for name, tbl, sql in self._schema.execute("SELECT name, tbl_name, sql FROM sqlite_schema WHERE type = 'trigger'")
        }

    def object_sql(self, name: str) -> str:
        """The statement the format's DDL makes table, index or trigger ``name`` with (as SQLite keeps it)."""
        for (sql,) in self._schema.execute("SELECT sql FROM sqlite_schema WHERE name = ?", (name,)):
            return sql
        raise KeyError(name)

    def triggers_on(self, table: str) -> list[str]:
        """The names of the triggers the format's DDL puts on ``table``, in its order."""
        return [name for name, (tbl, _) in self.triggers.items() if tbl == table]

    @cached_property
    def foreign_keys(self) -> dict[str, dict[str, tuple[str, str]]]:
        """Table -> {column: (referenced table, referenced column)}, from the DDL's foreign keys."""
        return {
            t.name: {
                row[3]: (row[2], row[4] or self.primary_key(row[2]))
                for row in self._schema.execute("SELECT * FROM pragma_foreign_key_list(?)", (t.name,))
            }
            for t in self.tables
            if t.key is not Key.DERIVED
        }

    @cached_property
    def references(self) -> dict[str, dict[str, str]]:
        """Table -> {column: referenced table}."""
        return {t: {c: ref for c, (ref, _) in cols.items()} for t, cols in self.foreign_keys.items()}

    @cached_property
    def referenced_columns(self) -> dict[str, dict[str, str]]:
        """Table -> {column: the referenced table's column it holds}."""
        return {t: {c: col for c, (_, col) in cols.items()} for t, cols in self.foreign_keys.items()}

    def primary_key(self, table: str) -> str:
        """The single primary-key column of ``table`` (rowid when it has none or several)."""
        pk = [row[1] for row in self._schema.execute("SELECT * FROM pragma_table_info(?) WHERE pk > 0", (table,))]
        return pk[0] if len(pk) == 1 else "rowid"

    @cached_property
    def roots(self) -> tuple[tuple[str, str], ...]:
        """(table, column) pairs whose values gc treats as roots of the message DAG.

        Every column that references a message is one, except the DAG's own
        parent links and the columns of rows collected with their message:
        whatever else points at a message keeps it, so a table added to a
        format's DDL is protected without anyone remembering to list it.
        """
        collected = {t.name for t in self.tables if t.collect in (Collect.UNREACHABLE, Collect.WITH_OWNER)}
        return tuple(
            (table, column)
            for table, refs in self.references.items()
            if table not in collected
            for column, referenced in refs.items()
            if referenced == "messages"
        )

    @cached_property
    def cascade(self) -> tuple[tuple[str, str, str, str], ...]:
        """(table, column, parent table, parent column): the rows that go when
        a conversation is forgotten, each with the foreign key that ties it to a
        row that goes, parents before children.

        Read from the DDL's foreign keys, from ``conversations.tables`` down
        through the tables gc keeps (turns, calls, responses, their link and
        search rows); never into the message DAG or shared rows, which go
        only when nothing else reaches them. A row's reference to another of
        its own table (a fork's ``forked_from``) is not followed.
        """
        assert self.conversations is not None
        kept = {t.name for t in self.tables if t.collect is Collect.KEEP and t.key is not Key.DERIVED}
        reached = list(self.conversations.tables)
        edges: list[tuple[str, str, str, str]] = []
        for parent in reached:
            for table, refs in self.foreign_keys.items():
                for column, (ref, ref_column) in refs.items():
                    if ref == parent and table != parent and table in kept and table not in self.conversations.tables:
                        edges.append((table, column, parent, ref_column))
                        if table not in reached:
                            reached.append(table)
        return tuple(edges)

    def referrers(self, table: str) -> tuple[tuple[str, str], ...]:
        """(table, column) pairs whose foreign keys reference ``table``."""
        return tuple(
            (other, column)
            for other, refs in self.references.items()
            for column, referenced in refs.items()
            if referenced == table
        )

    @cached_property
    def merge_order(self) -> tuple[Table, ...]:
        """Tables in an order where every table comes after the ones it references,
        so that inserting in this order never leaves a reference dangling."""
        done: list[Table] = []
        pending = [t for t in self.tables if t.key is not Key.DERIVED]
        while pending:
            ready = [
                t for t in pending
                if all(ref == t.name or ref in {d.name for d in done} for ref in self.references[t.name].values())
            ]  # fmt: skip
            if not ready:
                raise ValueError(f"reference cycle among {[t.name for t in pending]}")
            done.extend(ready)
            pending = [t for t in pending if t not in ready]
        return tuple(done)

    def table(self, name: str) -> Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)


def normalise_sql(sql: str) -> str:
    """Whitespace and case folded, so the same statement compares equal however laid out."""
    return " ".join(sql.split()).lower()
