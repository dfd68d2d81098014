// The JavaScript plugin: what the Rust demo does, in JavaScript (componentize-js).
//
// Opens a model and tokenizes; generates greedily on the host (the `generate`
// interface); starts a long decode and cancels it from a timer through pollables;
// makes bad calls and prints the named errors. Resources are freed with `using`
// (Symbol.dispose): the JS garbage collector does not free them.
//
// Arguments (after the host's `--`): --model NAME --prompt TEXT --generate N
// --long-tokens N --cancel-after-ms MS --threads N. Output lines are `key: value`.

import { Model, Context } from 'llamabox:inference/llm@0.1.1';
import { CancelToken } from 'llamabox:inference/cancel@0.1.1';
import { start } from 'llamabox:inference/generate@0.1.1';
import { poll } from 'wasi:io/poll@0.2.12';
import { subscribeDuration } from 'wasi:clocks/monotonic-clock@0.2.12';
import { getArguments } from 'wasi:cli/environment@0.2.12';

// A llamabox error arrives as a thrown ComponentError whose `payload` is the WIT
// variant `{ tag, val }` (not an `instanceof Error`).
function errorName(e) {
  if (!e || !e.payload || typeof e.payload.tag !== 'string') throw e;
  const { tag, val } = e.payload;
  return val === undefined ? tag : `${tag}: ${val}`;
}

function options(argv) {
  const o = { model: 'default', prompt: 'The llama in the box', generate: '16',
              'long-tokens': '512', 'cancel-after-ms': '20', threads: '1' };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in o)) throw new Error(`unknown flag ${argv[i]}`);
    o[key] = argv[i + 1];
  }
  return o;
}

const greedy = () => ({ logitBias: [] });

function sequence(tokens) {
  const n = tokens.length;
  return { tokens, positions: Array.from(tokens, (_, i) => i),
           seqIds: new Array(n).fill(0), logits: Array.from(tokens, (_, i) => i + 1 === n) };
}

function hostGenerate(model, ctx, prompt, maxTokens) {
  const tokens = Array.from(model.tokenize(prompt, true, true));
  ctx.clear();
  using token = new CancelToken();
  using generation = start(ctx, { prompt: tokens, seq: 0, maxTokens, stop: [], sampler: greedy() }, token);
  const ids = [];
  for (let piece; (piece = generation.next()) !== undefined;) ids.push(...piece.tokens);
  console.log(`host-generated-ids: ${ids.join(',')}`);
  console.log(`host-finish: ${generation.finishReason().tag}`);
}

function cancelLongDecode(model, ctx, longTokens, afterMs) {
  ctx.clear();
  const filler = Array.from(model.tokenize(' the llama in the box', false, false));
  const tokens = Array.from({ length: longTokens }, (_, i) => filler[i % filler.length]);
  using token = new CancelToken();
  using pending = ctx.startDecode(sequence(tokens), token);
  using ready = pending.subscribe();
  using timer = subscribeDuration(BigInt(afterMs) * 1_000_000n);
  if (!Array.from(poll([ready, timer])).includes(0)) {
    token.cancel();
    ready.block();
  }
  try {
    pending.finish();
    console.log('long-decode: finished before the cancel');
  } catch (e) {
    console.log(`long-decode: ${errorName(e)}`);
  }
  console.log(`memory-after: seq-pos-max=${ctx.seqPosMax(0)}`);
  // `using` disposes in reverse order: timer, pollable, then the call (any order works).
}

function badCalls(ctx) {
  try {
    Model.open('no-such-model');
  } catch (e) {
    console.log(`bad-model: ${errorName(e)}`);
  }
  using token = new CancelToken();
  try {
    ctx.decode({ tokens: [1, 2], positions: [0], seqIds: [0, 0], logits: [true, true] }, token);
  } catch (e) {
    console.log(`bad-batch: ${errorName(e)}`);
  }
}

export const run = {
  run() {
    const o = options(getArguments().slice(1));
    const longTokens = Number(o['long-tokens']);
    using model = Model.open(o.model);
    let nCtx = 1;
    while (nCtx < Math.max(longTokens, 64) + 64) nCtx *= 2;
    using ctx = Context.create(model, { nCtx, nBatch: Math.max(longTokens, 64), nSeqMax: 1, nThreads: Number(o.threads) });
    console.log(`model: ${o.model} (vocab ${model.nVocab()}, embd ${model.nEmbd()})`);
    console.log(`prompt-tokens: ${Array.from(model.tokenize(o.prompt, true, true)).join(',')}`);
    hostGenerate(model, ctx, o.prompt, Number(o.generate));
    cancelLongDecode(model, ctx, longTokens, Number(o['cancel-after-ms']));
    badCalls(ctx);
  },
};
