"""The ``dag`` format: llm's DAG branch (``dag.db``) and dagsync's MessageStore.

Messages are ULID-keyed rows linked by ``parent_id``; a message's identity is
``(parent_id, content_hash)`` and chains end at the sentinel row ``'root'``.
See shared/spec/dag-format.md.
"""

from dagsync.formats import Collect, Conversations, Format, Key, KeyProof, PackedColumn, Table
from dagsync.formats.legacy import LEGACY_MIGRATIONS, LEGACY_TABLES

ROOT = "root"

# The branch forked from llm after m021; its m022 and m023 made the legacy
# ``parts`` table and the DAG tables.
MIGRATIONS = (
    *LEGACY_MIGRATIONS,
    "m022_parts_table", "m023_messages_table",
)  # fmt: skip

DAG = Format(
    name="dag",
    marker_columns=frozenset({"id", "parent_id", "content_hash"}),
    schema_resource="dag_schema.sql",
    tables=(
        Table("messages", Key.DAG_MESSAGE, ("id",), required=True, collect=Collect.UNREACHABLE),
        Table(
            "message_parts", Key.TEXT, ("id",), required=True, owner=("message_id", "messages"),
            collect=Collect.WITH_OWNER, owned_by="message_id",
        ),  # fmt: skip
        Table("calls", Key.TEXT, ("id",), required=True),
        *(
            Table(t.name, t.key, t.natural_key, required=True, pointer="head_message_id")
            if t.name == "conversations"
            else t
            for t in LEGACY_TABLES
        ),
        Table("parts", Key.INTEGER, ("response_id", "direction", "order")),
    ),
    message_key="id",
    parent_column="parent_id",
    root_id=ROOT,
    conversation_table="conversations",
    call_table="calls",
    part_table="message_parts",
    migrations=MIGRATIONS,
    # The branch's own names for m022 and m023 are not published; its numbers are.
    migration_gate="number",
    # Written in two spellings (see the spec); SQLite's date functions read both.
    message_time="created_at",
    branch_time=("messages", "id", "created_at", None),
    call_conversation="conversation_id",
    call_tip="head_output_message_id",
    # The spec's content hash: role, provider metadata and each part's columns.
    message_content=("role", "provider_metadata_json"),
    part_content=("part_type", "content", "content_json", "tool_call_id", "server_executed"),
    # Every payload column llm writes (docs/blobs.md says which stay plain, and
    # why); a prompt that is also a message part is one blob.
    packed=(
        PackedColumn("message_parts", "content"), PackedColumn("message_parts", "content_json"),
        *(PackedColumn("responses", c) for c in (
            "prompt", "system", "response", "prompt_json", "options_json", "response_json",
        )),
        PackedColumn("calls", "prompt_json"), PackedColumn("calls", "response_json"),
        PackedColumn("tool_calls", "arguments"), PackedColumn("tool_results", "output"),
        PackedColumn("parts", "content"), PackedColumn("parts", "content_json"),
        PackedColumn("fragments", "content"), PackedColumn("attachments", "content", holds="blob"),
    ),  # fmt: skip
    # A conversation with its calls, and the legacy responses of the same id.
    conversations=Conversations(
        tables=("conversations",),
        times=(("calls", "conversation_id", "started_at"), ("responses", "conversation_id", "datetime_utc")),
        models=(
            ("calls", "conversation_id", "model"), ("calls", "conversation_id", "resolved_model"),
            ("responses", "conversation_id", "model"), ("responses", "conversation_id", "resolved_model"),
            ("conversations", "id", "model"),
        ),
        search=(("responses_fts", "responses", "c.conversation_id"),),
    ),  # fmt: skip
    # The spec keys an attachment by the sha256 of its content (one that is
    # only a URL or a path cannot be proven from the file) and says nothing
    # of a schema's id.
    proven=(
        KeyProof("fragments", "hash", "fragment", ("content",)),
        KeyProof("attachments", "id", "attachment-content", ("content",)),
    ),
)
