"""Test-only support code (never imported by the product): replay and recording transports, the
local-process transport, harnesses and fakes."""
