"""Logging set-up and shared metric helpers, importable by every layer."""
