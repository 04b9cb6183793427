"""The worker process: scheduler, KV pool, chunk planner, runner."""
