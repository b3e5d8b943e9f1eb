"""Every content_hash MessageStore writes re-derives from its stored rows.

This reads the rows with the standard library's sqlite3 and rebuilds each
message's canonical JSON by spec/dag-format.md's rules ("Part rows" and
"Content hash"), written out again here on purpose: nothing from dagsync is
on the read path, so a store that wrote rows its own reader happens to
understand, but the spec does not, fails here.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import tempfile
from pathlib import Path

from hypothesis import given

from dagsync.store import MessageStore
from fixtures import family
from tests.strategies import chains


def _attachment(a: dict) -> dict:
    out = {k: a[k] for k in ("type", "url", "path") if a.get(k)}
    if a.get("content"):  # already standard padded base64 in the row
        out["content"] = a["content"]
    return out


def _part(part_type, content, content_json, tool_call_id, server_executed) -> dict:
    j = json.loads(content_json) if content_json else {}
    pm = j.get("provider_metadata")
    if part_type == "text":
        d = {"type": "text", "text": content}
    elif part_type == "reasoning":
        d = {"type": "reasoning", "text": content}
        if j.get("redacted"):
            d["redacted"] = True
        if j.get("token_count") is not None:
            d["token_count"] = j["token_count"]
    elif part_type == "tool_call":
        d = {"type": "tool_call", "name": j["name"], "arguments": j["arguments"]}
    elif part_type == "tool_result":
        d = {"type": "tool_result", "name": j["name"], "output": content}
        if j.get("exception") is not None:
            d["exception"] = j["exception"]
        if j.get("attachments"):
            d["attachments"] = [_attachment(a) for a in j["attachments"]]
    elif part_type == "attachment":
        d = {"type": "attachment"}
        if content_json is not None and not ("attachment" in j and j["attachment"] is None):
            d["attachment"] = _attachment(j)
        return d  # an attachment part's provider_metadata is not hashed
    else:
        raise AssertionError(f"unexpected part_type {part_type}")
    if part_type in ("tool_call", "tool_result"):
        if tool_call_id is not None:
            d["tool_call_id"] = tool_call_id
        if server_executed:
            d["server_executed"] = True
    if pm:
        d["provider_metadata"] = pm
    return d


def rehash_all(path: Path) -> int:
    """Assert every message's stored hash equals the one its rows give; return how many."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    checked = 0
    for mid, role, pm_json, stored in conn.execute(
        "SELECT id, role, provider_metadata_json, content_hash FROM messages WHERE id != 'root'"
    ):
        parts = conn.execute(
            'SELECT part_type, content, content_json, tool_call_id, server_executed '
            'FROM message_parts WHERE message_id = ? ORDER BY "order"',
            (mid,),
        ).fetchall()
        d = {"role": role, "parts": [_part(*p) for p in parts]}
        pm = json.loads(pm_json) if pm_json else None
        if pm:
            d["provider_metadata"] = pm
        raw = json.dumps(d, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
        assert hashlib.sha256(raw).hexdigest() == stored, f"message {mid} does not re-hash"
        checked += 1
    conn.close()
    return checked


@given(chains)
def test_any_saved_chain_rehashes_from_its_rows(chain):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.db"
        with MessageStore.open(path) as store:
            store.save_chain(chain)
        assert rehash_all(path) >= 1


def test_every_generated_message_rehashes(tmp_path):
    reports = family(tmp_path, seed=3, machines=2, conversations=60)
    for report in reports:
        assert rehash_all(report.path) == report.messages
