"""How a model splits over N ranks: the partition of every checkpoint tensor and the communication it implies.

Pure: imports only the model's args and schema; torch.distributed is never imported here."""
