"""How a model splits over N ranks, and the split forward.

Pure (no tensor, no process group; `plan --gpus N` uses them): `partition.py` (which part of every tensor a
rank holds), `comm_volume.py` (the communication a decode step needs). The split forward: `group.py` (a rank
group on env:// rendezvous), `collectives.py` (counted all-reduce / all-gather), `shard_model.py` (a whole model
cut to one rank's part), `split_check.py` (the split run next to one rank's). torch.distributed is imported only
inside functions, never when a module of this package is imported."""
