"""The OpenAI Responses API (`/v1/responses`, stateless) on the chat machinery."""
