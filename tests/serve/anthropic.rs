//! Anthropic's Messages API (`/v1/messages`): the official `anthropic` SDK and Claude Code.
