"""The request-field policy and the prompt-logprobs shape in-process (no server): unknown names are logged
once each and at most `MAX_LOGGED_NAMES` of them; refusals name the field, nested ones by their path;
ranks are known for the top k only."""

from __future__ import annotations

import logging

import pytest

from bridge.serve.errors import ApiError
from bridge.serve.protocol import ChatCompletionRequest, CompletionRequest
from bridge.serve.request_fields import MAX_LOGGED_NAMES, UNKNOWN_FIELDS, check_request_fields
from bridge.serve.response_extras import prompt_logprobs_json


@pytest.fixture
def fresh_log():
    UNKNOWN_FIELDS.reset()
    yield
    UNKNOWN_FIELDS.reset()


def test_unknown_names_are_logged_once_each_and_boundedly(fresh_log, caplog):
    caplog.set_level(logging.WARNING, logger="bridge.serve")
    names = {f"made_up_{i}": i for i in range(MAX_LOGGED_NAMES + 50)}
    for _ in range(2):
        check_request_fields(CompletionRequest(prompt="x", **names))
    lines = [r.getMessage() for r in caplog.records]
    assert sum("is not one this server knows" in line for line in lines) == MAX_LOGGED_NAMES
    assert sum("further ones are ignored" in line for line in lines) == 1
    assert UNKNOWN_FIELDS.unlogged == 2 * 50


def test_refusals_name_the_field_and_its_path(fresh_log):
    with pytest.raises(ApiError) as info:
        check_request_fields(CompletionRequest(prompt="x", best_of=3))
    assert info.value.status == 400 and info.value.param == "best_of"
    check_request_fields(CompletionRequest(prompt="x", best_of=1, spaces_between_special_tokens=True,
                                           request_id="abc", truncation_side="left"))
    assistant = {"role": "assistant", "content": "b", "tool_calls": [{"id": "1"}]}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}, assistant])
    with pytest.raises(ApiError) as info:
        check_request_fields(chat)
    assert info.value.param == "messages[1].tool_calls"
    with pytest.raises(ApiError) as info:
        check_request_fields(ChatCompletionRequest(messages=[{"role": "user", "content": "a"}],
                                                   guided_json={"type": "object"}))
    assert info.value.param == "guided_json" and "structured_outputs" in info.value.message


def test_prompt_logprobs_ranks_are_known_for_the_top_k_only():
    # k = 1: position 1's prompt token (5) is the best; position 2's (7) is outside the top 1
    rows = prompt_logprobs_json([None, {5: -0.1}, {3: -0.2, 7: -3.0}], [9, 5, 7], 1, lambda t: f"<{t}>")
    assert rows[0] is None
    assert {t: v.model_dump() for t, v in rows[1].items()} == {
        "5": {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": "<5>"}}
    assert rows[2]["3"].rank == 1 and rows[2]["7"].rank is None
    rows = prompt_logprobs_json([None, {4: float("-inf")}], [1, 4], 0, str)
    assert rows[1]["4"].logprob == -9999.0 and rows[1]["4"].rank is None  # k = 0: no rank known
