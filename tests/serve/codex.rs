//! Codex CLI (npm `@openai/codex`) against `llamabox serve`'s `/v1/responses`.
