"""Hypothesis strategies: arbitrary messages of every part kind."""

from __future__ import annotations

from hypothesis import strategies as st

from dagsync.message import (
    Attachment,
    AttachmentPart,
    Message,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

text = st.text(max_size=40)
small_text = st.text(max_size=12)

# provider_metadata may hold anything JSON has except floats (the contract refuses them).
json_no_floats = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | small_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(small_text, children, max_size=3),
    max_leaves=8,
)
provider_metadata = st.none() | st.dictionaries(small_text, json_no_floats, max_size=3)

# Tool arguments are plain JSON, floats included.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | small_text
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(small_text, children, max_size=3),
    max_leaves=8,
)

attachments = st.builds(
    Attachment,
    type=st.none() | st.sampled_from(["image/png", "image/jpeg", "application/pdf", ""]),
    url=st.none() | st.just("https://example.com/a.png") | st.just(""),
    path=st.none() | st.just("/tmp/a.png"),
    content=st.none() | st.binary(max_size=24),
)

parts = st.one_of(
    st.builds(TextPart, text=text, provider_metadata=provider_metadata),
    st.builds(
        ReasoningPart,
        text=text,
        redacted=st.booleans(),
        token_count=st.none() | st.integers(0, 10_000),
        provider_metadata=provider_metadata,
    ),
    st.builds(
        ToolCallPart,
        name=small_text,
        arguments=st.dictionaries(small_text, json_values, max_size=3),
        tool_call_id=st.none() | small_text,
        server_executed=st.booleans(),
        provider_metadata=provider_metadata,
    ),
    st.builds(
        ToolResultPart,
        name=small_text,
        output=text,
        tool_call_id=st.none() | small_text,
        server_executed=st.booleans(),
        exception=st.none() | small_text,
        attachments=st.lists(attachments, max_size=2),
        provider_metadata=provider_metadata,
    ),
    st.builds(AttachmentPart, attachment=st.none() | attachments, provider_metadata=provider_metadata),
)

messages = st.builds(
    Message,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    parts=st.lists(parts, max_size=4),
    provider_metadata=provider_metadata,
)

chains = st.lists(messages, min_size=1, max_size=6)
