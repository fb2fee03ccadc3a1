"""Analytical cost model: per-layer compute (compute.py), memory (memory.py) and communication
(communication.py) on one GPU type, with the achievable-efficiency constants and measured overrides in
efficiency.py; breakdown.py assembles them into per-stage costs of a slice plan and explains them.

Every formula carries its source in a comment; tests/test_costmodel*.py check them against published figures.
"""
