"""The content-hash contract (spec/dag-format.md): pinned by vectors, laws by hypothesis."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dagsync.canonical import canonical_json, content_hash, row_content_hash
from dagsync.errors import HashContractError
from dagsync.message import Attachment, AttachmentPart, Message, ReasoningPart, TextPart, ToolCallPart
from dagsync.store import part_from_row, part_row
from tests.conftest import DATA, SHARED
from tests.strategies import messages

VECTORS = json.loads((DATA / "canonical-vectors.json").read_text())


class TestPinnedVectors:
    def test_the_suite_holds_all_fourteen(self):
        assert len(VECTORS) == 14

    @pytest.mark.skipif(not (SHARED / "spec").exists(), reason="no ../shared beside this checkout")
    def test_our_copy_matches_the_spec(self):
        assert json.loads((SHARED / "spec" / "canonical-vectors.json").read_text()) == VECTORS

    @pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["content_hash"][:8])
    def test_canonical_json_and_hash(self, vector):
        message = Message.from_dict(vector["message"])
        assert canonical_json(message).decode("utf-8") == vector["canonical_json"]
        assert content_hash(message) == vector["content_hash"]


class TestRules:
    def test_empty_and_missing_provider_metadata_hash_alike(self):
        assert content_hash(Message("user", [TextPart("x", {})], {})) == content_hash(
            Message("user", [TextPart("x")])
        )

    def test_non_ascii_is_kept_as_utf8(self):
        assert "café".encode() in canonical_json(Message("user", [TextPart("café")]))

    def test_a_reasoning_token_count_of_zero_is_hashed(self):
        assert content_hash(Message("assistant", [ReasoningPart("t", token_count=0)])) != content_hash(
            Message("assistant", [ReasoningPart("t")])
        )

    def test_attachment_part_metadata_is_not_hashed(self):
        att = Attachment(type="image/png", content=b"\x00")
        assert content_hash(Message("user", [AttachmentPart(att, {"k": "v"})])) == content_hash(
            Message("user", [AttachmentPart(att)])
        )

    def test_floats_in_tool_arguments_are_allowed(self):
        assert len(content_hash(Message("assistant", [ToolCallPart("f", {"x": 1.5})]))) == 64


class TestFloatsAreRefused:
    @pytest.mark.parametrize(
        "message",
        [
            Message("user", [TextPart("x")], {"temperature": 0.5}),
            Message("user", [TextPart("x", {"nested": {"deep": [1, 2.0]}})]),
            Message("assistant", [ReasoningPart("x", provider_metadata={"f": float("nan")})]),
        ],
        ids=["message-level", "part-level-nested", "nan"],
    )
    def test_float_in_provider_metadata(self, message):
        with pytest.raises(HashContractError, match="provider_metadata cannot be hashed"):
            content_hash(message)

    def test_exact_message(self):
        with pytest.raises(HashContractError) as info:
            content_hash(Message("user", [], {"t": 0.5}))
        assert str(info.value) == (
            "a float (0.5) in message provider_metadata cannot be hashed: the "
            "content-hash contract allows only ints, strings, booleans, null, "
            "lists and objects there (store the number as a string)"
        )


class TestLaws:
    @given(messages)
    def test_hash_is_64_lowercase_hex(self, message):
        digest = content_hash(message)
        assert len(digest) == 64 and digest == digest.lower() and int(digest, 16) >= 0

    @given(messages)
    def test_dict_round_trip_keeps_the_hash(self, message):
        again = Message.from_dict(json.loads(json.dumps(message.to_dict())))
        assert again == message
        assert content_hash(again) == content_hash(message)

    @given(messages)
    def test_canonical_json_is_sorted_and_compact(self, message):
        raw = canonical_json(message).decode("utf-8")
        assert raw == json.dumps(json.loads(raw), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


# -- straight from stored rows: row_content_hash is content_hash of the objects ------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)
_attachment_dicts = st.fixed_dictionaries({}, optional={
    "type": st.none() | st.sampled_from(["", "image/png"]),
    "url": st.none() | st.sampled_from(["", "https://x/y"]),
    "path": st.none() | st.sampled_from(["", "/tmp/a"]),
    "content": st.none() | st.sampled_from(["", "aGk=", "aGk", "a?Gk="]),
})  # fmt: skip
_part_json = st.none() | st.fixed_dictionaries({}, optional={
    "provider_metadata": st.none() | st.dictionaries(st.sampled_from(["a", "b"]), _json_values, max_size=2),
    "redacted": st.none() | st.booleans() | st.integers(0, 1),
    "token_count": st.none() | st.integers(0, 3),
    "name": st.text(max_size=3),
    "arguments": _json_values,
    "exception": st.none() | st.text(max_size=3),
    "attachments": st.lists(_attachment_dicts, max_size=2),
    "attachment": st.none() | _attachment_dicts,
    "type": st.none() | st.sampled_from(["", "image/png"]),
    "url": st.none() | st.sampled_from(["", "https://x/y"]),
    "content": st.none() | st.sampled_from(["", "aGk="]),
}).map(json.dumps)  # fmt: skip
_part_rows = st.tuples(
    st.sampled_from(["text", "reasoning", "tool_call", "tool_result", "attachment"]),
    st.none() | st.text(max_size=5),
    _part_json,
    st.none() | st.text(max_size=3),
    st.none() | st.integers(0, 1),
)


def _by_objects(role: str, pm_json: str | None, rows: list[tuple]) -> str:
    parts = tuple(part_from_row(*row) for row in rows)
    return content_hash(Message(role=role, parts=parts, provider_metadata=json.loads(pm_json) if pm_json else None))


def _outcome(fn, *args) -> object:
    try:
        return fn(*args)
    except Exception as exc:  # the two paths must fail alike too
        return type(exc)


@given(messages)
def test_row_hash_of_stored_rows_is_the_content_hash(message: Message) -> None:
    rows = [part_row(p) for p in message.parts]
    pm_json = json.dumps(message.provider_metadata) if message.provider_metadata else None
    assert row_content_hash(message.role, pm_json, rows) == content_hash(message)


@given(
    st.sampled_from(["user", "assistant", "tool"]),
    st.none() | st.dictionaries(st.sampled_from(["a", "b"]), _json_values, max_size=2).map(json.dumps),
    st.lists(_part_rows, max_size=3),
)
def test_row_hash_of_any_rows_matches_the_object_path(role: str, pm_json: str | None, rows: list[tuple]) -> None:
    """Rows as any writer may leave them (the branch's too): both paths agree, or both fail alike."""
    assert _outcome(row_content_hash, role, pm_json, rows) == _outcome(_by_objects, role, pm_json, rows)
