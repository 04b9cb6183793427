"""DeepSeek-V4 in PyTorch: architecture args, checkpoint schema, number formats, the reference model."""
