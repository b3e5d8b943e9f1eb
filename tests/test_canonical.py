"""The content-hash contract (spec/dag-format.md): pinned by vectors, laws by hypothesis."""

from __future__ import annotations

import json

import pytest
from hypothesis import given

from dagsync.canonical import canonical_json, content_hash
from dagsync.errors import HashContractError
from dagsync.message import Attachment, AttachmentPart, Message, ReasoningPart, TextPart, ToolCallPart
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
