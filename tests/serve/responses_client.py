#!/usr/bin/env python3
"""Checks `POST /v1/responses` of `llamabox serve` with the openai plugin through the
official `openai` client (`client.responses.create`).

Usage: python3 tests/serve/responses_client.py BASE_URL MODEL
       (BASE_URL like http://127.0.0.1:PORT/v1; needs `pip install openai`)

Prints `ok: NAME` for each check that passes and `FAIL: NAME: why` for each that
does not; exits 1 if any failed (2 on bad usage or a missing `openai` package).
"""

import json

import checks

(openai,) = checks.imports("openai")


def check_response(r, max_output):
    assert r.object == "response", f"object is {r.object!r}"
    assert r.id.startswith("resp_"), f"id is {r.id!r}"
    assert r.status in ("completed", "incomplete"), f"status is {r.status!r}"
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens", r.incomplete_details
    assert r.output and r.output[0].type == "message", f"output is {r.output!r}"
    assert r.output[0].role == "assistant"
    assert r.output_text, "empty output_text"
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= max_output, u
    assert u.total_tokens == u.input_tokens + u.output_tokens, u


def plain(client, model):
    r = client.responses.create(model=model, input="Say hi", max_output_tokens=16)
    check_response(r, 16)
    return repr(r.output_text)


def instructions(client, model):
    r = client.responses.create(
        model=model,
        instructions="You are a pirate. Answer in one short sentence.",
        input=[{"role": "user", "content": "Who are you?"}],
        max_output_tokens=24,
        temperature=0,
        store=False,
    )
    check_response(r, 24)
    assert r.instructions == "You are a pirate. Answer in one short sentence.", r.instructions
    return repr(r.output_text)


def streamed(client, model):
    events = list(client.responses.create(model=model, input="Say hi", max_output_tokens=16, stream=True))
    names = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas, f"no deltas in {names}"
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert names[:4] == head, names[:4]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert names[-4:-1] == tail, names[-4:]
    assert names[-1] in ("response.completed", "response.incomplete"), names[-1]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(deltas)
    done = events[-1].response
    check_response(done, 16)
    assert done.output_text == text, f"{done.output_text!r} != {text!r}"
    return f"{len(deltas)} deltas: {text!r}"


def json_object(client, model):
    r = client.responses.create(
        model=model,
        input="Give a JSON object with a key 'a' set to 1.",
        text={"format": {"type": "json_schema", "name": "a", "strict": True,
                         "schema": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}},
                                    "required": ["a"], "additionalProperties": False}}},
        max_output_tokens=32,
        temperature=0,
    )
    check_response(r, 32)
    value = json.loads(r.output_text)
    assert isinstance(value.get("a"), int), value
    return r.output_text


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city today",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}


def function_tools(client, model):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=model, input=question, tools=[WEATHER], tool_choice="required",
                                max_output_tokens=64, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls, f"no call in {r.output!r}"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id, call
    assert isinstance(json.loads(call.arguments).get("city"), str), call.arguments
    follow = question + [item.model_dump(exclude_none=True) for item in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    r2 = client.responses.create(model=model, input=follow, tools=[WEATHER], tool_choice="none",
                                 max_output_tokens=24, temperature=0)
    check_response(r2, 24)
    events = list(client.responses.create(model=model, input=question, tools=[WEATHER], tool_choice="required",
                                          max_output_tokens=64, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == call.arguments, [e.type for e in events]
    # Streamed as they are decoded: the arguments come in pieces that add up to them.
    pieces = [e.delta for e in events
              if e.type == "response.function_call_arguments.delta" and e.item_id == done[0].item_id]
    assert len(pieces) > 2 and "".join(pieces) == call.arguments, pieces
    return f"{call.name}({call.arguments}) -> {r2.output_text!r}"


def refused(client, model):
    # No state is kept: asking for it is refused by name, and nothing can be retrieved.
    for field, kwargs in (("previous_response_id", {"previous_response_id": "resp_1"}), ("store", {"store": True})):
        try:
            client.responses.create(model=model, input="x", **kwargs)
            raise AssertionError(f"{field} was accepted")
        except openai.BadRequestError as e:
            assert e.body.get("param") == field, e.body
    r = client.responses.create(model=model, input="Say hi", max_output_tokens=4)
    assert r.store is False, r.store
    try:
        client.responses.retrieve(r.id)
        raise AssertionError("a response was retrieved")
    except openai.NotFoundError as e:
        assert "stores no responses" in e.body.get("message", ""), e.body
        return e.body.get("message")


def main():
    base_url, model = checks.arguments(__doc__, 2)
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    checks.run((plain, instructions, streamed, json_object, function_tools, refused), client, model)


if __name__ == "__main__":
    main()
