"""The step census (bench/step_census.py) as an importable core, for tests that hold the counts down.

    counter.StepCounter     launches and host-device syncs of whatever runs inside it (what counts: its doc)
    attribution.Attributor  each event's layer and component, from the Python stack
    engine                  dsv4-tiny on the CUDA worker's code path, on the CPU; `run_step` drives one step
    steps                   decode_census / prefill_census: one counted step in a steady state
    summary                 per layer / kind / step, the projection to another config, two steps compared

Set TRITON_INTERPRET=1 before importing any dsv4_kernels module (the kernels then run on the CPU).
"""
