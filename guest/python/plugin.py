"""The Python plugin: what the Rust demo does, in Python (componentize-py).

Opens a model and tokenizes; generates greedily on the host (the `generate`
interface); starts a long decode and cancels it from a timer through pollables; makes
bad calls and prints the named errors. Resources are left to the garbage collector,
in whatever order it picks (the host allows any drop order).

Arguments (after the host's `--`): --model NAME --prompt TEXT --generate N
--long-tokens N --cancel-after-ms MS --threads N. Output lines are `key: value`.
"""

import sys

from wit_world import exports
from componentize_py_types import Err
from wit_world.imports import generate, llm, monotonic_clock, poll
from wit_world.imports.cancel import CancelToken
from wit_world.imports.types import Error_Cancelled


def error_name(err: Err) -> str:
    """`Error_InvalidArgument("...")` -> `invalid-argument: ...`."""
    kind = type(err.value).__name__.removeprefix("Error_")
    name = "".join("-" + c.lower() if c.isupper() else c for c in kind).lstrip("-")
    detail = getattr(err.value, "value", None)
    return name if detail is None else f"{name}: {detail}"


def options(argv):
    o = {"model": "default", "prompt": "The llama in the box", "generate": "16",
         "long-tokens": "512", "cancel-after-ms": "20", "threads": "1"}
    args = iter(argv)
    for flag in args:
        key = flag.removeprefix("--")
        if key not in o:
            raise SystemExit(f"unknown flag {flag}")
        o[key] = next(args)
    return o


def greedy():
    return generate.greedy_sampler()


def sequence(tokens, first=0):
    n = len(tokens)
    return llm.Batch(tokens=list(tokens), positions=list(range(first, first + n)),
                     seq_ids=[0] * n, logits=[i + 1 == n for i in range(n)])


def host_generate(model, ctx, prompt, max_tokens):
    tokens = model.tokenize(prompt, True, True)
    ctx.clear()
    params = generate.GenerateParams(prompt=tokens, seq=0, max_tokens=max_tokens,
                                     stop=[], sampler=greedy(), logprobs=None)
    generation = generate.start(ctx, params, CancelToken())
    ids = []
    while (piece := generation.next()) is not None:
        ids.extend(piece.tokens)
    print("host-generated-ids: " + ",".join(map(str, ids)))
    print(f"host-finish: {type(generation.finish_reason()).__name__}")


def cancel_long_decode(model, ctx, long_tokens, after_ms):
    """Start a long decode, cancel it from a timer: `cancelled`, memory untouched."""
    ctx.clear()
    filler = model.tokenize(" the llama in the box", False, False)
    tokens = (filler * (long_tokens // len(filler) + 1))[:long_tokens]
    token = CancelToken()
    pending = ctx.start_decode(sequence(tokens), token)
    ready = pending.subscribe()
    timer = monotonic_clock.subscribe_duration(after_ms * 1_000_000)
    if 0 not in poll.poll([ready, timer]):
        token.cancel()
        ready.block()
    try:
        pending.finish()
        print("long-decode: finished before the cancel")
    except Err as e:
        print("long-decode: " + ("cancelled" if isinstance(e.value, Error_Cancelled) else error_name(e)))
    print(f"memory-after: seq-pos-max={ctx.seq_pos_max(0)}")
    # The garbage collector's order, not Rust's: the call before its pollable.
    del pending
    del ready


def bad_calls(ctx):
    try:
        llm.Model.open("no-such-model")
    except Err as e:
        print("bad-model: " + error_name(e))
    try:
        ctx.decode(llm.Batch(tokens=[1, 2], positions=[0], seq_ids=[0, 0], logits=[True, True]),
                   CancelToken())
    except Err as e:
        print("bad-batch: " + error_name(e))


class Run(exports.Run):
    def run(self) -> None:
        o = options(sys.argv[1:])
        long_tokens = int(o["long-tokens"])
        model = llm.Model.open(o["model"])
        n_ctx = 1 << (max(long_tokens, 64) + 64 - 1).bit_length()
        ctx = llm.Context.create(model, llm.ContextParams(
            n_ctx=n_ctx, n_batch=max(long_tokens, 64), n_ubatch=None, n_seq_max=1,
            n_threads=int(o["threads"])))
        print(f"model: {o['model']} (vocab {model.n_vocab()}, embd {model.n_embd()})")
        print("prompt-tokens: " + ",".join(map(str, model.tokenize(o["prompt"], True, True))))
        host_generate(model, ctx, o["prompt"], int(o["generate"]))
        cancel_long_decode(model, ctx, long_tokens, int(o["cancel-after-ms"]))
        bad_calls(ctx)
        sys.stdout.flush()
