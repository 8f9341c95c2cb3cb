"""Kestrel: a local LLM inference daemon (kestreld) for small ARM boards."""

__version__ = "0.1.0"   # keep equal to pyproject.toml's version
