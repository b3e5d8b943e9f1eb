"""The ``llm`` format: what released llm (0.32 and later; 0.36 today) writes to logs.db.

Messages are keyed by a Merkle hash (``b2:`` + blake2b over the parent hash
and the canonical content), so identical content under the same parent is the
same row in every file. ``threads`` point at a tip, ``turns`` record one
model call each. See shared/spec/llm-0.36-schema.sql.
"""

from dagsync.formats import (
    Collect,
    Conversations,
    Format,
    JsonRef,
    Key,
    KeyProof,
    PackedColumn,
    PayloadRef,
    Table,
)
from dagsync.formats.legacy import LEGACY_MIGRATIONS, LEGACY_TABLES

# Every migration llm 0.36 has; a file dagsync creates in this format records
# them, so llm 0.36 opens it without migrating.
MIGRATIONS = (
    *LEGACY_MIGRATIONS,
    "m022_response_reasoning", "m023_message_store",
    "m024_tool_instance_references", "m025_turn_tools_instance_backfill",
    "m026_message_tree_view", "m027_turns_response_json",
)  # fmt: skip


LLM = Format(
    name="llm",
    marker_columns=frozenset({"hash", "parent_hash"}),
    schema_resource="llm_schema.sql",
    tables=(
        Table("messages", Key.HASH_MESSAGE, ("hash",), required=True, collect=Collect.UNREACHABLE),
        # Parts of a message already in the target match by (message, position),
        # so only the parts of new messages are copied.
        Table(
            "parts", Key.INTEGER, ("message_hash", "position"), required=True,
            # Text that borrows fragments is stored as
            # {"text_ref": [{"literal": ...}, {"fragment": 12}, ...]}.
            json_refs=(JsonRef("payload", "fragments", "text_ref", "fragment"),),
            collect=Collect.WITH_OWNER, owned_by="message_hash",
        ),  # fmt: skip
        Table(
            "part_attachments", Key.COMPOSITE, ("part_id", "attachment_id", "order"),
            collect=Collect.WITH_OWNER, owned_by="part_id",
        ),  # fmt: skip
        Table(
            "part_fragments", Key.COMPOSITE, ("part_id", "fragment_id", "order"),
            collect=Collect.WITH_OWNER, owned_by="part_id",
        ),  # fmt: skip
        Table("threads", Key.TEXT, ("id",), required=True, pointer="tip_message_hash"),
        Table("turns", Key.TEXT, ("id",), required=True),
        Table("turn_tools", Key.COMPOSITE, ("turn_id", "tool_id")),
        Table("turn_fragments", Key.COMPOSITE, ("turn_id", "fragment_id", "kind", "order")),
        Table("turn_search", Key.INTEGER, ("turn_id",)),
        Table("turn_search_fts", Key.DERIVED),
        Table("tool_instantiations", Key.COMPOSITE, ("turn_id", "tool_call_id")),
        *(
            Table(t.name, t.key, t.natural_key, compare=()) if t.name == "_llm_migrations" else t
            for t in LEGACY_TABLES
        ),
    ),
    message_key="hash",
    parent_column="parent_hash",
    root_id=None,
    conversation_table="threads",
    call_table="turns",
    part_table="parts",
    migrations=MIGRATIONS,
    migration_gate="name",
    # llm's messages carry no time; the turn that ends at a tip does.
    branch_time=("turns", "tip_message_hash", "datetime_utc", "thread_id"),
    call_conversation="thread_id",
    call_tip="tip_message_hash",
    # llm.Message: role, provider_metadata, and (type, text, payload) of each part.
    message_content=("role", "provider_metadata"),
    part_content=("type", "text", "payload"),
    part_order="position",
    # llm writes a part_fragments / part_attachments row for each of these
    # too; gc counts both, in case a file has one without the other.
    payload_refs=(
        PayloadRef("parts", "payload", "$.text_ref[#].fragment", "fragments"),
        PayloadRef("parts", "payload", "$.attachment.id", "attachments"),
        PayloadRef("parts", "payload", "$.attachments[#].id", "attachments"),
    ),
    # Every payload column llm writes (docs/blobs.md says which stay plain, and
    # why); the same text in a part, a turn's search row and a response is one blob.
    packed=(
        PackedColumn("parts", "text"), PackedColumn("parts", "payload"),
        PackedColumn("fragments", "content"), PackedColumn("attachments", "content", holds="blob"),
        PackedColumn("turns", "options_json"), PackedColumn("turns", "response_json"),
        PackedColumn("turn_search", "prompt"), PackedColumn("turn_search", "response"),
        *(PackedColumn("responses", c) for c in (
            "prompt", "system", "response", "prompt_json", "options_json", "response_json",
        )),
        PackedColumn("tool_calls", "arguments"), PackedColumn("tool_results", "output"),
    ),  # fmt: skip
    # A conversation is a thread; llm 0.36 still reads the legacy
    # conversations and responses of the same id (``llm logs``).
    conversations=Conversations(
        tables=("threads", "conversations"),
        times=(
            ("threads", "id", "datetime_utc"), ("turns", "thread_id", "datetime_utc"),
            ("responses", "conversation_id", "datetime_utc"),
        ),
        models=(
            ("turns", "thread_id", "model"), ("turns", "thread_id", "resolved_model"),
            ("responses", "conversation_id", "model"), ("responses", "conversation_id", "resolved_model"),
            ("conversations", "id", "model"),
        ),
        search=(
            ("turn_search_fts", "turn_search", "(SELECT u.thread_id FROM main.turns u WHERE u.id = c.turn_id)"),
            ("responses_fts", "responses", "c.conversation_id"),
        ),
    ),  # fmt: skip
    proven=(
        KeyProof("fragments", "hash", "fragment", ("content",)),
        KeyProof("attachments", "id", "attachment", ("url", "content")),
        KeyProof("schemas", "id", "schema", ("content",)),
    ),
)
