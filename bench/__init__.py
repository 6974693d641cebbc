"""Portico benchmark: `make bench` or `.venv/bin/python -m bench --help` (see bench/run.py)."""
