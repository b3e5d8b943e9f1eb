"""The llm format's own hashes, as llm 0.36 computes them (llm/logs.py, llm/models.py).

* a **message** is keyed by ``"b2:" + blake2b-128`` of the canonical JSON of
  ``{"parent": parent_hash, "message": {"role", "parts", "provider_metadata"}}``:
  a Merkle chain, so the key covers every message above it. Parts are
  ``Part.to_dict()`` with text that borrows fragments resolved and each
  attachment replaced by its content identity and type;
* a **fragment** is keyed (``fragments.hash``) by the sha256 of its content;
* an **attachment** (``attachments.id``) by the sha256 of its content, or of
  ``{"url": ...}`` for one that is only a URL (one read from a path has no
  content in the file and cannot be proven from it);
* a **schema** (``schemas.id``) by blake2b-128 of its JSON.

``verify`` re-hashes every row with these; ``merge`` every row it copies.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

__all__ = [
    "KEY_RECIPES", "attachment_id", "attachment_identity", "fragment_hash", "message_dict", "message_hash", "schema_id",
]  # fmt: skip

_KEEP = {
    # part type -> the keys llm's Part.to_dict writes, and when
    "text": ("text",),
    "reasoning": ("text", "redacted"),
    "tool_call": ("name", "arguments", "tool_call_id", "server_executed"),
    "tool_result": ("name", "output", "tool_call_id", "server_executed", "exception", "attachments"),
    "attachment": ("attachment",),
}

_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


def _part(payload: dict[str, Any], attachments: dict[str, dict]) -> dict[str, Any]:
    """llm's ``Part.to_dict()`` of a stored part, attachments as hashed (id and type)."""
    kind = payload["type"]
    d: dict[str, Any] = {"type": kind}
    for k in _KEEP.get(kind, ()):
        if k not in payload:
            continue
        value = payload[k]
        if k in ("redacted", "server_executed") and not value:
            continue
        if k in ("tool_call_id", "exception") and value is None:
            continue
        if k == "attachment":
            value = attachments[value["id"]]
        if k == "attachments":
            if not value:
                continue
            value = [attachments[ref["id"]] for ref in value]
        d[k] = value
    if kind in ("text", "reasoning") and "text" not in d:
        d["text"] = ""
    if payload.get("provider_metadata"):
        d["provider_metadata"] = payload["provider_metadata"]
    return d


def attachment_identity(att_type: str | None, att_path: str | None, url: str | None, content: bytes | None) -> dict[str, Any]:
    """llm's ``_canonical_attachment``: content identity plus the stored type."""
    if content:
        content_id = hashlib.sha256(content).hexdigest()
    elif att_path:
        try:
            with open(att_path, "rb") as f:
                content_id = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            content_id = f"missing:{att_path}"
    else:
        content_id = hashlib.sha256(json.dumps({"url": url}).encode("utf-8")).hexdigest()
    return {"id": content_id, "type": att_type}


def message_dict(
    role: str,
    provider_metadata: str | None,
    parts: list[tuple[str, str | None, str | None]],
    fragment: Callable[[int], str | None],
    attachment: Callable[[str], tuple | None],
) -> dict[str, Any]:
    """The message as llm hashes it, from its stored row and its ``parts`` rows
    ``(type, text, payload)`` in position order (payloads resolved, if packed).
    ``fragment(id)`` is a fragment's content, ``attachment(id)`` an attachment's
    ``(type, path, url, content)``; None for one that is missing.

    :raises LookupError, ValueError, KeyError, TypeError: a part that cannot be read back.
    """
    dicts = []
    for ptype, text, payload in parts:
        d = json.loads(payload) if payload else {}
        d["type"] = ptype
        if text is not None:
            d["text"] = text
        pieces = d.pop("text_ref", None)
        if pieces is not None:
            resolved = []
            for piece in pieces:
                if "literal" in piece:
                    resolved.append(piece["literal"])
                else:
                    content = fragment(piece["fragment"])
                    if content is None:
                        raise LookupError(f"fragment {piece['fragment']} it borrows text from is missing")
                    resolved.append(content)
            d["text"] = "".join(resolved)
        ids = [d["attachment"]["id"]] if ptype == "attachment" and "attachment" in d else [
            ref["id"] for ref in d.get("attachments") or ()
        ]  # fmt: skip
        attachments = {}
        for aid in ids:
            row = attachment(aid)
            if row is None:
                raise LookupError(f"attachment {aid} it refers to is missing")
            attachments[aid] = attachment_identity(*row)
        dicts.append(_part(d, attachments))
    message: dict[str, Any] = {"role": role, "parts": dicts}
    metadata = json.loads(provider_metadata) if provider_metadata else None
    if metadata:
        message["provider_metadata"] = metadata
    return message


def message_hash(message: dict[str, Any], parent: str | None) -> str:
    """The key llm gives ``message`` (``message_dict``) under ``parent``."""
    canonical = _ENCODE({"parent": parent, "message": message})
    return "b2:" + hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).hexdigest()


def fragment_hash(content: str | bytes) -> str:
    """A fragment's key: ``llm.utils.Fragment.id()``."""
    return hashlib.sha256(content if isinstance(content, bytes) else content.encode("utf-8")).hexdigest()


def attachment_id(url: str | None, content: bytes | None) -> str | None:
    """An attachment's key (``llm.models.Attachment.id()``), or None for one
    read from a path, whose bytes the file does not hold."""
    if isinstance(content, str):
        content = content.encode("utf-8")
    if content:
        return hashlib.sha256(content).hexdigest()
    if url is not None:
        return hashlib.sha256(json.dumps({"url": url}).encode("utf-8")).hexdigest()
    return None


def schema_id(content: str | bytes) -> str:
    """A schema's key: ``llm.utils.make_schema_id`` of the JSON it stores."""
    data = content if isinstance(content, bytes) else content.encode("utf-8")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _content_id(content: bytes | str | None) -> str | None:
    if isinstance(content, str):
        content = content.encode("utf-8")
    return hashlib.sha256(content).hexdigest() if content else None


# What a table's key is made of (``formats.KeyProof.recipe``): each takes the
# proof's columns, packed values resolved, and gives the key or None.
KEY_RECIPES: dict[str, Callable[..., str | None]] = {
    "fragment": lambda content: None if content is None else fragment_hash(content),
    "attachment": attachment_id,
    "attachment-content": _content_id,
    "schema": lambda content: None if content is None else schema_id(content),
}
