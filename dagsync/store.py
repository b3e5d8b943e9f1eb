"""MessageStore: the library API for the dag format (seed design, "Storage facade").

A conversation is a chain of immutable message rows linked by ``parent_id``
and ending at the sentinel ``'root'``. A message's identity is ``(parent_id,
content_hash)``: saving a message whose pair exists reuses that row, so a
shared prefix (the same system prompt, a re-sent history, a fork) is stored
once. Conversations are the only mutable rows: a name, a model and a head
pointer that advances with each turn. Calls record one model call each,
anchored to its input head and output head.

Each part is stored so that it loads back exactly and its message re-hashes
to ``content_hash``. That means storing two things the DAG branch's own
mapping drops (spec/dag-format.md, "Part rows"): a reasoning ``token_count``
of 0, and a tool result's attachments. Both are additive keys in
``content_json``, which the branch's reader ignores.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import apsw
from ulid import ULID

from dagsync.canonical import content_hash
from dagsync.db import Database, open_target
from dagsync.errors import NotFound, UnsupportedDatabase
from dagsync.formats.dag import DAG, ROOT
from dagsync.message import (
    Attachment,
    AttachmentPart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    with_metadata,
)
from dagsync.packed import Blobs
from dagsync.rehash import grouped
from dagsync.transactions import write_transaction

__all__ = ["MessageStore", "UlidFactory", "iso_now", "part_from_row", "part_row", "ROOT"]


def iso_now() -> str:
    """The current UTC time as ISO-8601 with microseconds and ``Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class UlidFactory:
    """Monotonic lowercase ULIDs: sortable by creation, unique within a process.

    Within one millisecond the random part is incremented rather than redrawn,
    so ids made in sequence sort in sequence. ``clock`` (seconds) and
    ``randbytes`` are injectable so fixtures can make the same ids every run.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        randbytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._clock = clock
        self._randbytes = randbytes
        self._last_ms = -1
        self._last_rand = 0

    def __call__(self) -> str:
        ms = int(self._clock() * 1000)
        if ms <= self._last_ms:
            ms = self._last_ms
            self._last_rand = (self._last_rand + 1) % (1 << 80)
        else:
            self._last_ms = ms
            self._last_rand = int.from_bytes(self._randbytes(10), "big")
        raw = ms.to_bytes(6, "big") + self._last_rand.to_bytes(10, "big")
        return str(ULID.from_bytes(raw)).lower()


# --- one part <-> one message_parts row ------------------------------------

PartRow = tuple[str, "str | None", "str | None", "str | None", "int | None"]


def _json(d: dict[str, Any] | None) -> str | None:
    return None if d is None else json.dumps(d)


def part_row(part: Part) -> PartRow:
    """``(part_type, content, content_json, tool_call_id, server_executed)`` for a part."""
    if isinstance(part, TextPart):
        pm = {"provider_metadata": part.provider_metadata} if part.provider_metadata else None
        return ("text", part.text, _json(pm), None, None)
    if isinstance(part, ReasoningPart):
        d: dict[str, Any] = {}
        # The branch writes these only when redacted or token_count is truthy,
        # losing a count of 0; we write them whenever either is set.
        if part.redacted or part.token_count is not None:
            d = {"redacted": part.redacted, "token_count": part.token_count}
        d = with_metadata(d, part.provider_metadata)
        return ("reasoning", part.text, _json(d or None), None, None)
    if isinstance(part, ToolCallPart):
        d = with_metadata({"name": part.name, "arguments": part.arguments}, part.provider_metadata)
        return ("tool_call", None, _json(d), part.tool_call_id, int(part.server_executed))
    if isinstance(part, ToolResultPart):
        d = {"name": part.name, "exception": part.exception}
        if part.attachments:  # the branch drops these; the hash needs them
            d["attachments"] = [a.to_dict() for a in part.attachments]
        d = with_metadata(d, part.provider_metadata)
        return ("tool_result", part.output, _json(d), part.tool_call_id, int(part.server_executed))
    if isinstance(part, AttachmentPart):
        if part.attachment is None:
            d = {"attachment": None} if part.provider_metadata else {}
        else:
            d = part.attachment.to_dict()
        d = with_metadata(d, part.provider_metadata)
        # An attachment that is present stores its dict even when it is empty.
        stored = _json(d) if part.attachment is not None or d else None
        return ("attachment", None, stored, None, None)
    raise TypeError(f"not a part: {part!r}")


def part_from_row(
    part_type: str,
    content: str | None,
    content_json: str | None,
    tool_call_id: str | None,
    server_executed: int | None,
) -> Part:
    """The part a ``message_parts`` row stores, written by us or by the branch.

    :raises ValueError: an unknown ``part_type``.
    """
    d: dict[str, Any] = json.loads(content_json) if content_json else {}
    pm = d.get("provider_metadata")
    if part_type == "text":
        return TextPart(text=content or "", provider_metadata=pm)
    if part_type == "reasoning":
        return ReasoningPart(
            text=content or "",
            redacted=bool(d.get("redacted", False)),
            token_count=d.get("token_count"),
            provider_metadata=pm,
        )
    if part_type == "tool_call":
        return ToolCallPart(
            name=d.get("name", ""),
            arguments=d.get("arguments", {}),
            tool_call_id=tool_call_id,
            server_executed=bool(server_executed),
            provider_metadata=pm,
        )
    if part_type == "tool_result":
        return ToolResultPart(
            name=d.get("name", ""),
            output=content or "",
            tool_call_id=tool_call_id,
            server_executed=bool(server_executed),
            exception=d.get("exception"),
            attachments=tuple(Attachment.from_dict(a) for a in d.get("attachments", ())),
            provider_metadata=pm,
        )
    if part_type == "attachment":
        if not content_json or ("attachment" in d and d["attachment"] is None):
            attachment = None
        else:
            attachment = Attachment.from_dict(d)
        return AttachmentPart(attachment=attachment, provider_metadata=pm)
    raise ValueError(f"unknown part_type {part_type!r}")


# --- the store ---------------------------------------------------------------

_CHAIN_SQL = """
WITH RECURSIVE chain(id, parent_id, depth) AS (
    SELECT id, parent_id, 0 FROM messages WHERE id = :head AND id != 'root'
    UNION ALL
    SELECT m.id, m.parent_id, c.depth + 1
    FROM chain c JOIN messages m ON m.id = c.parent_id
    WHERE c.parent_id != 'root' AND c.depth < :limit
)
SELECT c.depth, c.id, c.parent_id, m.role, m.provider_metadata_json,
       p.part_type, p.content, p.content_json, p.tool_call_id, p.server_executed
FROM chain c
JOIN messages m ON m.id = c.id
LEFT JOIN message_parts p ON p.message_id = c.id
ORDER BY c.depth DESC, p."order"
"""

# A chain longer than this is treated as a cycle in the parent links.
MAX_CHAIN = 1_000_000


class MessageStore:
    """Save, load and fork conversations in a dag-format database.

    Every method that writes runs in its own write transaction, or joins the
    caller's (``with store.transaction(): ...`` batches many saves into one).
    """

    def __init__(
        self,
        db: Database,
        *,
        new_id: Callable[[], str] | None = None,
        now: Callable[[], str] = iso_now,
    ) -> None:
        if db.format is not DAG:
            raise UnsupportedDatabase(
                f"{db.path} is in the {db.format.name} format; MessageStore "
                "reads and writes the dag format only"
            )
        self.db = db
        self.conn: apsw.Connection = db.conn
        self.new_id = new_id or UlidFactory()
        self.now = now
        self.blobs = Blobs(self.conn)

    @classmethod
    def open(cls, path: str | os.PathLike[str], **kwargs: Any) -> MessageStore:
        """Open a dag-format file, creating it (0600) with its schema if missing.

        An existing llm database from before the message store gets the DAG
        tables and the sentinel added, as the branch's migration does.
        """
        return cls(open_target(path, create=DAG, adopt=True), **kwargs)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transaction(self):  # noqa: ANN201 - a context manager
        return write_transaction(self.conn)

    # -- messages ------------------------------------------------------------

    def _find(self, parent_id: str, digest: str) -> str | None:
        for (found,) in self.conn.execute(
            "SELECT id FROM messages WHERE parent_id = ? AND content_hash = ?",
            (parent_id, digest),
        ):
            return found
        return None

    def _require_message(self, message_id: str) -> None:
        if not any(self.conn.execute("SELECT 1 FROM messages WHERE id = ?", (message_id,))):
            raise NotFound(f"no message with id {message_id!r} in {self.db.path}")

    def save_chain(self, messages: Sequence[Message], starting_parent_id: str = ROOT) -> str:
        """Save messages as a chain under ``starting_parent_id``; return its head id.

        A message whose ``(parent, content_hash)`` exists reuses that row, so
        only the part of the chain that is new is written.

        :raises HashContractError: a message cannot be hashed (nothing is written).
        :raises NotFound: ``starting_parent_id`` is not a message.
        """
        digests = [content_hash(m) for m in messages]  # refuse before writing
        with self.transaction():
            self._require_message(starting_parent_id)
            parent = starting_parent_id
            for message, digest in zip(messages, digests):
                parent = self._find(parent, digest) or self._insert(message, digest, parent)
        return parent

    def _insert(self, message: Message, digest: str, parent_id: str) -> str:
        message_id = self.new_id()
        pm = message.provider_metadata
        self.conn.execute(
            "INSERT INTO messages (id, parent_id, content_hash, role, "
            "provider_metadata_json, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (
                message_id,
                parent_id,
                digest,
                message.role,
                json.dumps(pm, sort_keys=True) if pm else None,
                self.now(),
            ),
        )
        self.conn.executemany(
            'INSERT INTO message_parts (id, message_id, "order", part_type, content, '
            "content_json, tool_call_id, server_executed) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (self.new_id(), message_id, order, *part_row(part))
                for order, part in enumerate(message.parts)
            ],
        )
        return message_id

    def find_longest_existing_prefix(self, messages: Sequence[Message]) -> tuple[str, int]:
        """How much of ``messages`` is already stored as a chain from the root.

        :returns: ``(last matched message id, number matched)``; the id is
            ``'root'`` when nothing matched.
        """
        parent, matched = ROOT, 0
        for message in messages:
            found = self._find(parent, content_hash(message))
            if found is None:
                break
            parent, matched = found, matched + 1
        return parent, matched

    def save_with_dedup(self, messages: Sequence[Message]) -> str:
        """Save a full history from the root, writing only its unseen tail; return the head."""
        with self.transaction():
            parent, matched = self.find_longest_existing_prefix(messages)
            return self.save_chain(messages[matched:], starting_parent_id=parent)

    def load_chain(self, head_message_id: str) -> list[Message]:
        """The messages from the root to ``head_message_id``, in order.

        ``'root'`` loads as the empty chain.

        :raises NotFound: the head, or a message on its chain, is missing.
        :raises UnsupportedDatabase: the parent links form a cycle.
        """
        if head_message_id == ROOT:
            return []
        return _chain_messages(_chain_rows(self.conn, self.db.path, head_message_id), self.blobs)

    # -- conversations and calls -------------------------------------------

    def start_conversation(
        self, name: str | None = None, model: str | None = None, head_message_id: str | None = None
    ) -> str:
        """Create a conversation (optionally already pointing at a message); return its id."""
        conversation_id = self.new_id()
        with self.transaction():
            if head_message_id is not None:
                self._require_message(head_message_id)
            self.conn.execute(
                "INSERT INTO conversations (id, name, model, head_message_id) VALUES (?, ?, ?, ?)",
                (conversation_id, name, model, head_message_id),
            )
        return conversation_id

    def fork(
        self, source_message_id: str, name: str | None = None, model: str | None = None
    ) -> str:
        """A new conversation whose head is an existing message; return its id.

        The fork shares every row of the prefix; new turns saved from its head
        diverge from there. ``model`` defaults to the model of the most recent
        call that ended at that message, else of a conversation whose head it is.
        """
        with self.transaction():
            self._require_message(source_message_id)
            if model is None:
                for (model,) in self.conn.execute(
                    "SELECT model FROM calls WHERE head_output_message_id = :m "
                    "OR head_input_message_id = :m "
                    "UNION ALL SELECT model FROM conversations WHERE head_message_id = :m "
                    "LIMIT 1",
                    {"m": source_message_id},
                ):
                    break
            return self.start_conversation(name, model, source_message_id)

    def conversation_head(self, conversation_id: str) -> str | None:
        """:raises NotFound: no such conversation."""
        for (head,) in self.conn.execute(
            "SELECT head_message_id FROM conversations WHERE id = ?", (conversation_id,)
        ):
            return head
        raise NotFound(f"no conversation with id {conversation_id!r} in {self.db.path}")

    def advance_conversation(self, conversation_id: str, head_message_id: str) -> None:
        """Point a conversation at a new head (normally the output of its latest call)."""
        with self.transaction():
            self.conversation_head(conversation_id)
            self._require_message(head_message_id)
            self.conn.execute(
                "UPDATE conversations SET head_message_id = ? WHERE id = ?",
                (head_message_id, conversation_id),
            )

    def record_call(
        self,
        *,
        model: str,
        head_input_message_id: str | None,
        head_output_message_id: str | None,
        conversation_id: str | None = None,
        started_at: str | None = None,
        duration_ms: int | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        token_details: dict[str, Any] | None = None,
        resolved_model: str | None = None,
        prompt_json: str | None = None,
        response_json: str | None = None,
        error: str | None = None,
        call_id: str | None = None,
    ) -> str:
        """Record one model call; return its id.

        A call that failed has an ``error`` and may have no output head.
        ``started_at`` defaults to now (ISO-8601).
        """
        call_id = call_id or self.new_id()
        with self.transaction():
            for head in (head_input_message_id, head_output_message_id):
                if head is not None:
                    self._require_message(head)
            if conversation_id is not None:
                self.conversation_head(conversation_id)
            self.conn.execute(
                "INSERT INTO calls (id, conversation_id, head_input_message_id, "
                "head_output_message_id, model, resolved_model, started_at, duration_ms, "
                "input_tokens, output_tokens, token_details_json, prompt_json, "
                "response_json, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    call_id,
                    conversation_id,
                    head_input_message_id,
                    head_output_message_id,
                    model,
                    resolved_model,
                    started_at or iso_now(),
                    duration_ms,
                    input_tokens,
                    output_tokens,
                    json.dumps(token_details) if token_details else None,
                    prompt_json,
                    response_json,
                    error,
                ),
            )
        return call_id


def _chain_rows(conn: apsw.Connection, path: Path, head: str) -> list[tuple]:
    """``_CHAIN_SQL``'s rows for ``head``, the chain proven whole: it exists,
    it reaches the root, it is not a cycle (see ``load_chain``)."""
    rows = list(conn.execute(_CHAIN_SQL, {"head": head, "limit": MAX_CHAIN}))
    if not rows:
        raise NotFound(f"no message with id {head!r} in {path}")
    if rows[0][0] >= MAX_CHAIN:
        raise UnsupportedDatabase(f"{path}: the parent links above {head!r} form a cycle")
    if rows[0][2] != ROOT:
        raise NotFound(f"message {rows[0][1]!r} in {path} points at parent {rows[0][2]!r}, which does not exist")
    return rows


def _chain_messages(rows: list[tuple], blobs: Blobs) -> list[Message]:
    """The chain's rows as messages, root first; a packed file's references to
    blobs (dagsync pack) resolved."""
    return [
        _message(role, [
            part_from_row(ptype, blobs.resolve(content, "text"), blobs.resolve(content_json, "text"), *rest)
            for ptype, content, content_json, *rest in parts
        ], pm_json)
        for (_, _, _, role, pm_json), parts in grouped(rows, 5)
    ]  # fmt: skip


def _message(role: str, parts: list[Part], pm_json: str | None) -> Message:
    return Message(role=role, parts=tuple(parts), provider_metadata=json.loads(pm_json) if pm_json else None)
