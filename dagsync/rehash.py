"""Messages re-hashed from their stored rows, in both formats.

``verify`` re-hashes every message of a file with these, and ``merge`` every
message it is about to copy (``merge/proofs.py``): the dag format by the
spec's content-hash contract (``canonical.row_content_hash``), the llm format
by llm's Merkle recipe (``merkle``). Packed payloads are resolved, and so
proven, on the way (``packed.Blobs``).

Each reader takes the rows of a query in message order, parts in order
within a message, and yields ``(key, what is wrong)`` for each message that
fails; the caller words it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import apsw

from dagsync.canonical import row_content_hash
from dagsync.errors import BlobError, HashContractError
from dagsync.formats import KeyProof, PackedColumn
from dagsync.merkle import KEY_RECIPES, message_dict, message_hash
from dagsync.packed import Blobs

__all__ = [
    "DAG_COLUMNS", "LLM_COLUMNS", "LlmLookups", "dag_failures", "grouped", "key_sql", "llm_failures",
    "register_key_recipes",
]  # fmt: skip


def _exact(column: str) -> str:
    """A text column as its bytes and whether it is TEXT: a value that is not
    UTF-8 then names its message as unreadable, instead of stopping the read."""
    return f"CASE WHEN typeof({column}) = 'text' THEN CAST({column} AS BLOB) ELSE {column} END, typeof({column}) = 'text'"


def _text(value: Any, is_text: int) -> Any:
    """:raises UnicodeDecodeError: (a ValueError) TEXT that is not UTF-8."""
    return value.decode("utf-8") if is_text else value


def _resolved(blobs: Blobs, value: Any) -> Any:
    """A text column's value with a packed payload resolved, decoded strictly.

    :raises UnicodeDecodeError: a payload that is not UTF-8.
    """
    data = blobs.resolve_bytes(value, "text")
    return value if data is value else data.decode("utf-8")


# What a query hands each reader, per row: the message, then one of its parts
# (NULLs for a message without parts); text read as ``_exact``.
DAG_COLUMNS = (
    f"m.id, {_exact('m.role')}, {_exact('m.provider_metadata_json')}, m.content_hash, "
    f"p.part_type, {_exact('p.content')}, {_exact('p.content_json')}, p.tool_call_id, p.server_executed"
)
LLM_COLUMNS = f"m.hash, m.parent_hash, {_exact('m.role')}, {_exact('m.provider_metadata')}, p.type, {_exact('p.text')}, {_exact('p.payload')}"


def grouped(rows: Iterable[tuple], head: int) -> Iterator[tuple[tuple, list[tuple]]]:
    """``(message columns, [part columns...])`` for each message of ``rows``, whose
    first ``head`` columns are the message's."""
    current: tuple | None = None
    parts: list[tuple] = []
    for row in rows:
        message, part = row[:head], row[head:]
        if current is None or message[0] != current[0]:
            if current is not None:
                yield current, parts
            current, parts = message, []
        if part[0] is not None:
            parts.append(part)
    if current is not None:
        yield current, parts


def dag_failures(rows: Iterable[tuple], blobs: Blobs, *, blob_errors: bool = False) -> Iterator[tuple[str, str]]:
    """Each dag message of ``rows`` (``DAG_COLUMNS``) whose parts do not hash to its content_hash.

    :raises BlobError: with ``blob_errors``, a packed part whose blob fails its
        proof (else the message is named as one that cannot be read back).
    """
    for (mid, role, role_text, pm, pm_text, stored), parts in grouped(rows, 6):
        try:
            digest = row_content_hash(_text(role, role_text), _text(pm, pm_text), [
                (ptype, _resolved(blobs, _text(c, c_text)), _resolved(blobs, _text(j, j_text)), *rest)
                for ptype, c, c_text, j, j_text, *rest in parts
            ])  # fmt: skip
        except BlobError as exc:
            if blob_errors:
                raise
            yield mid, f"its parts cannot be read back: {exc}"
            continue
        except (ValueError, LookupError, HashContractError) as exc:
            yield mid, f"its parts cannot be read back: {exc}"
            continue
        if digest != stored:
            yield mid, (
                f"its parts hash to {digest[:12]}, not its content_hash {(stored or '')[:12]} (a part was "
                "changed, lost, or written by the DAG branch's lossy mapping)"
            )


class LlmLookups:
    """The fragments and attachments llm messages of one schema refer to, read back."""

    def __init__(self, conn: apsw.Connection, blobs: Blobs, schema: str = "main", also: str | None = None) -> None:
        # ``also``: a schema to look in for an attachment ``schema`` lacks (a thin
        # source's target: the attachment may have been merged before).
        self.conn, self.blobs, self.schema, self.also = conn, blobs, schema, also
        self.also_blobs = Blobs(conn, also) if also is not None else None

    def fragment(self, fid: int) -> str | None:
        row = next(iter(self.conn.execute(
            f"SELECT {_exact('content')} FROM {self.schema}.fragments WHERE id = ?", (fid,)
        )), None)  # fmt: skip
        return None if row is None else _resolved(self.blobs, _text(*row))

    def attachment(self, aid: str) -> tuple[Any, ...] | None:
        for schema in (self.schema, self.also):
            if schema is None:
                continue
            row = next(iter(self.conn.execute(
                f"SELECT type, path, url, content FROM {schema}.attachments WHERE id = ?", (aid,)
            )), None)  # fmt: skip
            if row is not None:
                blobs = self.blobs if schema == self.schema else self.also_blobs
                assert blobs is not None
                return (*row[:3], blobs.resolve(row[3], "blob"))
        return None


def llm_failures(rows: Iterable[tuple], lookups: LlmLookups, *, blob_errors: bool = False) -> Iterator[tuple[str, str]]:
    """Each llm message of ``rows`` (``LLM_COLUMNS``) whose parent and parts do not hash to its key.

    :raises BlobError: as in ``dag_failures``.
    """
    blobs = lookups.blobs
    for (mhash, parent, role, role_text, pm, pm_text), parts in grouped(rows, 6):
        try:
            resolved = [
                (ptype, _resolved(blobs, _text(t, t_text)), _resolved(blobs, _text(p, p_text)))
                for ptype, t, t_text, p, p_text in parts
            ]
            message = message_dict(_text(role, role_text), _text(pm, pm_text), resolved, lookups.fragment, lookups.attachment)
            digest = message_hash(message, parent)
        except BlobError as exc:
            if blob_errors:
                raise
            yield mhash, f"its parts cannot be read back: {exc}"
            continue
        except (LookupError, ValueError, KeyError, TypeError) as exc:
            yield mhash, f"its parts cannot be read back: {exc}"
            continue
        if digest != mhash:
            yield mhash, f"its parts and parent hash to {digest}, not to its own hash"


# -- rows keyed by a hash of their content (``formats.KeyProof``) ------------------------


def _recipe(name: str):
    recipe = KEY_RECIPES[name]

    def key(*values: Any) -> str | None:
        try:
            return recipe(*values)
        except (TypeError, ValueError) as exc:
            return f"nothing (its content cannot be hashed: {exc})"

    return key


def register_key_recipes(conn: apsw.Connection) -> None:
    """``dagsync_key_<recipe>(columns...)`` for every recipe of ``merkle.KEY_RECIPES``."""
    for name in KEY_RECIPES:
        conn.create_scalar_function(f"dagsync_key_{name.replace('-', '_')}", _recipe(name), -1, deterministic=True)


def key_sql(proof: KeyProof, alias: str, packed: dict[tuple[str, str], PackedColumn], resolve: str | None) -> str:
    """SQL for the key ``proof`` computes from a row ``alias``: packed columns resolved
    by the SQL function ``resolve`` (``dagsync_unpack``/``_src``) when the file is packed."""
    args = []
    for column in proof.columns:
        value = f'{alias}."{column}"'
        store = packed.get((proof.table, column))
        if resolve and store is not None:
            value = f"{resolve}({value}, '{store.holds}')"
        args.append(value)
    return f"dagsync_key_{proof.recipe.replace('-', '_')}({', '.join(args)})"
