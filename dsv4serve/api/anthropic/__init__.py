"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the chat machinery."""
