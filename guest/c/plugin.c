// The C plugin: what the Rust demo does, in C (bindings from `wit-bindgen c` for the
// `plugin-command` world, built with Debian's clang and wasi-libc as a reactor, and
// made a component with wasmtime's preview 1 adapter; scripts/build-c-plugin.sh).
//
// Opens a model and tokenizes; generates greedily in wasm (decode, last-logits,
// argmax) and on the host (the `generate` interface); starts a long decode and cancels
// it from a timer through pollables; makes bad calls and prints the named errors.
//
// Arguments (after the host's `--`): --model NAME --prompt TEXT --generate N
// --long-tokens N --cancel-after-ms MS --threads N. Output lines are `key: value`.

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin_command.h"

// Shorter names for the generated types this plugin uses.
typedef llamabox_inference_types_error_t lb_error;
typedef llamabox_inference_llm_borrow_model_t lb_model;
typedef llamabox_inference_llm_borrow_context_t lb_context;
typedef llamabox_inference_llm_batch_t lb_batch;
typedef llamabox_inference_llm_list_token_t lb_tokens;

struct options {
  const char *model;
  const char *prompt;
  uint32_t generate;
  uint32_t long_tokens;
  uint64_t cancel_after_ms;
  uint32_t threads;
};

static int parse_options(int argc, char **argv, struct options *o) {
  *o = (struct options){"default", "The llama in the box", 16, 512, 20, 1};
  for (int i = 1; i < argc; i += 2) {
    const char *flag = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
    if (value == NULL) {
      fprintf(stderr, "c-plugin: %s needs a value\n", flag);
      return 0;
    }
    if (strcmp(flag, "--model") == 0) o->model = value;
    else if (strcmp(flag, "--prompt") == 0) o->prompt = value;
    else if (strcmp(flag, "--generate") == 0) o->generate = (uint32_t)strtoul(value, NULL, 10);
    else if (strcmp(flag, "--long-tokens") == 0) o->long_tokens = (uint32_t)strtoul(value, NULL, 10);
    else if (strcmp(flag, "--cancel-after-ms") == 0) o->cancel_after_ms = strtoull(value, NULL, 10);
    else if (strcmp(flag, "--threads") == 0) o->threads = (uint32_t)strtoul(value, NULL, 10);
    else {
      fprintf(stderr, "c-plugin: unknown argument \"%s\"\n", flag);
      return 0;
    }
  }
  return 1;
}

static plugin_command_string_t str(const char *s) {
  plugin_command_string_t out;
  plugin_command_string_set(&out, s);  // borrows s: never freed
  return out;
}

// An error as the WIT names it (`invalid-argument: ...`), printed after `key: `; the
// error's message is freed.
static void print_error(const char *key, lb_error *err) {
  static const char *const names[] = {"cancelled", "invalid-argument", "context-full",
                                      "model-not-found", "limit-exceeded", "backend"};
  const plugin_command_string_t *message = NULL;
  switch (err->tag) {
    case LLAMABOX_INFERENCE_TYPES_ERROR_INVALID_ARGUMENT: message = &err->val.invalid_argument; break;
    case LLAMABOX_INFERENCE_TYPES_ERROR_MODEL_NOT_FOUND: message = &err->val.model_not_found; break;
    case LLAMABOX_INFERENCE_TYPES_ERROR_LIMIT_EXCEEDED: message = &err->val.limit_exceeded; break;
    case LLAMABOX_INFERENCE_TYPES_ERROR_BACKEND: message = &err->val.backend; break;
  }
  if (message) printf("%s: %s: %.*s\n", key, names[err->tag], (int)message->len, (const char *)message->ptr);
  else printf("%s: %s\n", key, names[err->tag]);
  llamabox_inference_types_error_free(err);
}

static void print_ids(const char *key, const int32_t *ids, size_t n) {
  printf("%s: ", key);
  for (size_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
  printf("\n");
}

// Tokens of sequence 0 from position `first`, logits for the last one only. The batch
// owns copies of everything; llamabox_inference_llm_batch_free frees them.
static lb_batch sequence(const int32_t *tokens, size_t n, int32_t first) {
  lb_batch b = {
      .tokens = {malloc(n * sizeof(int32_t)), n},
      .positions = {malloc(n * sizeof(int32_t)), n},
      .seq_ids = {malloc(n * sizeof(int32_t)), n},
      .logits = {malloc(n * sizeof(bool)), n},
  };
  if (n > 0 && (!b.tokens.ptr || !b.positions.ptr || !b.seq_ids.ptr || !b.logits.ptr)) abort();
  for (size_t i = 0; i < n; i++) {
    b.tokens.ptr[i] = tokens[i];
    b.positions.ptr[i] = first + (int32_t)i;
    b.seq_ids.ptr[i] = 0;
    b.logits.ptr[i] = i + 1 == n;
  }
  return b;
}

// The token with the largest logit: a NaN never wins, ties go to the lowest id (as
// llama.cpp's greedy sampler and the Rust SDK's argmax pick).
static int32_t argmax(const plugin_command_list_f32_t *logits) {
  size_t best = 0;
  float best_value = -INFINITY;
  for (size_t i = 0; i < logits->len; i++) {
    if (logits->ptr[i] > best_value) {
      best = i;
      best_value = logits->ptr[i];
    }
  }
  return (int32_t)best;
}

static int32_t seq_pos_max(lb_context ctx) {
  int32_t pos = -2;
  lb_error err;
  if (!llamabox_inference_llm_method_context_seq_pos_max(ctx, 0, &pos, &err)) llamabox_inference_types_error_free(&err);
  return pos;
}

// Decode `batch` (freeing it); on failure print the error under `key`.
static bool decode(lb_context ctx, lb_batch batch, const char *key) {
  llamabox_inference_cancel_own_cancel_token_t never = llamabox_inference_cancel_constructor_cancel_token();
  lb_error err;
  bool ok = llamabox_inference_llm_method_context_decode(ctx, &batch, llamabox_inference_cancel_borrow_cancel_token(never), &err);
  if (!ok) print_error(key, &err);
  llamabox_inference_cancel_cancel_token_drop_own(never);
  llamabox_inference_llm_batch_free(&batch);
  return ok;
}

// Greedy generation in wasm: decode the prompt, then pick each token by argmax of the
// last logits and decode it.
static bool guest_generate(lb_model model, lb_context ctx, const lb_tokens *prompt, uint32_t max_tokens) {
  int32_t *ids = malloc((max_tokens + 1) * sizeof(int32_t));
  size_t n = 0;
  bool ok = ids && decode(ctx, sequence(prompt->ptr, prompt->len, 0), "guest-generate");
  while (ok && n < max_tokens) {
    plugin_command_list_f32_t logits;
    lb_error err;
    if (!llamabox_inference_llm_method_context_last_logits(ctx, &logits, &err)) {
      print_error("guest-generate", &err);
      ok = false;
      break;
    }
    int32_t next = argmax(&logits);
    plugin_command_list_f32_free(&logits);
    if (llamabox_inference_llm_method_model_is_eog(model, next)) break;
    ids[n++] = next;
    ok = decode(ctx, sequence(&next, 1, (int32_t)(prompt->len + n - 1)), "guest-generate");
  }
  if (ok) print_ids("generated-ids", ids, n);
  free(ids);
  return ok;
}

// The same greedy generation on the host: `generate.start`, then each piece as it comes.
static bool host_generate(lb_context ctx, const lb_tokens *prompt, uint32_t max_tokens) {
  llamabox_inference_generate_generate_params_t params = {
      .prompt = {prompt->ptr, prompt->len},  // borrowed: the call copies what it needs
      .seq = 0,
      .max_tokens = max_tokens,
  };
  llamabox_inference_generate_greedy_sampler(&params.sampler);
  llamabox_inference_cancel_own_cancel_token_t never = llamabox_inference_cancel_constructor_cancel_token();
  llamabox_inference_generate_own_generation_t generation;
  lb_error err;
  bool ok = llamabox_inference_generate_start(ctx, &params, llamabox_inference_cancel_borrow_cancel_token(never), &generation, &err);
  llamabox_inference_generate_sampler_params_free(&params.sampler);
  llamabox_inference_cancel_cancel_token_drop_own(never);
  if (!ok) {
    print_error("host-generated-ids", &err);
    return false;
  }
  llamabox_inference_generate_borrow_generation_t g = llamabox_inference_generate_borrow_generation(generation);
  int32_t *ids = NULL;
  size_t n = 0;
  for (;;) {
    llamabox_inference_generate_option_piece_t piece;
    if (!llamabox_inference_generate_method_generation_next(g, &piece, &err)) {
      print_error("host-generated-ids", &err);
      ok = false;
      break;
    }
    if (!piece.is_some) break;
    size_t more = piece.val.tokens.len;  // may be 0: a piece of text held back earlier
    if (more > 0) {
      ids = realloc(ids, (n + more) * sizeof(int32_t));
      if (!ids) abort();
      memcpy(ids + n, piece.val.tokens.ptr, more * sizeof(int32_t));
      n += more;
    }
    llamabox_inference_generate_option_piece_free(&piece);
  }
  if (ok) {
    print_ids("host-generated-ids", ids, n);
    llamabox_inference_generate_finish_reason_t reason;
    static const char *const reasons[] = {"stop", "end-of-generation", "max-tokens", "cancelled"};
    bool ended = llamabox_inference_generate_method_generation_finish_reason(g, &reason);
    printf("host-finish: %s\n", ended ? reasons[reason.tag] : "none");
  }
  free(ids);
  llamabox_inference_generate_generation_drop_own(generation);
  return ok;
}

// `n` tokens of " the llama in the box" over and over: a long prompt to cancel.
static lb_tokens filler(lb_model model, uint32_t n) {
  lb_tokens words, out = {malloc(n * sizeof(int32_t)), n};
  lb_error err;
  plugin_command_string_t text = str(" the llama in the box");
  if (!out.ptr || !llamabox_inference_llm_method_model_tokenize(model, &text, false, false, &words, &err) || words.len == 0) abort();
  for (uint32_t i = 0; i < n; i++) out.ptr[i] = words.ptr[i % words.len];
  llamabox_inference_llm_list_token_free(&words);
  return out;
}

// Start a long decode and cancel it from this event loop when a timer fires first: the
// decode stops in flight, returns `cancelled`, and memory is as it was.
static void cancel_long_decode(lb_model model, lb_context ctx, uint32_t long_tokens, uint64_t after_ms) {
  lb_error err;
  if (!llamabox_inference_llm_method_context_clear(ctx, &err)) {
    print_error("long-decode", &err);
    return;
  }
  lb_tokens tokens = filler(model, long_tokens);
  lb_batch batch = sequence(tokens.ptr, tokens.len, 0);
  llamabox_inference_llm_list_token_free(&tokens);
  llamabox_inference_cancel_own_cancel_token_t token = llamabox_inference_cancel_constructor_cancel_token();
  llamabox_inference_cancel_borrow_cancel_token_t cancel = llamabox_inference_cancel_borrow_cancel_token(token);
  llamabox_inference_llm_own_pending_decode_t pending;
  bool started = llamabox_inference_llm_method_context_start_decode(ctx, &batch, cancel, &pending, &err);
  llamabox_inference_llm_batch_free(&batch);
  if (!started) {
    llamabox_inference_cancel_cancel_token_drop_own(token);
    print_error("long-decode", &err);
    return;
  }
  llamabox_inference_llm_borrow_pending_decode_t call = llamabox_inference_llm_borrow_pending_decode(pending);
  wasi_io_poll_own_pollable_t done = llamabox_inference_llm_method_pending_decode_subscribe(call);
  wasi_io_poll_own_pollable_t timer = wasi_clocks_monotonic_clock_subscribe_duration(after_ms * 1000000);
  wasi_io_poll_borrow_pollable_t both[] = {wasi_io_poll_borrow_pollable(done), wasi_io_poll_borrow_pollable(timer)};
  wasi_io_poll_list_borrow_pollable_t list = {both, 2};
  plugin_command_list_u32_t ready;
  wasi_io_poll_poll(&list, &ready);
  bool decode_won = false;
  for (size_t i = 0; i < ready.len; i++) decode_won |= ready.ptr[i] == 0;
  plugin_command_list_u32_free(&ready);
  if (!decode_won) {
    llamabox_inference_cancel_method_cancel_token_cancel(cancel);
    wasi_io_poll_method_pollable_block(both[0]);
  }
  // The pollables first: a pollable is its call's child.
  wasi_io_poll_pollable_drop_own(timer);
  wasi_io_poll_pollable_drop_own(done);
  if (llamabox_inference_llm_method_pending_decode_finish(call, &err)) printf("long-decode: finished before the cancel\n");
  else print_error("long-decode", &err);
  llamabox_inference_llm_pending_decode_drop_own(pending);
  llamabox_inference_cancel_cancel_token_drop_own(token);
  printf("memory-after: seq-pos-max=%d\n", seq_pos_max(ctx));
}

// Bad calls, each refused by name, none changing memory.
static void bad_calls(lb_context ctx, uint32_t n_batch) {
  llamabox_inference_llm_own_model_t other;
  lb_error err;
  plugin_command_string_t name = str("no-such-model");
  if (llamabox_inference_llm_static_model_open(&name, &other, &err)) {
    printf("bad-model: opened\n");
    llamabox_inference_llm_model_drop_own(other);
  } else {
    print_error("bad-model", &err);
  }
  // Columns of different lengths.
  lb_batch ragged = sequence((const int32_t[]){1, 2}, 2, 0);
  ragged.positions.len = 1;
  if (decode(ctx, ragged, "bad-batch")) printf("bad-batch: decoded\n");
  // One row more than the context's n-batch.
  int32_t *many = calloc(n_batch + 1, sizeof(int32_t));
  if (!many) abort();
  if (decode(ctx, sequence(many, n_batch + 1, 0), "too-long")) printf("too-long: decoded\n");
  free(many);
  printf("memory-after-too-long: seq-pos-max=%d\n", seq_pos_max(ctx));
}

static int run(int argc, char **argv) {
  struct options o;
  if (!parse_options(argc, argv, &o)) return 1;
  llamabox_inference_llm_own_model_t owned_model;
  llamabox_inference_llm_own_context_t owned_ctx;
  lb_error err;
  plugin_command_string_t name = str(o.model);
  if (!llamabox_inference_llm_static_model_open(&name, &owned_model, &err)) {
    print_error("c-plugin", &err);
    return 1;
  }
  lb_model model = llamabox_inference_llm_borrow_model(owned_model);
  uint32_t n_batch = o.long_tokens > 64 ? o.long_tokens : 64, n_ctx = 1;
  while (n_ctx < n_batch + 64) n_ctx *= 2;
  llamabox_inference_llm_context_params_t params = {
      .n_ctx = {true, n_ctx},
      .n_batch = {true, n_batch},
      .n_seq_max = {true, 1},
      .n_threads = {true, o.threads},
  };
  if (!llamabox_inference_llm_static_context_create(model, &params, &owned_ctx, &err)) {
    print_error("c-plugin", &err);
    return 1;
  }
  lb_context ctx = llamabox_inference_llm_borrow_context(owned_ctx);
  printf("model: %s (vocab %u, embd %u)\n", o.model, llamabox_inference_llm_method_model_n_vocab(model),
         llamabox_inference_llm_method_model_n_embd(model));

  lb_tokens prompt;
  plugin_command_string_t text = str(o.prompt);
  if (!llamabox_inference_llm_method_model_tokenize(model, &text, true, true, &prompt, &err)) {
    print_error("c-plugin", &err);
    return 1;
  }
  print_ids("prompt-tokens", prompt.ptr, prompt.len);
  bool ok = guest_generate(model, ctx, &prompt, o.generate);
  ok = ok && llamabox_inference_llm_method_context_clear(ctx, &err) && host_generate(ctx, &prompt, o.generate);
  llamabox_inference_llm_list_token_free(&prompt);
  if (ok) {
    cancel_long_decode(model, ctx, o.long_tokens, o.cancel_after_ms);
    bad_calls(ctx, n_batch);
  }
  llamabox_inference_llm_context_drop_own(owned_ctx);
  llamabox_inference_llm_model_drop_own(owned_model);
  return ok ? 0 : 1;
}

// The entry point the host calls (`wasi:cli/run`): the arguments come from
// `wasi:cli/environment`, as C strings; an `err` result fails the run.
bool exports_wasi_cli_run_run(void) {
  plugin_command_list_string_t args;
  wasi_cli_environment_get_arguments(&args);
  char **argv = calloc(args.len + 1, sizeof(char *));
  if (!argv) abort();
  for (size_t i = 0; i < args.len; i++) {
    argv[i] = strndup((const char *)args.ptr[i].ptr, args.ptr[i].len);
    if (!argv[i]) abort();
  }
  int status = run((int)args.len, argv);
  for (size_t i = 0; i < args.len; i++) free(argv[i]);
  free(argv);
  plugin_command_list_string_free(&args);
  // A reactor has no exit to flush stdio: flush before returning to the host.
  fflush(stdout);
  fflush(stderr);
  return status == 0;
}
