"""Example planners of one's own, run by name as `--policy FILE.py:CLASS` or `MODULE:CLASS` (policies.registry)."""
