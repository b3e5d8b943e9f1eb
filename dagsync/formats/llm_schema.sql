-- llm_schema.sql: copied from shared/spec/llm-0.36-schema.sql; FTS5 shadow tables
-- removed (FTS5 makes them) and every CREATE made idempotent.
CREATE TABLE IF NOT EXISTS "_llm_migrations" (
   "name" TEXT PRIMARY KEY,
   "applied_at" TEXT
);
CREATE TABLE IF NOT EXISTS "conversations" (
   "id" TEXT PRIMARY KEY,
   "name" TEXT,
   "model" TEXT
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
, "resolved_model" TEXT, "reasoning" TEXT);
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
CREATE TABLE IF NOT EXISTS "messages" (
   "hash" TEXT PRIMARY KEY,
   "parent_hash" TEXT REFERENCES "messages"("hash"),
   "role" TEXT,
   "provider_metadata" TEXT
);
CREATE TABLE IF NOT EXISTS "parts" (
   "id" INTEGER PRIMARY KEY,
   "message_hash" TEXT REFERENCES "messages"("hash"),
   "position" INTEGER,
   "type" TEXT,
   "tool_name" TEXT,
   "text" TEXT,
   "payload" TEXT
);
CREATE TABLE IF NOT EXISTS "part_attachments" (
   "part_id" INTEGER REFERENCES "parts"("id"),
   "attachment_id" TEXT REFERENCES "attachments"("id"),
   "order" INTEGER,
   PRIMARY KEY ("part_id", "attachment_id", "order")
);
CREATE TABLE IF NOT EXISTS "part_fragments" (
   "part_id" INTEGER REFERENCES "parts"("id"),
   "fragment_id" INTEGER REFERENCES "fragments"("id"),
   "order" INTEGER,
   PRIMARY KEY ("part_id", "fragment_id", "order")
);
CREATE TABLE IF NOT EXISTS "threads" (
   "id" TEXT PRIMARY KEY,
   "name" TEXT,
   "tip_message_hash" TEXT REFERENCES "messages"("hash"),
   "forked_from" TEXT REFERENCES "threads"("id"),
   "datetime_utc" TEXT
);
CREATE TABLE IF NOT EXISTS "turns" (
   "id" TEXT PRIMARY KEY,
   "thread_id" TEXT REFERENCES "threads"("id"),
   "parent_message_hash" TEXT REFERENCES "messages"("hash"),
   "tip_message_hash" TEXT REFERENCES "messages"("hash"),
   "model" TEXT,
   "resolved_model" TEXT,
   "options_json" TEXT,
   "schema_id" TEXT REFERENCES "schemas"("id"),
   "input_tokens" INTEGER,
   "output_tokens" INTEGER,
   "token_details" TEXT,
   "duration_ms" INTEGER,
   "datetime_utc" TEXT
, "response_json" TEXT);
CREATE TABLE IF NOT EXISTS "turn_fragments" (
   "turn_id" TEXT REFERENCES "turns"("id"),
   "fragment_id" INTEGER REFERENCES "fragments"("id"),
   "order" INTEGER,
   "kind" TEXT,
   PRIMARY KEY ("turn_id", "fragment_id", "kind", "order")
);
CREATE TABLE IF NOT EXISTS "turn_search" (
   "id" INTEGER PRIMARY KEY,
   "turn_id" TEXT REFERENCES "turns"("id"),
   "prompt" TEXT,
   "response" TEXT
);
CREATE TABLE IF NOT EXISTS "turn_tools" (
   "turn_id" TEXT REFERENCES "turns"("id"),
   "tool_id" INTEGER REFERENCES "tools"("id"),
   "instance_id" INTEGER REFERENCES "tool_instances"("id"),
   PRIMARY KEY ("turn_id", "tool_id")
);
CREATE UNIQUE INDEX IF NOT EXISTS "idx_fragments_hash"
    ON "fragments" ("hash");
CREATE UNIQUE INDEX IF NOT EXISTS "idx_tools_hash"
    ON "tools" ("hash");
CREATE INDEX IF NOT EXISTS "idx_messages_parent_hash"
    ON "messages" ("parent_hash");
CREATE UNIQUE INDEX IF NOT EXISTS "idx_parts_message_hash_position"
    ON "parts" ("message_hash", "position");
CREATE INDEX IF NOT EXISTS "idx_part_fragments_fragment_id"
    ON "part_fragments" ("fragment_id");
CREATE INDEX IF NOT EXISTS "idx_turns_thread_id"
    ON "turns" ("thread_id");
CREATE INDEX IF NOT EXISTS "idx_turn_fragments_fragment_id"
    ON "turn_fragments" ("fragment_id");
CREATE UNIQUE INDEX IF NOT EXISTS "idx_turn_search_turn_id"
    ON "turn_search" ("turn_id");
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
CREATE VIRTUAL TABLE IF NOT EXISTS "turn_search_fts" USING FTS5 (
    "prompt", "response",
    content="turn_search"
)
/* turn_search_fts(prompt,response) */;
CREATE TRIGGER IF NOT EXISTS "turn_search_ai" AFTER INSERT ON "turn_search" BEGIN
  INSERT INTO "turn_search_fts" (rowid, "prompt", "response") VALUES (new.rowid, new."prompt", new."response");
END;
CREATE TRIGGER IF NOT EXISTS "turn_search_ad" AFTER DELETE ON "turn_search" BEGIN
  INSERT INTO "turn_search_fts" ("turn_search_fts", rowid, "prompt", "response") VALUES('delete', old.rowid, old."prompt", old."response");
END;
CREATE TRIGGER IF NOT EXISTS "turn_search_au" AFTER UPDATE ON "turn_search" BEGIN
  INSERT INTO "turn_search_fts" ("turn_search_fts", rowid, "prompt", "response") VALUES('delete', old.rowid, old."prompt", old."response");
  INSERT INTO "turn_search_fts" (rowid, "prompt", "response") VALUES (new.rowid, new."prompt", new."response");
END;
CREATE TABLE IF NOT EXISTS "tool_instantiations" (
   "turn_id" TEXT REFERENCES "turns"("id"),
   "tool_call_id" TEXT,
   "instance_id" INTEGER REFERENCES "tool_instances"("id"),
   PRIMARY KEY ("turn_id", "tool_call_id")
);
CREATE VIEW IF NOT EXISTS "message_tree" AS with recursive msg as (
  select m.hash, m.parent_hash, m.role, m.rowid as rid,
    replace(coalesce(
      nullif(p.text, ''),
      (select f.content from part_fragments pf
       join fragments f on f.id = pf.fragment_id
       where pf.part_id = p.id
       order by pf."order" limit 1),
      '[' || coalesce(p.type, 'empty') || ']'
    ), char(10), ' ') as text,
    (select group_concat(p2.tool_name, ', ') from parts p2
     where p2.message_hash = m.hash and p2.type = 'tool_result'
       and p2.tool_name is not null) as tools
  from messages m
  left join parts p on p.message_hash = m.hash and p.position = 0
),
tree as (
  select hash, text, tools, 0 as depth,
    printf('%012d', rid) as path, hash as root_hash
  from msg where parent_hash is null
  union all
  select msg.hash, msg.text, msg.tools, t.depth + 1,
    t.path || '/' || printf('%012d', msg.rid),
    t.root_hash
  from msg join tree t on msg.parent_hash = t.hash
),
turn_chain as (
  select t.id as turn_id, t.datetime_utc, m.hash, m.parent_hash
  from turns t join messages m on m.hash = t.tip_message_hash
  union all
  select tc.turn_id, tc.datetime_utc, m.hash, m.parent_hash
  from turn_chain tc join messages m on m.hash = tc.parent_hash
)
select
  t.root_hash,
  strftime('%Y-%m-%d %H:%M:%S',
    (select min(tc.datetime_utc) from turn_chain tc where tc.hash = t.hash)
  ) as datetime,
  replace(hex(zeroblob(t.depth)), '00', '    ') || substr(t.text, 1, 60)
    as message,
  coalesce(t.tools, '') as tools,
  t.hash as message_hash,
  t.path
from tree t
order by t.path
/* message_tree(root_hash,datetime,message,tools,message_hash,path) */;
