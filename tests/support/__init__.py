"""Test-only support code (never imported by the product)."""
