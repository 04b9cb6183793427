"""`dsv4-tiny`: a seeded, random-weight DeepSeek-V4 checkpoint in the official layout."""
