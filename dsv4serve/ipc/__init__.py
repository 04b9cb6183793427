"""Every message between the API process and the worker, and the channel that carries them."""
