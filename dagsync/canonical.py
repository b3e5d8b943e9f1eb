"""The dag format's content-hash contract.

``content_hash(message) = sha256(canonical_json(message)).hexdigest()``: 64
lowercase hex characters, parent not included. A message's identity in a
database is ``(parent_id, content_hash)``, so **changing anything here changes
every hash** and splits every user's history into two halves that no longer
dedup or merge. The rules are spec/dag-format.md's "Content hash", step by
step, and the 14 vectors in tests/data/canonical-vectors.json pin them.

These rules are deliberately written out here rather than derived from
``Message.to_dict``: the dict layout may grow keys, the hash may not. Note
one place where they differ: an attachment part's ``provider_metadata`` is
stored but is not part of its hash.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from dagsync.errors import HashContractError
from dagsync.message import (
    Attachment,
    AttachmentPart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

__all__ = ["canonical_dict", "canonical_json", "content_hash", "row_content_hash"]


def _refuse_floats(value: Any, where: str) -> None:
    """Floats have more than one spelling; the contract forbids them (step 4)."""
    if isinstance(value, float):
        raise HashContractError(
            f"a float ({value!r}) in {where} provider_metadata cannot be hashed: "
            "the content-hash contract allows only ints, strings, booleans, "
            "null, lists and objects there (store the number as a string)"
        )
    if isinstance(value, dict):
        for item in value.values():
            _refuse_floats(item, where)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _refuse_floats(item, where)


def _metadata(d: dict[str, Any], pm: dict[str, Any] | None, where: str) -> dict:
    # None and {} hash alike: the key is present only when non-empty.
    if pm:
        _refuse_floats(pm, where)
        d["provider_metadata"] = pm
    return d


def _attachment(att: Attachment) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for key in ("type", "url", "path"):
        if getattr(att, key):
            d[key] = getattr(att, key)
    if att.content:
        d["content"] = base64.b64encode(att.content).decode("ascii")
    return d


def _part(part: Part) -> dict[str, Any]:
    """Step 2: the hashed dict of one part; keys absent when their condition fails."""
    if isinstance(part, TextPart):
        return _metadata({"type": "text", "text": part.text}, part.provider_metadata, "part")
    if isinstance(part, ReasoningPart):
        d: dict[str, Any] = {"type": "reasoning", "text": part.text}
        if part.redacted:
            d["redacted"] = True
        if part.token_count is not None:
            d["token_count"] = part.token_count
        return _metadata(d, part.provider_metadata, "part")
    if isinstance(part, ToolCallPart):
        d = {"type": "tool_call", "name": part.name, "arguments": part.arguments}
        if part.tool_call_id is not None:
            d["tool_call_id"] = part.tool_call_id
        if part.server_executed:
            d["server_executed"] = True
        return _metadata(d, part.provider_metadata, "part")
    if isinstance(part, ToolResultPart):
        d = {"type": "tool_result", "name": part.name, "output": part.output}
        if part.tool_call_id is not None:
            d["tool_call_id"] = part.tool_call_id
        if part.server_executed:
            d["server_executed"] = True
        if part.exception is not None:
            d["exception"] = part.exception
        if part.attachments:
            d["attachments"] = [_attachment(a) for a in part.attachments]
        return _metadata(d, part.provider_metadata, "part")
    if isinstance(part, AttachmentPart):
        d = {"type": "attachment"}
        if part.attachment is not None:
            d["attachment"] = _attachment(part.attachment)
        return d
    raise HashContractError(f"cannot hash a part of type {type(part).__name__}")


def canonical_dict(message: Message) -> dict[str, Any]:
    """Step 1: the dict that is serialised and hashed."""
    d = {"role": message.role, "parts": [_part(p) for p in message.parts]}
    return _metadata(d, message.provider_metadata, "message")


def canonical_json(message: Message) -> bytes:
    """Step 3: sorted keys at every depth, no whitespace, UTF-8 kept as is."""
    return json.dumps(
        canonical_dict(message), sort_keys=True, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")


def content_hash(message: Message) -> str:
    """The message's content hash: sha256 hex of its canonical JSON.

    :raises HashContractError: a float inside provider_metadata.
    """
    return hashlib.sha256(canonical_json(message)).hexdigest()


# -- straight from stored rows ------------------------------------------------------
#
# What ``content_hash(Message(parts=[store.part_from_row(*row) ...]))`` gives,
# without building the objects: a merge proves every message it copies with
# this, so it runs once per copied message. tests/test_canonical.py holds it
# equal to the object path on every message the strategies make.


def _row_attachment(d: dict[str, Any]) -> dict[str, Any]:
    out = {key: d[key] for key in ("type", "url", "path") if d.get(key)}
    content = d.get("content")
    if isinstance(content, str):
        content = base64.b64decode(content)
    if content:
        out["content"] = base64.b64encode(content).decode("ascii")
    return out


def _row_part(part_type: str, content: str | None, content_json: str | None, tool_call_id: str | None, server_executed: int | None) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(content_json) if content_json else {}
    pm = d.get("provider_metadata")
    if part_type == "text":
        return _metadata({"type": "text", "text": content or ""}, pm, "part")
    if part_type == "reasoning":
        out: dict[str, Any] = {"type": "reasoning", "text": content or ""}
        if d.get("redacted", False):
            out["redacted"] = True
        if d.get("token_count") is not None:
            out["token_count"] = d["token_count"]
        return _metadata(out, pm, "part")
    if part_type in ("tool_call", "tool_result"):
        if part_type == "tool_call":
            out = {"type": "tool_call", "name": d.get("name", ""), "arguments": d.get("arguments", {})}
        else:
            out = {"type": "tool_result", "name": d.get("name", ""), "output": content or ""}
        if tool_call_id is not None:
            out["tool_call_id"] = tool_call_id
        if server_executed:
            out["server_executed"] = True
        if part_type == "tool_result":
            if d.get("exception") is not None:
                out["exception"] = d["exception"]
            attachments = [_row_attachment(a) for a in d.get("attachments", ())]
            if attachments:
                out["attachments"] = attachments
        return _metadata(out, pm, "part")
    if part_type == "attachment":
        if not content_json or ("attachment" in d and d["attachment"] is None):
            return {"type": "attachment"}
        return {"type": "attachment", "attachment": _row_attachment(d)}
    raise ValueError(f"unknown part_type {part_type!r}")


def row_content_hash(role: str, provider_metadata_json: str | None, parts: list[tuple]) -> str:
    """The content hash of a message as stored: its row's role and provider
    metadata, and its ``message_parts`` rows ``(part_type, content,
    content_json, tool_call_id, server_executed)`` in order.

    :raises ValueError: a part that cannot be read back (bad JSON, an unknown type).
    :raises HashContractError: a float inside provider_metadata.
    """
    d = {"role": role, "parts": [_row_part(*part) for part in parts]}
    _metadata(d, json.loads(provider_metadata_json) if provider_metadata_json else None, "message")
    canonical = json.dumps(d, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
