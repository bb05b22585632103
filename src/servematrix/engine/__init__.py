"""The simulated engine: scheduler, KV blocks, step times and KV transfer, clock-agnostic."""
