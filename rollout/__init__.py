"""trajpipe: rollout package."""
