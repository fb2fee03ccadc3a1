"""Tangram Launch: plan and launch LLM training on heterogeneous GPU clusters."""

__version__ = "0.1.0"
