"""Routed experts in host memory (packed MXFP4 bank) behind a GPU expert-slot cache (issue #7)."""
