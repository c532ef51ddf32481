"""The durable store: records, jobs, receipts, migrations (below sandbox_manager and runner)."""
