"""The Responses API (`POST /v1/responses`) and `GET /v1/models/{id}` on a real `pdserve worker`
(tiny random Llama checkpoint), driven by the real `openai` client: the answer is the chat
answer of the same request, streamed or not, in Responses' shape and event sequence."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.worker.test_server_harness import WorkerProcess

NAME = "tiny-llama"
GREEDY = dict(model=NAME, temperature=0, extra_body={"ignore_eos": True})
INSTRUCTIONS = "You answer briefly."
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", NAME, "--max-model-len", "256",
                       "--kv-cache-memory", str(32 << 20), "--log-level", "warning") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


def _chat_text(client, text: str, max_tokens: int) -> tuple[str, object]:
    r = client.chat.completions.create(messages=[{"role": "system", "content": INSTRUCTIONS},
                                                 {"role": "user", "content": text}], max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content, r.usage


def test_responses_equals_chat(client):
    want, usage = _chat_text(client, "Tell me about Paris.", 9)
    r = client.responses.create(input="Tell me about Paris.", instructions=INSTRUCTIONS, max_output_tokens=9, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == want and want
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # it hit the limit
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens


def test_message_items_and_text_parts(client):
    want, _ = _chat_text(client, "Hello there", 5)
    r = client.responses.create(input=[{"role": "system", "content": INSTRUCTIONS},
                                       {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
                                max_output_tokens=5, **GREEDY)
    assert r.output_text == want


def test_streamed_events(client):
    whole = client.responses.create(input="Count to ten.", max_output_tokens=8, **GREEDY)
    events = list(client.responses.create(input="Count to ten.", max_output_tokens=8, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == EVENTS and kinds[-4:] == CLOSING + ["response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 8
    assert events[0].response.status == "in_progress"


def test_unsupported_fields_are_400(worker, client):
    url = f"{worker.url}/v1/responses"
    for body, param in [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
                        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input.0"),
                        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
                        ({}, "input")]:
        r = httpx.post(url, json={"model": NAME, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="x")


def test_model_by_id(client, worker):
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model" and card.max_model_len == 256
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
