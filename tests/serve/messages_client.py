#!/usr/bin/env python3
"""Checks `POST /v1/messages` and `/v1/messages/count_tokens` of `llamabox serve` with
the openai plugin through the official `anthropic` client.

Usage: python3 tests/serve/messages_client.py BASE_URL MODEL VISION_MODEL PNG_BASE64
       (BASE_URL like http://127.0.0.1:PORT; VISION_MODEL has a projector; needs
       `pip install anthropic jsonschema`)

Prints `ok: NAME` for each check that passes and `FAIL: NAME: why` for each that
does not; exits 1 if any failed (2 on bad usage or a missing package).
"""

import checks

anthropic, jsonschema = checks.imports("anthropic", "jsonschema")

# Greedy sampling. This SDK's `create` has no `temperature` parameter: the field goes
# in the body as the API takes it.
GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is a llama? Answer in two sentences."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


def text_of(message):
    return "".join(block.text for block in message.content if block.type == "text")


def check_message(m, max_tokens):
    assert m.type == "message" and m.role == "assistant", m
    assert m.id.startswith("msg_"), f"id is {m.id!r}"
    assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
    assert text_of(m), "no text"
    u = m.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) > 0, u
    assert 0 < u.output_tokens <= max_tokens, u


def models(client, model, _vision, _png):
    ids = [m.id for m in client.models.list()]
    assert model in ids, ids
    card = client.models.retrieve(model)
    assert card.id == model and card.type == "model", card
    return ids


def create_then_stream(client, model, _vision, _png):
    # Greedy; the second answer is computed on the context the first left (all of the
    # prompt but its last token reused), as the streamed one then is.
    ask = dict(model=model, max_tokens=24, extra_body=GREEDY, messages=QUESTION)
    client.messages.create(**ask)
    whole = client.messages.create(**ask)
    check_message(whole, 24)
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole), f"{streamed!r} != {text_of(whole)!r}"
    check_message(final, 24)
    assert text_of(final) == streamed
    assert final.usage.output_tokens == whole.usage.output_tokens, (final.usage, whole.usage)
    return repr(streamed)


def system_and_stop_sequence(client, model, _vision, _png):
    ask = dict(model=model, max_tokens=24, extra_body=GREEDY, system=[{"type": "text", "text": "You are a farmer."}],
               messages=QUESTION)
    whole = text_of(client.messages.create(**ask))
    words = whole.split()
    assert len(words) > 3, whole
    stop = " " + words[2]
    m = client.messages.create(**ask, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence", m
    assert m.stop_sequence == stop, m.stop_sequence
    assert text_of(m) == whole[: whole.index(stop)], (text_of(m), whole)
    return f"stopped at {stop!r}"


def count_tokens(client, model, _vision, _png):
    counted = client.messages.count_tokens(model=model, messages=QUESTION).input_tokens
    m = client.messages.create(model=model, max_tokens=1, messages=QUESTION)
    used = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert counted == used, f"counted {counted}, the answer used {used}"
    with_tools = client.messages.count_tokens(model=model, messages=QUESTION, tools=[WEATHER]).input_tokens
    assert with_tools > counted, f"tools add nothing: {with_tools} <= {counted}"
    return f"{counted} tokens, {with_tools} with a tool"


def tool_round_trip(client, model, _vision, _png):
    ask = dict(model=model, max_tokens=64, tools=[WEATHER],
               messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    m = client.messages.create(**ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use", m
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather", m.content
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    assert calls[0].id.startswith("toolu_"), calls[0].id
    history = ask["messages"] + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "22 degrees, sunny"}]},
    ]
    # Greedy: at temperature 1 an answer of a few tokens was now and then only
    # whitespace, which has no text block (make test saw it once).
    after = client.messages.create(model=model, max_tokens=24, tools=[WEATHER], tool_choice={"type": "none"},
                                   messages=history, extra_body=GREEDY)
    assert after.stop_reason in ("end_turn", "max_tokens"), after
    assert text_of(after), after
    # Streamed: the call's input arrives as input_json_delta and the SDK assembles it.
    # Streamed as it is decoded: the input comes in several pieces, not whole at the end.
    with client.messages.stream(**ask, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        pieces = sum(1 for e in stream if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert pieces > 2, f"the input came in {pieces} pieces"
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed, final
    jsonschema.validate(streamed[0].input, WEATHER["input_schema"])
    return f"{calls[0].input} -> {text_of(after)!r}"


def image_block(client, _model, vision, png):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    text = {"type": "text", "text": "What is in this picture?"}
    m = client.messages.create(model=vision, max_tokens=2, extra_body=GREEDY,
                               messages=[{"role": "user", "content": [image, text]}])
    with_image = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    counted = client.messages.count_tokens(model=vision, messages=[{"role": "user", "content": [image, text]}])
    assert counted.input_tokens == with_image, (counted, m.usage)
    text_only = client.messages.count_tokens(model=vision, messages=[{"role": "user", "content": [text]}])
    assert with_image > text_only.input_tokens, f"the image took no tokens: {with_image}"
    return f"{with_image - text_only.input_tokens} image tokens"


def errors(client, model, _vision, _png):
    try:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "bot", "content": "x"}])
        raise AssertionError("a bad role was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
        assert "messages[0].role" in e.body["error"]["message"], e.body
    try:
        client.messages.create(model=model, max_tokens=8, messages=QUESTION,
                               thinking={"type": "enabled", "budget_tokens": 1024})
        raise AssertionError("thinking was accepted")
    except anthropic.BadRequestError as e:
        assert "thinking" in e.body["error"]["message"], e.body
    try:
        client.messages.create(model="no-such-model", max_tokens=8, messages=QUESTION)
        raise AssertionError("an unknown model was accepted")
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body
    return "bad role, thinking and an unknown model refused in Anthropic's shape"


def main():
    base_url, model, vision, png = checks.arguments(__doc__, 4)
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    every = (models, create_then_stream, system_and_stop_sequence, count_tokens, tool_round_trip,
             image_block, errors)
    checks.run(every, client, model, vision, png)


if __name__ == "__main__":
    main()
