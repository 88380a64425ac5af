"""Routing: filter -> score -> pick, then the prefill decider (see base.py)."""
