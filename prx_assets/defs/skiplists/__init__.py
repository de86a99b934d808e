"""The skip-list stage: opt-out intake (sensor), the skip policy, and per-shard sidecars."""
