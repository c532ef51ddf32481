"""`python -m deploy.reliability` against REAL daemons: the right SHA passes; a wrong SHA, a
stale heartbeat, an image with an older helper and a wrong token each fail, naming the check."""

from __future__ import annotations

import json
import os
import sys
import uuid

import anyio
import pytest

from deploy.loopback import LoopbackFixture
from tests.cli.attestation_helpers import REPO, git_head, relabelled_image, wait_ready
from tests.daemon_harness import daemon_settings, running_daemon

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


async def reliability(url: str, *args: str, token_file=None) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOUD_AGENT_")}
    if token_file is not None:
        env["CLOUD_AGENT_SERVICE_TOKEN_FILE"] = str(token_file)
    out = await anyio.run_process([sys.executable, "-m", "deploy.reliability", url, *args], cwd=REPO, env=env,
                                  check=False)
    assert out.stderr == b""
    return out.returncode, out.stdout.decode().splitlines()


def settings(tmp_path, fx, image, **kw):
    return daemon_settings(tmp_path / "home", fx.base_url, image, host_id=f"rel-{uuid.uuid4().hex[:10]}", **kw)


def row(lines: list[str], check: str) -> tuple[str, str]:
    hit = [line for line in lines if line.split(" ", 1)[0] == check]
    assert len(hit) == 1, lines
    name, result, detail = hit[0].split(None, 2)
    return result, detail


async def test_the_right_sha_passes_and_a_wrong_one_fails(fx, tmp_path, sandbox_image) -> None:
    sha = git_head()
    s = settings(tmp_path, fx, sandbox_image)
    async with running_daemon(s) as d:
        await wait_ready(d.client)
        served = (await d.client.get("/v1/attestation")).json()["source"]
        assert served["sha"] == sha, "a commit landed while the daemon started; rerun"
        token = s.service_token_file
        code, lines = await reliability(d.url, "--expect-sha", sha, "--allow-dirty", token_file=token)
        assert code == 0, lines
        assert lines[0].split() == ["CHECK", "RESULT", "DETAIL"] and lines[-1] == "all checks passed"
        assert [line.split()[:2] for line in lines[1:-1]] == [
            ["api", "pass"], ["source_sha", "pass"], ["helper_pin", "pass"], ["reverse_probe", "pass"],
            ["heartbeat", "pass"]]
        assert row(lines, "api")[1] == f"{d.url}/v1/attestation answered (api version 1)"
        state = "dirty tree, allowed" if served["dirty"] else "clean tree"
        assert row(lines, "source_sha")[1] == f"{sha} ({state})"
        assert row(lines, "helper_pin")[1].endswith("has http-agent-live-bridge=4")

        # without --allow-dirty, a dirty tree is not the commit
        code, lines = await reliability(d.url, "--expect-sha", sha, "--token-file", str(token))
        if served["dirty"]:
            assert code == 1 and lines[-1] == "FAILED: source_sha"
            assert row(lines, "source_sha") == ("fail", f"{sha} with a dirty tree (local changes on top of the "
                                                        "commit)")
        else:
            assert code == 0 and lines[-1] == "all checks passed"

        wrong = "0" * 40
        code, lines = await reliability(d.url, "--expect-sha", wrong, "--allow-dirty", token_file=token)
        assert code == 1 and lines[-1] == "FAILED: source_sha"
        assert row(lines, "source_sha") == ("fail", f"expected {wrong}, the host serves {sha}")

        code, out = await reliability(d.url, "--expect-sha", sha, "--allow-dirty", "--json", token_file=token)
        doc = json.loads("\n".join(out))
        assert (code, doc["ok"], doc["failed"]) == (0, True, [])
        assert [c["name"] for c in doc["checks"]] == ["api", "source_sha", "helper_pin", "reverse_probe",
                                                      "heartbeat"]

        bad = tmp_path / "wrong-token"
        bad.write_text("not-the-service-token-0123456789")
        code, lines = await reliability(d.url, "--expect-sha", sha, token_file=bad)
        assert code == 1 and lines[-1] == "FAILED: api, source_sha, helper_pin, reverse_probe, heartbeat"
        assert row(lines, "api") == ("fail", f"{d.url}/v1/attestation refused the service token (HTTP 401)")


async def test_a_stale_heartbeat_fails(fx, tmp_path, sandbox_image) -> None:
    s = settings(tmp_path, fx, sandbox_image, heartbeat_interval_s=3600)
    async with running_daemon(s) as d:
        await wait_ready(d.client)  # ready: the daemon's own bound is 2 intervals
        await anyio.sleep(1.5)
        sha = (await d.client.get("/v1/attestation")).json()["source"]["sha"]
        code, lines = await reliability(d.url, "--expect-sha", sha, "--allow-dirty", "--max-heartbeat-age", "1",
                                        token_file=s.service_token_file)
        assert code == 1 and lines[-1] == "FAILED: heartbeat"
        result, detail = row(lines, "heartbeat")
        assert result == "fail" and detail.startswith("last beat ")
        assert detail.endswith("s ago (interval 3600.0s, max age 1s)")
        assert float(detail.split()[2].rstrip("s")) >= 1.5
        code, lines = await reliability(d.url, "--expect-sha", sha, "--allow-dirty", "--max-heartbeat-age", "60",
                                        token_file=s.service_token_file)
        assert code == 0, lines


async def test_an_image_with_an_older_helper_fails_helper_pin_and_probe(fx, tmp_path, sandbox_image,
                                                                        docker_client) -> None:
    with relabelled_image(sandbox_image, **{"http-agent-live-bridge": "3"}) as old:
        s = settings(tmp_path, fx, old)
        async with running_daemon(s) as d:
            await wait_ready(d.client, want=503)
            sha = (await d.client.get("/v1/attestation")).json()["source"]["sha"]
            code, lines = await reliability(d.url, "--expect-sha", sha, "--allow-dirty",
                                            token_file=s.service_token_file)
            image_id = docker_client.images.get(old).id
            assert code == 1 and lines[-1] == "FAILED: helper_pin, reverse_probe"
            assert row(lines, "helper_pin") == (
                "fail", f"image {old} ({image_id[:19]}) has http-agent-live-bridge=3, the pin is 4")
            assert row(lines, "reverse_probe") == (
                "fail", f"failed at image_inspect: ImageRefused: image {old} ({image_id[:19]}) refused: "
                        "label http-agent-live-bridge=3 (want 4)")
            assert [row(lines, c)[0] for c in ("api", "source_sha", "heartbeat")] == ["pass"] * 3
