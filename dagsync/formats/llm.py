"""The ``llm`` format: what released llm (0.32 and later; 0.36 today) writes to logs.db.

Messages are keyed by a Merkle hash (``b2:`` + blake2b over the parent hash
and the canonical content), so identical content under the same parent is the
same row in every file. ``threads`` point at a tip, ``turns`` record one
model call each. See shared/spec/llm-0.36-schema.sql.
"""

from dagsync.formats import Format, Key, Table
from dagsync.formats.legacy import LEGACY_TABLES

LLM = Format(
    name="llm",
    marker_columns=frozenset({"hash", "parent_hash"}),
    schema_resource="llm_schema.sql",
    tables=(
        Table("messages", Key.TEXT, ("hash",), required=True),
        Table("parts", Key.INTEGER, ("message_hash", "position"), required=True),
        Table("part_attachments", Key.COMPOSITE, ("part_id", "attachment_id", "order")),
        Table("part_fragments", Key.COMPOSITE, ("part_id", "fragment_id", "order")),
        Table("threads", Key.TEXT, ("id",), required=True, pointer="tip_message_hash"),
        Table("turns", Key.TEXT, ("id",), required=True),
        Table("turn_tools", Key.COMPOSITE, ("turn_id", "tool_id")),
        Table("turn_fragments", Key.COMPOSITE, ("turn_id", "fragment_id", "kind", "order")),
        Table("turn_search", Key.INTEGER, ("turn_id",)),
        Table("turn_search_fts", Key.DERIVED),
        Table("tool_instantiations", Key.COMPOSITE, ("turn_id", "tool_call_id")),
        *LEGACY_TABLES,
    ),
    message_key="hash",
    parent_column="parent_hash",
    root_id=None,
    conversation_table="threads",
    call_table="turns",
    part_table="parts",
)
