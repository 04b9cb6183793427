"""One home for memory facts, importing only downward (config, ipc, model args / schema / backends):
what the weights take (weights.py), the whole-card plan `dsv4serve plan` prints (plan.py), the expert
slots the CUDA worker takes from it (expert_plan.py), the KV capacity (capacity.py), the pure chunk
planner (chunk_planner.py) and the one module that asks the device how much is free (probe.py)."""
