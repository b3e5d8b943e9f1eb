"""llm's legacy tables, written by every llm since 0.13 and present in both formats.

``llm logs`` reads them, so a merge is complete only when they are merged too.
"""

from dagsync.formats import Collect, Key, Table

# The migrations every llm since 0.13 shares; the two formats part after m021.
LEGACY_MIGRATIONS = (
    "m001_initial", "m002_id_primary_key", "m003_chat_id_foreign_key",
    "m004_column_order", "m004_drop_provider", "m005_debug", "m006_new_logs_table",
    "m007_finish_logs_table", "m008_reply_to_id_foreign_key",
    "m008_fix_column_order_in_logs", "m009_delete_logs_table_if_empty",
    "m010_create_new_log_tables", "m011_fts_for_responses", "m012_attachments_tables",
    "m013_usage", "m014_schemas", "m015_fragments_tables", "m016_fragments_table_pks",
    "m017_tools_tables", "m017_tools_plugin", "m018_tool_instances",
    "m019_resolved_model", "m020_tool_results_attachments", "m021_tool_results_exception",
)  # fmt: skip

LEGACY_TABLES = (
    # Which migrations a file has had; merged as a union (applied_at differs by file).
    Table("_llm_migrations", Key.TEXT, ("name",), compare=()),
    Table("conversations", Key.TEXT, ("id",)),
    Table("schemas", Key.TEXT, ("id",)),
    Table("responses", Key.TEXT, ("id",)),
    Table("responses_fts", Key.DERIVED),
    # The id is a sha256 of the content (or URL): the same id is the same
    # attachment, while ``path`` is where one machine happened to read it from.
    Table("attachments", Key.TEXT, ("id",), compare=(), collect=Collect.UNREFERENCED),
    Table("prompt_attachments", Key.COMPOSITE, ("response_id", "attachment_id")),
    Table("fragments", Key.INTEGER, ("hash",), collect=Collect.UNREFERENCED),
    # A name llm lets you re-point (`llm fragments set`): the target keeps its own.
    Table("fragment_aliases", Key.TEXT, ("alias",), compare=()),
    Table("prompt_fragments", Key.COMPOSITE, ("response_id", "fragment_id", "order")),
    Table("system_fragments", Key.COMPOSITE, ("response_id", "fragment_id", "order")),
    Table("tools", Key.INTEGER, ("hash",), collect=Collect.UNREFERENCED),
    Table("tool_instances", Key.INTEGER, ("plugin", "name", "arguments"), collect=Collect.UNREFERENCED),
    Table("tool_responses", Key.COMPOSITE, ("tool_id", "response_id")),
    # One response's calls and results, told apart by tool, call id and name;
    # equal ones are matched by rank (the k-th with the k-th).
    Table("tool_calls", Key.INTEGER, ("response_id", "tool_id", "tool_call_id", "name")),
    Table("tool_results", Key.INTEGER, ("response_id", "tool_id", "tool_call_id", "name")),
    Table("tool_results_attachments", Key.COMPOSITE, ("tool_result_id", "attachment_id")),
)
