"""Messages and their parts: pure values, no storage.

A conversation in memory is a list of ``Message`` values. Two messages with
the same content are equal wherever they came from; identity (an id, a
parent) is a storage concern that lives in ``store.py``.

The five part kinds mirror llm's own (``llm.parts``), plus the reasoning
``token_count`` the dag format hashes. ``to_dict`` / ``from_dict`` use llm's
dict layout (attachment bytes as base64), so a dict from either side loads
here. All values are frozen; sequences are stored as tuples so that equality
does not depend on whether a caller passed a list or a tuple.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

__all__ = [
    "Attachment",
    "AttachmentPart",
    "Message",
    "Part",
    "ReasoningPart",
    "TextPart",
    "ToolCallPart",
    "ToolResultPart",
    "part_from_dict",
]


@dataclass(frozen=True)
class Attachment:
    """An image, audio clip or file: inline bytes, a URL or a local path."""

    type: str | None = None
    url: str | None = None
    path: str | None = None
    content: bytes | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field that is set, empty or not, so the dict loads back exactly
        (the content hash looks only at the non-empty ones)."""
        d: dict[str, Any] = {k: getattr(self, k) for k in ("type", "url", "path") if getattr(self, k) is not None}
        if self.content is not None:
            d["content"] = base64.b64encode(self.content).decode("ascii")
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Attachment:
        content = d.get("content")
        if isinstance(content, str):
            content = base64.b64decode(content)
        return Attachment(
            type=d.get("type"), url=d.get("url"), path=d.get("path"), content=content
        )


def _no_empty_metadata(value: object) -> None:
    """``None`` and ``{}`` mean the same (and hash alike): keep one spelling."""
    if not value.provider_metadata:  # type: ignore[attr-defined]
        object.__setattr__(value, "provider_metadata", None)


def with_metadata(d: dict[str, Any], provider_metadata: dict | None) -> dict:
    """``d`` with ``provider_metadata`` added when it is non-empty (llm's dict layout)."""
    if provider_metadata:
        d["provider_metadata"] = provider_metadata
    return d


@dataclass(frozen=True)
class TextPart:
    text: str = ""
    provider_metadata: dict[str, Any] | None = None
    type: ClassVar[str] = "text"

    def __post_init__(self) -> None:
        _no_empty_metadata(self)

    def to_dict(self) -> dict[str, Any]:
        return with_metadata({"type": "text", "text": self.text}, self.provider_metadata)


@dataclass(frozen=True)
class ReasoningPart:
    """Reasoning tokens. ``redacted=True, text=""`` marks withheld reasoning."""

    text: str = ""
    redacted: bool = False
    token_count: int | None = None
    provider_metadata: dict[str, Any] | None = None
    type: ClassVar[str] = "reasoning"

    def __post_init__(self) -> None:
        _no_empty_metadata(self)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "reasoning", "text": self.text}
        if self.redacted:
            d["redacted"] = True
        if self.token_count is not None:
            d["token_count"] = self.token_count
        return with_metadata(d, self.provider_metadata)


@dataclass(frozen=True)
class ToolCallPart:
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    tool_call_id: str | None = None
    server_executed: bool = False
    provider_metadata: dict[str, Any] | None = None
    type: ClassVar[str] = "tool_call"

    def __post_init__(self) -> None:
        _no_empty_metadata(self)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "type": "tool_call",
            "name": self.name,
            "arguments": self.arguments,
        }
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.server_executed:
            d["server_executed"] = True
        return with_metadata(d, self.provider_metadata)


@dataclass(frozen=True)
class ToolResultPart:
    name: str = ""
    output: str = ""
    tool_call_id: str | None = None
    server_executed: bool = False
    exception: str | None = None
    attachments: tuple[Attachment, ...] = ()
    provider_metadata: dict[str, Any] | None = None
    type: ClassVar[str] = "tool_result"

    def __post_init__(self) -> None:
        object.__setattr__(self, "attachments", tuple(self.attachments))
        _no_empty_metadata(self)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "tool_result", "name": self.name, "output": self.output}
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.server_executed:
            d["server_executed"] = True
        if self.exception is not None:
            d["exception"] = self.exception
        if self.attachments:
            d["attachments"] = [a.to_dict() for a in self.attachments]
        return with_metadata(d, self.provider_metadata)


@dataclass(frozen=True)
class AttachmentPart:
    attachment: Attachment | None = None
    provider_metadata: dict[str, Any] | None = None
    type: ClassVar[str] = "attachment"

    def __post_init__(self) -> None:
        _no_empty_metadata(self)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "attachment"}
        if self.attachment is not None:
            d["attachment"] = self.attachment.to_dict()
        return with_metadata(d, self.provider_metadata)


Part = Union[TextPart, ReasoningPart, ToolCallPart, ToolResultPart, AttachmentPart]


def part_from_dict(d: dict[str, Any]) -> Part:
    """Build a part from its dict; an unknown ``type`` is a ``ValueError``."""
    kind = d.get("type")
    pm = d.get("provider_metadata")
    if kind == "text":
        return TextPart(text=d["text"], provider_metadata=pm)
    if kind == "reasoning":
        return ReasoningPart(
            text=d["text"],
            redacted=bool(d.get("redacted", False)),
            token_count=d.get("token_count"),
            provider_metadata=pm,
        )
    if kind == "tool_call":
        return ToolCallPart(
            name=d["name"],
            arguments=d["arguments"],
            tool_call_id=d.get("tool_call_id"),
            server_executed=bool(d.get("server_executed", False)),
            provider_metadata=pm,
        )
    if kind == "tool_result":
        return ToolResultPart(
            name=d["name"],
            output=d["output"],
            tool_call_id=d.get("tool_call_id"),
            server_executed=bool(d.get("server_executed", False)),
            exception=d.get("exception"),
            attachments=tuple(Attachment.from_dict(a) for a in d.get("attachments", ())),
            provider_metadata=pm,
        )
    if kind == "attachment":
        att = d.get("attachment")
        return AttachmentPart(
            attachment=None if att is None else Attachment.from_dict(att), provider_metadata=pm
        )
    raise ValueError(f"unknown part type: {kind!r}")


@dataclass(frozen=True)
class Message:
    """One turn: a role and its ordered parts."""

    role: str
    parts: tuple[Part, ...] = ()
    provider_metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        _no_empty_metadata(self)

    def to_dict(self) -> dict[str, Any]:
        return with_metadata(
            {"role": self.role, "parts": [p.to_dict() for p in self.parts]},
            self.provider_metadata,
        )

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Message:
        return Message(
            role=d["role"],
            parts=tuple(part_from_dict(p) for p in d.get("parts", ())),
            provider_metadata=d.get("provider_metadata"),
        )
