-- dag_schema.sql: copied from shared/spec/dag-branch-schema.sql; FTS5 shadow tables
-- removed (FTS5 makes them) and every CREATE made idempotent.
CREATE TABLE IF NOT EXISTS "_llm_migrations" (
   "name" TEXT PRIMARY KEY,
   "applied_at" TEXT
);
CREATE TABLE IF NOT EXISTS "attachments" (
   "id" TEXT PRIMARY KEY,
   "type" TEXT,
   "path" TEXT,
   "url" TEXT,
   "content" BLOB
);
CREATE TABLE IF NOT EXISTS "prompt_attachments" (
   "response_id" TEXT REFERENCES "responses"("id"),
   "attachment_id" TEXT REFERENCES "attachments"("id"),
   "order" INTEGER,
   PRIMARY KEY ("response_id", "attachment_id")
);
CREATE TABLE IF NOT EXISTS "schemas" (
   "id" TEXT PRIMARY KEY,
   "content" TEXT
);
CREATE TABLE IF NOT EXISTS "responses" (
   "id" TEXT PRIMARY KEY,
   "model" TEXT,
   "prompt" TEXT,
   "system" TEXT,
   "prompt_json" TEXT,
   "options_json" TEXT,
   "response" TEXT,
   "response_json" TEXT,
   "conversation_id" TEXT REFERENCES "conversations"("id"),
   "duration_ms" INTEGER,
   "datetime_utc" TEXT,
   "input_tokens" INTEGER,
   "output_tokens" INTEGER,
   "token_details" TEXT,
   "schema_id" TEXT REFERENCES "schemas"("id")
, "resolved_model" TEXT);
CREATE TABLE IF NOT EXISTS "fragments" (
   "id" INTEGER PRIMARY KEY,
   "hash" TEXT,
   "content" TEXT,
   "datetime_utc" TEXT,
   "source" TEXT
);
CREATE TABLE IF NOT EXISTS "fragment_aliases" (
   "alias" TEXT PRIMARY KEY,
   "fragment_id" INTEGER REFERENCES "fragments"("id")
);
CREATE TABLE IF NOT EXISTS "prompt_fragments" (
   "response_id" TEXT REFERENCES "responses"("id"),
   "fragment_id" INTEGER REFERENCES "fragments"("id"),
   "order" INTEGER,
   PRIMARY KEY ("response_id", "fragment_id", "order")
);
CREATE TABLE IF NOT EXISTS "system_fragments" (
   "response_id" TEXT REFERENCES "responses"("id"),
   "fragment_id" INTEGER REFERENCES "fragments"("id"),
   "order" INTEGER,
   PRIMARY KEY ("response_id", "fragment_id", "order")
);
CREATE TABLE IF NOT EXISTS "tools" (
   "id" INTEGER PRIMARY KEY,
   "hash" TEXT,
   "name" TEXT,
   "description" TEXT,
   "input_schema" TEXT
, "plugin" TEXT);
CREATE TABLE IF NOT EXISTS "tool_responses" (
   "tool_id" INTEGER REFERENCES "tools"("id"),
   "response_id" TEXT REFERENCES "responses"("id"),
   PRIMARY KEY ("tool_id", "response_id")
);
CREATE TABLE IF NOT EXISTS "tool_calls" (
   "id" INTEGER PRIMARY KEY,
   "response_id" TEXT REFERENCES "responses"("id"),
   "tool_id" INTEGER REFERENCES "tools"("id"),
   "name" TEXT,
   "arguments" TEXT,
   "tool_call_id" TEXT
);
CREATE TABLE IF NOT EXISTS "tool_instances" (
   "id" INTEGER PRIMARY KEY,
   "plugin" TEXT,
   "name" TEXT,
   "arguments" TEXT
);
CREATE TABLE IF NOT EXISTS "tool_results" (
   "id" INTEGER PRIMARY KEY,
   "response_id" TEXT REFERENCES "responses"("id"),
   "tool_id" INTEGER REFERENCES "tools"("id"),
   "name" TEXT,
   "output" TEXT,
   "tool_call_id" TEXT,
   "instance_id" INTEGER REFERENCES "tool_instances"("id")
, "exception" TEXT);
CREATE TABLE IF NOT EXISTS "tool_results_attachments" (
   "tool_result_id" INTEGER REFERENCES "tool_results"("id"),
   "attachment_id" TEXT REFERENCES "attachments"("id"),
   "order" INTEGER,
   PRIMARY KEY ("tool_result_id", "attachment_id")
);
CREATE TABLE IF NOT EXISTS "parts" (
   "id" INTEGER PRIMARY KEY,
   "response_id" TEXT REFERENCES "responses"("id"),
   "direction" TEXT,
   "role" TEXT,
   "part_type" TEXT,
   "order" INTEGER,
   "content" TEXT,
   "content_json" TEXT,
   "tool_call_id" TEXT,
   "server_executed" INTEGER
);
CREATE TABLE IF NOT EXISTS "messages" (
   "id" TEXT PRIMARY KEY,
   "parent_id" TEXT NOT NULL REFERENCES "messages"("id"),
   "content_hash" TEXT NOT NULL,
   "role" TEXT NOT NULL,
   "provider_metadata_json" TEXT,
   "created_at" TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS "message_parts" (
   "id" TEXT PRIMARY KEY,
   "message_id" TEXT REFERENCES "messages"("id"),
   "order" INTEGER,
   "part_type" TEXT,
   "content" TEXT,
   "content_json" TEXT,
   "tool_call_id" TEXT,
   "server_executed" INTEGER
);
CREATE TABLE IF NOT EXISTS "conversations" (
   "id" TEXT PRIMARY KEY,
   "name" TEXT,
   "model" TEXT,
   "head_message_id" TEXT REFERENCES "messages"("id")
);
CREATE UNIQUE INDEX IF NOT EXISTS "idx_fragments_hash"
    ON "fragments" ("hash");
CREATE UNIQUE INDEX IF NOT EXISTS "idx_tools_hash"
    ON "tools" ("hash");
CREATE UNIQUE INDEX IF NOT EXISTS "idx_parts_response_order" ON parts (response_id, direction, "order");
CREATE UNIQUE INDEX IF NOT EXISTS "idx_messages_parent_hash_unique" ON messages(parent_id, content_hash);
CREATE INDEX IF NOT EXISTS "idx_messages_parent_id" ON messages(parent_id);
CREATE INDEX IF NOT EXISTS "idx_messages_content_hash" ON messages(content_hash);
CREATE UNIQUE INDEX IF NOT EXISTS "idx_message_parts_message_order" ON message_parts (message_id, "order");
CREATE VIRTUAL TABLE IF NOT EXISTS "responses_fts" USING FTS5 (
    "prompt", "response",
    content="responses"
)
/* responses_fts(prompt,response) */;
CREATE TRIGGER IF NOT EXISTS "responses_ai" AFTER INSERT ON "responses" BEGIN
  INSERT INTO "responses_fts" (rowid, "prompt", "response") VALUES (new.rowid, new."prompt", new."response");
END;
CREATE TRIGGER IF NOT EXISTS "responses_ad" AFTER DELETE ON "responses" BEGIN
  INSERT INTO "responses_fts" ("responses_fts", rowid, "prompt", "response") VALUES('delete', old.rowid, old."prompt", old."response");
END;
CREATE TRIGGER IF NOT EXISTS "responses_au" AFTER UPDATE ON "responses" BEGIN
  INSERT INTO "responses_fts" ("responses_fts", rowid, "prompt", "response") VALUES('delete', old.rowid, old."prompt", old."response");
  INSERT INTO "responses_fts" (rowid, "prompt", "response") VALUES (new.rowid, new."prompt", new."response");
END;
CREATE TABLE IF NOT EXISTS "calls" (
   "id" TEXT PRIMARY KEY,
   "conversation_id" TEXT REFERENCES "conversations"("id"),
   "head_input_message_id" TEXT REFERENCES "messages"("id"),
   "head_output_message_id" TEXT REFERENCES "messages"("id"),
   "model" TEXT NOT NULL,
   "resolved_model" TEXT,
   "started_at" TEXT NOT NULL,
   "duration_ms" INTEGER,
   "input_tokens" INTEGER,
   "output_tokens" INTEGER,
   "token_details_json" TEXT,
   "prompt_json" TEXT,
   "response_json" TEXT,
   "error" TEXT
);
CREATE INDEX IF NOT EXISTS "idx_calls_conversation" ON calls(conversation_id);
CREATE INDEX IF NOT EXISTS "idx_calls_started_at" ON calls(started_at);
CREATE INDEX IF NOT EXISTS "idx_calls_head_input" ON calls(head_input_message_id);
CREATE INDEX IF NOT EXISTS "idx_calls_head_output" ON calls(head_output_message_id);
