"""Finding, validating and reading DeepSeek-V4 checkpoints (official and transformers layouts)."""
