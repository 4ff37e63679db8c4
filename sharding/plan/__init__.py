"""Only the entry point `python -m sharding.plan` (see `__main__.py`); the planner's API is `parallel.plan`."""
