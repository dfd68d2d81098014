#!/usr/bin/env python3
"""Checks `llamabox serve` with the openai plugin through the official `openai` client.

Usage: python3 tests/serve/openai_client.py BASE_URL MODEL
       (BASE_URL like http://127.0.0.1:PORT/v1; needs `pip install openai jsonschema`)

Prints `ok: NAME` for each check that passes and `FAIL: NAME: why` for each that
does not; exits 1 if any failed (2 on bad usage or a missing `openai` package).
"""

import json
import math
import sys
import time

import checks

jsonschema, openai = checks.imports("jsonschema", "openai")

# Structured output: everything bounded, so a greedy answer always ends inside max_tokens.
LLAMA_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "colors": {"type": "array", "items": {"enum": ["white", "brown", "black"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city today",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                       "required": ["city"], "additionalProperties": False}}},
]

QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]


def check_usage(usage, max_completion):
    assert usage is not None, "no usage"
    assert usage.prompt_tokens > 0, f"prompt_tokens is {usage.prompt_tokens}"
    assert 0 < usage.completion_tokens <= max_completion, f"completion_tokens is {usage.completion_tokens}"
    total = usage.prompt_tokens + usage.completion_tokens
    assert usage.total_tokens == total, f"total_tokens {usage.total_tokens} != {usage.prompt_tokens} + {usage.completion_tokens}"


def main():
    base_url, model = checks.arguments(__doc__, 2)
    client = openai.OpenAI(base_url=base_url, api_key="llamabox", max_retries=0, timeout=300)
    failures = []
    found = {}

    def check(name, fn):
        try:
            fn()
        except openai.APIConnectionError as e:  # no server: nothing else can pass
            print(f"FAIL: {name}: cannot reach {base_url}: {e.__cause__ or e}", flush=True)
            sys.exit(1)
        except Exception as e:  # every other failure is reported, then the next check runs
            failures.append(name)
            print(f"FAIL: {name}: {type(e).__name__}: {e}", flush=True)
        else:
            print(f"ok: {name}", flush=True)

    def models():
        ids = [m.id for m in client.models.list()]
        assert model in ids, f"{model!r} is not among the served models {ids}"
        card = client.models.retrieve(model)
        assert card.id == model and card.object == "model", card
        # When the server loaded it: a real time, not 0, and not in the future.
        assert 1_700_000_000 < card.created <= time.time(), card
        try:
            client.models.retrieve("no-such-model")
        except openai.NotFoundError:
            pass
        else:
            raise AssertionError("an unknown model was retrieved")

    def chat():
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
        assert r.object == "chat.completion", f"object is {r.object!r}"
        assert r.model == model, f"model is {r.model!r}"
        assert len(r.choices) == 1, f"{len(r.choices)} choices"
        content = r.choices[0].message.content
        assert isinstance(content, str) and content, f"content is {content!r}"
        assert r.choices[0].message.role == "assistant", f"role is {r.choices[0].message.role!r}"
        assert r.choices[0].finish_reason in ("stop", "length"), f"finish_reason is {r.choices[0].finish_reason!r}"
        check_usage(r.usage, 16)
        found["chat"] = content
        found["chat_usage"] = r.usage

    def chat_stream():
        stream = client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finish, usage, chunks = [], None, None, 0
        for chunk in stream:
            chunks += 1
            assert chunk.object == "chat.completion.chunk", f"object is {chunk.object!r}"
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason is not None:
                    finish = choice.finish_reason
        text = "".join(pieces)
        assert finish in ("stop", "length"), f"finish_reason is {finish!r}"
        assert len(pieces) > 1, f"the answer came in {len(pieces)} piece(s), not streamed token by token"
        if "chat" in found:
            assert text == found["chat"], f"streamed {text!r} != non-streamed {found['chat']!r}"
            check_usage(usage, 16)
            assert usage.completion_tokens == found["chat_usage"].completion_tokens, "streamed usage differs"

    def completion():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert r.object == "text_completion", f"object is {r.object!r}"
        text = r.choices[0].text
        assert isinstance(text, str) and text, f"text is {text!r}"
        assert r.choices[0].finish_reason in ("stop", "length"), f"finish_reason is {r.choices[0].finish_reason!r}"
        check_usage(r.usage, 8)
        found["completion"] = text

    def completion_stream():
        stream = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True)
        pieces, finish = [], None
        for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        assert finish in ("stop", "length"), f"finish_reason is {finish!r}"
        if "completion" in found:
            assert "".join(pieces) == found["completion"], f"streamed {''.join(pieces)!r} != {found['completion']!r}"

    def embeddings():
        inputs = ["The llama is in the box.", "A completely different sentence about the sea."]
        # The client asks for base64 unless told otherwise; check both encodings.
        r = client.embeddings.create(model=model, input=inputs)
        vectors = [d.embedding for d in sorted(r.data, key=lambda d: d.index)]
        assert len(vectors) == 2, f"{len(vectors)} vectors"
        n = len(vectors[0])
        assert n > 0 and len(vectors[1]) == n, f"lengths {[len(v) for v in vectors]}"
        assert all(math.isfinite(x) for v in vectors for x in v), "a value is not finite"
        assert vectors[0] != vectors[1], "two different inputs gave the same vector"
        assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, f"usage {r.usage}"
        floats = client.embeddings.create(model=model, input=inputs, encoding_format="float")
        again = [d.embedding for d in sorted(floats.data, key=lambda d: d.index)]
        assert all(abs(a - b) <= 1e-6 for u, v in zip(vectors, again) for a, b in zip(u, v)), "float and base64 differ"

    def bad_request():
        try:
            # Low-level post: the typed method would not send a request without messages.
            client.post("/chat/completions", body={"model": model}, cast_to=object)
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            assert body.get("param") == "messages", f"param is {body.get('param')!r} in {e.body!r}"
        else:
            raise AssertionError("a chat completion without messages did not fail")

    def structured_json_schema():
        ask = [{"role": "user", "content": "Describe a llama as JSON."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "llama", "strict": True, "schema": LLAMA_SCHEMA}}
        r = client.chat.completions.create(model=model, messages=ask, max_tokens=64, temperature=0, response_format=fmt)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason!r}: {text!r}"
        jsonschema.validate(json.loads(text), LLAMA_SCHEMA)
        # Without the schema the same request is not this JSON (the field is honoured).
        plain = client.chat.completions.create(model=model, messages=ask, max_tokens=64, temperature=0)
        assert plain.choices[0].message.content != text, "response_format changed nothing"

    def structured_json_object():
        ask = [{"role": "user", "content": "Reply with a JSON object with one key, answer, saying yes."}]
        r = client.chat.completions.create(model=model, messages=ask, max_tokens=96, temperature=0, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.startswith("{"), text

    def logprobs_chat():
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
        choice = r.choices[0]
        content = choice.logprobs.content
        assert len(content) == r.usage.completion_tokens, f"{len(content)} entries for {r.usage.completion_tokens} tokens"
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3, entry
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True) and sum(math.exp(t) for t in tops) <= 1 + 1e-4, tops
            # Greedy picks the most likely token: it heads its own alternatives.
            assert entry.token == entry.top_logprobs[0].token and abs(entry.logprob - tops[0]) < 1e-6, entry
            assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token, entry
        if choice.finish_reason == "length":
            text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
            assert text == choice.message.content, f"{text!r} != {choice.message.content!r}"
        found["logprobs"] = [(e.token, e.logprob) for e in content]
        # Asked for without alternatives: the chosen token's only.
        bare = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0, logprobs=True)
        assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content), bare.choices[0].logprobs
        plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0)
        assert plain.choices[0].logprobs is None, "logprobs without asking"

    def logprobs_chat_stream():
        stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        entries = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
        assert [e.token for e in entries] == [t for t, _ in found["logprobs"]], "streamed tokens differ from the whole answer's"
        assert all(abs(e.logprob - lp) < 1e-3 for e, (_, lp) in zip(entries, found["logprobs"])), "streamed logprobs differ"

    def logprobs_completion():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2)
        lp, text = r.choices[0].logprobs, r.choices[0].text
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == r.usage.completion_tokens, lp
        assert all(len(t) == 2 for t in lp.top_logprobs), lp.top_logprobs
        assert all(max(t.values()) >= chosen - 1e-6 for t, chosen in zip(lp.top_logprobs, lp.token_logprobs)), lp
        assert lp.text_offset[0] == 0 and all(b - a == len(tok) for a, b, tok in zip(lp.text_offset, lp.text_offset[1:], lp.tokens)), lp
        if r.choices[0].finish_reason == "length":
            assert "".join(lp.tokens) == text, f"{lp.tokens} vs {text!r}"
        try:
            client.completions.create(model=model, prompt="x", max_tokens=1, logprobs=6)
        except openai.BadRequestError as e:
            assert e.body.get("param") == "logprobs", e.body
        else:
            raise AssertionError("logprobs=6 was accepted (OpenAI's bound is 5)")

    def n_choices():
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=1.0, seed=11, n=3)
        assert [c.index for c in r.choices] == [0, 1, 2], [c.index for c in r.choices]
        texts = [c.message.content for c in r.choices]
        assert all(texts) and len(set(texts)) > 1, f"three seeded draws all gave {texts[0]!r}"
        # The prompt is counted once; every choice's tokens count.
        assert r.usage.prompt_tokens == found["chat_usage"].prompt_tokens, r.usage
        assert 3 <= r.usage.completion_tokens <= 48 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage
        stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0, n=2, stream=True)
        ended, text = {}, {0: "", 1: ""}
        for chunk in stream:
            for c in chunk.choices:
                text[c.index] += c.delta.content or ""
                if c.finish_reason:
                    ended[c.index] = c.finish_reason
        assert sorted(ended) == [0, 1] and all(text.values()), (ended, text)
        try:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, n=5)
        except openai.BadRequestError as e:
            assert e.body.get("param") == "n", e.body
        else:
            raise AssertionError("n=5 was accepted above the bound of 4")

    def several_prompts():
        prompts = ["The capital of France is", "Llamas live in"]
        r = client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)
        assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices), r.choices
        alone = [client.completions.create(model=model, prompt=p, max_tokens=1, temperature=0).usage.prompt_tokens for p in prompts]
        assert r.usage.prompt_tokens == sum(alone) and 2 <= r.usage.completion_tokens <= 8, (r.usage, alone)
        r = client.completions.create(model=model, prompt=prompts, max_tokens=2, temperature=0, n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3], r.choices

    def tool_round_trip():
        ask = [{"role": "user", "content": "What is the weather like in Lima today?"}]
        r = client.chat.completions.create(model=model, messages=ask, max_tokens=320, temperature=0, tools=TOOLS, tool_choice="required")
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason!r}: {choice.message}"
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None, choice.message
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            assert call.type == "function" and call.id.startswith("call-"), call
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        # The answer goes back as a tool message; with tool_choice none the model answers in text.
        history = ask + [choice.message.model_dump(exclude_none=True)]
        history += [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees and sunny"} for c in calls]
        final = client.chat.completions.create(model=model, messages=history, max_tokens=24, temperature=0, tools=TOOLS, tool_choice="none")
        assert final.choices[0].message.tool_calls is None and final.choices[0].message.content, final.choices[0].message
        assert final.choices[0].finish_reason in ("stop", "length"), final.choices[0].finish_reason
        # The tool's answer reached the prompt: the same history without it is a shorter prompt.
        without = client.chat.completions.create(model=model, messages=history[:-len(calls)], max_tokens=1, temperature=0, tools=TOOLS, tool_choice="none")
        assert final.usage.prompt_tokens > without.usage.prompt_tokens, (final.usage, without.usage)

    def no_call_json_when_no_tool_may_be_called():
        # Three earlier calls in the history, shown to the model as the envelope's JSON
        # (SmolLM2's template shows no calls): before, with no tool to call now
        # (tool_choice none, or no tools), the model wrote that JSON as its answer (16
        # of 16 sampled answers). The answer is now held to the envelope's text.
        history = []
        for i, city in enumerate(["Lima", "Quito", "Bogota"]):
            call = {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
            history += [{"role": "user", "content": f"What is the weather in {city}?"},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": f"c{i}", "content": "18 degrees"}]
        history.append({"role": "user", "content": "What is the weather in Cusco?"})
        for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
            for seed in (1, 2):
                sampled = client.chat.completions.create(model=model, messages=history, max_tokens=24, n=4, seed=seed, **extra)
                for c in sampled.choices:
                    text = c.message.content or ""
                    assert c.message.tool_calls is None and "tool_calls" not in text and not text.lstrip().startswith("{"), (extra, c.message)

    def nested_pydantic_tool():
        # The SDK's own tool from nested Pydantic models: its parameters use $defs/$ref.
        from pydantic import BaseModel

        class Address(BaseModel):
            city: str
            country: str

        class Booking(BaseModel):
            name: str
            address: Address

        tool = openai.pydantic_function_tool(Booking)
        assert "$defs" in json.dumps(tool), tool
        ask = [{"role": "user", "content": "Book a table for Ana in Lima, Peru."}]
        r = client.chat.completions.parse(model=model, messages=ask, max_tokens=160, temperature=0, tools=[tool], tool_choice="required", parallel_tool_calls=False)
        call = r.choices[0].message.tool_calls[0]
        assert isinstance(call.function.parsed_arguments, Booking), call
        assert isinstance(call.function.parsed_arguments.address, Address), call

    def tool_choice_named_and_parallel():
        ask = [{"role": "user", "content": "What time is it in Tokyo, and what is the weather there?"}]
        named = {"type": "function", "function": {"name": "get_time"}}
        r = client.chat.completions.create(model=model, messages=ask, max_tokens=64, temperature=0, tools=TOOLS, tool_choice=named)
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"], calls
        jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[1]["function"]["parameters"])
        one = client.chat.completions.create(model=model, messages=ask, max_tokens=96, temperature=0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        assert len(one.choices[0].message.tool_calls) == 1, one.choices[0].message.tool_calls
        auto = client.chat.completions.create(model=model, messages=ask, max_tokens=64, temperature=0, tools=TOOLS)
        message = auto.choices[0].message
        if auto.choices[0].finish_reason == "tool_calls":
            assert message.tool_calls and all(c.function.name in ("get_weather", "get_time") for c in message.tool_calls), message
        else:
            # Answered in text: the envelope is unwrapped, no JSON shows.
            assert message.tool_calls is None and not message.content.startswith('{"response"'), message
        try:
            client.chat.completions.create(model=model, messages=ask, max_tokens=4, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
        except openai.BadRequestError as e:
            assert e.body.get("param") == "tool_choice", e.body
        else:
            raise AssertionError("a tool_choice naming no tool was accepted")

    def tool_calls_stream():
        ask = [{"role": "user", "content": "What is the weather like in Lima today?"}]
        stream = client.chat.completions.create(model=model, messages=ask, max_tokens=320, temperature=0, tools=TOOLS, tool_choice="required", stream=True)
        calls, finish, pieces = {}, None, 0
        for chunk in stream:
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    pieces += 1
                    call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                    call["id"] = d.id or call["id"]
                    call["name"] = (d.function.name if d.function else None) or call["name"]
                    call["arguments"] += (d.function.arguments if d.function else "") or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and calls, (finish, calls)
        # Streamed as they are decoded: the arguments come in pieces, not whole at the end.
        assert pieces > 2 * len(calls), f"{pieces} deltas for {len(calls)} calls"
        for call in calls.values():
            assert call["id"] and call["name"] == "get_weather", call
            jsonschema.validate(json.loads(call["arguments"]), TOOLS[0]["function"]["parameters"])

    def unsupported_fields():
        for field, kwargs in [("modalities", {"modalities": ["text", "audio"]}), ("top_logprobs", {"extra_body": {"top_logprobs": 2}})]:
            try:
                client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, **kwargs)
            except openai.BadRequestError as e:
                body = e.body if isinstance(e.body, dict) else {}
                assert body.get("param") == field, f"param is {body.get('param')!r} in {e.body!r}"
            else:
                raise AssertionError(f"{field} was accepted and ignored")
        for field, kwargs in [("echo", {"echo": True}), ("suffix", {"suffix": "!"}), ("best_of", {"best_of": 2})]:
            try:
                client.completions.create(model=model, prompt="x", max_tokens=1, **kwargs)
            except openai.BadRequestError as e:
                assert e.body.get("param") == field, e.body
            else:
                raise AssertionError(f"{field} was accepted and ignored")

    def sampler_extras():
        extra = {"top_k": 1, "min_p": 0.05, "typical_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": 32, "ignore_eos": True}
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0.8, seed=3, extra_body=extra)
        # ignore_eos: the answer runs to max_tokens whatever the model would end with.
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40, f"{r.choices[0].finish_reason} {r.usage}"

    def unknown_model():
        try:
            client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=1)
        except openai.NotFoundError:
            pass
        else:
            raise AssertionError("an unknown model did not fail with 404")

    # Each non-streamed request runs twice before its streamed twin. The server keeps
    # a request's context for the next one with the same settings, and a repeated prompt
    # reuses all of it but its last token, which changes the logits by llama.cpp's own
    # rounding for another batch split: the second answer and the streamed one are
    # computed alike, so they must be equal; the first need not be.
    check("models", models)
    check("chat", chat)
    check("chat-again", chat)
    check("chat-stream", chat_stream)
    check("completion", completion)
    check("completion-again", completion)
    check("completion-stream", completion_stream)
    check("embeddings", embeddings)
    check("bad-request", bad_request)
    check("unknown-model", unknown_model)
    check("structured-json-schema", structured_json_schema)
    check("structured-json-object", structured_json_object)
    check("logprobs-chat", logprobs_chat)
    check("logprobs-chat-stream", logprobs_chat_stream)
    check("logprobs-completion", logprobs_completion)
    check("n-choices", n_choices)
    check("several-prompts", several_prompts)
    check("tool-round-trip", tool_round_trip)
    check("no-call-json-when-no-tool-may-be-called", no_call_json_when_no_tool_may_be_called)
    check("nested-pydantic-tool", nested_pydantic_tool)
    check("tool-choice-named-and-parallel", tool_choice_named_and_parallel)
    check("tool-calls-stream", tool_calls_stream)
    check("unsupported-fields", unsupported_fields)
    check("sampler-extras", sampler_extras)
    if failures:
        print(f"{len(failures)} check(s) failed: {', '.join(failures)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
