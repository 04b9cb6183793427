"""dsv4serve: an inference server for DeepSeek-V4-Flash."""

__version__ = "0.1.0"
