"""The OpenAI-compatible HTTP API (FastAPI): routes, protocol models, streaming, metrics."""
