"""CI-sized load (tests/bench/load.py is the full one): 8 chats across the five CLIs, three
turns each, a resident memory budget with room for about three residents. The memory the
CLIs hold, sampled independently from the host, never exceeds the budget; no turn fails;
every turn's request carries exactly the chat's history."""

from __future__ import annotations

import pytest

from deploy.loopback import LoopbackFixture
from tests.daemon_harness import daemon_settings, running_daemon
from tests.support.load import MiB, MemorySampler, chats_for, run_load

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

# Peaks of the pinned CLIs' trees, measured here: claude ~300, codex ~150, pi ~180, opencode
# and kilo ~650 MiB (with the bridge): about three residents fit in 1200 MiB.
BUDGET_MB = 1200


def budget_view(d) -> object:
    """The daemon's own view of its budget at the sampler's peak (read from the sampler's thread:
    a diagnostic, so a view torn by the loop's changes is reported as such)."""
    memory = d.daemon.supervisor.memory
    try:
        def resident(r) -> tuple:
            return (r.runtime, r.key[1][-6:], round((r.measured_bytes or 0) / MiB), round((r.rss_bytes or 0) / MiB),
                    "busy" if memory.locks.busy(r.key) else "idle")
        return {"committed_mib": round(memory.committed() / MiB),
                "reserved_mib": {k[1][-6:]: round(v / MiB) for k, v in list(memory.reserved.items())},
                "residents": [resident(r) for r in list(memory.pool.residents())],
                "retiring": [resident(r) for r in list(memory.pool.retiring())]}
    except RuntimeError as exc:
        return f"torn: {exc}"


async def test_eight_chats_five_clis_under_a_three_resident_budget(tmp_path, sandbox_image) -> None:
    with LoopbackFixture.start() as fx:
        # 2 cores: at most four turns at once (the rest queue, fairly), so the eight CLIs are never
        # all starting together (Kilo and OpenCode take seconds of CPU each)
        settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, resident_memory_mb=BUDGET_MB,
                                   memory_refresh_s=0.5, max_turns=4, queue_timeout_s=600)
        async with running_daemon(settings) as d:
            sampler = MemorySampler(settings.resolved_host_id(), context=lambda: budget_view(d))
            result = await run_load(d, fx, chats_for(8), 3, sampler)
    assert result.failed == [] and len(result.turns) == 24, result.failed
    assert result.history_mismatches == []
    assert sampler.samples > 10
    print(f"peak {result.peak_bytes / MiB:.0f} MiB of {BUDGET_MB}, {result.statuses()}, {result.budget_retirements}, "
          f"{result.latency_by_status()}\n  at the peak: {sampler.peak_processes}\n  the daemon's view: {sampler.peak_context}")
    assert result.peak_bytes <= BUDGET_MB * MiB, (result.peak_bytes / MiB, BUDGET_MB, sampler.peak_processes,
                                                  sampler.peak_context)
    statuses = result.statuses()
    assert statuses["NEW"] == 8 and statuses["LIVE"] + statuses["RESTORED"] == 16
    # the budget bound: some members lost their resident to it and were resumed
    assert sum(result.budget_retirements.values()) > 0 and statuses["RESTORED"] > 0
