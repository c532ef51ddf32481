"""Opt-in preflight: does the gateway's model answer from the conversation history?

    CLOUD_AGENT_TEST_API_KEY_FILE=/path/to/key \\
      uv run python -m deploy.preflight.check_model_context https://gateway.example.com \\
      [--repetitions 3] [--model deepseek-v4-flash] [--api anthropic|openai] [--json]

Five synthetic cases per repetition (greeting, repeated_question, task, fact_update,
no_history), one ordinary streaming inference call each. Environment:
  CLOUD_AGENT_TEST_API_KEY_FILE  file holding the gateway key (required). The key is read
                                 here and only sent as a request header; it is never an
                                 argument and never printed or logged.
  CLOUD_AGENT_TEST_PROXY         optional HTTP proxy for the gateway calls.

Exit status: 0 every case passed, 1 a case failed, 2 bad usage or configuration.
Never run by CI or deployment scripts: it needs a real key and costs real calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import structlog

from deploy.preflight import gateway
from deploy.preflight.cases import CASE_NAMES, build_cases
from deploy.preflight.report import public_url, render_json, render_table
from deploy.preflight.verdict import judge, summarize

KEY_FILE_ENV = "CLOUD_AGENT_TEST_API_KEY_FILE"
PROXY_ENV = "CLOUD_AGENT_TEST_PROXY"

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class ConfigError(Exception):
    pass


def _logger() -> structlog.BoundLogger:
    # A private logger on stderr (not the global structlog configuration): stdout carries
    # the table or the --json document and must stay parseable.
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"),
                    structlog.dev.ConsoleRenderer(colors=False)],
    )


def read_key() -> str:
    path = os.environ.get(KEY_FILE_ENV)
    if not path:
        raise ConfigError(f"{KEY_FILE_ENV} is not set: name a file that holds the gateway key")
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the key file named by {KEY_FILE_ENV} ({path}): "
                          f"{exc.strerror or exc}") from None
    if not key:
        raise ConfigError(f"the key file named by {KEY_FILE_ENV} ({path}) is empty")
    return key


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deploy.preflight.check_model_context",
        description="Opt-in check that a gateway's model answers from the conversation history.",
        epilog=f"The key comes from the file named by ${KEY_FILE_ENV}; ${PROXY_ENV} optionally "
               "names an HTTP proxy.")
    p.add_argument("base_url", help="gateway base URL (serving /v1/messages or /v1/chat/completions)")
    p.add_argument("--repetitions", type=_positive, default=3, help="repetitions of the five cases (default 3)")
    p.add_argument("--model", default="deepseek-v4-flash")
    p.add_argument("--api", choices=["anthropic", "openai"], default="anthropic",
                   help="request shape: Anthropic Messages (default) or OpenAI Chat Completions")
    p.add_argument("--thinking", choices=["adaptive", "budget"], default="adaptive",
                   help="Anthropic thinking form (OpenAI always sends reasoning_effort=high)")
    p.add_argument("--thinking-budget", type=_positive, default=8192, help="budget_tokens for --thinking budget")
    p.add_argument("--max-tokens", type=_positive, default=16000)
    p.add_argument("--timeout", type=float, default=300.0, help="read timeout per call, seconds")
    p.add_argument("--lang", choices=["alternate", "zh", "en"], default="alternate",
                   help="language of the final question (alternate: Chinese on odd repetitions)")
    p.add_argument("--case", action="append", choices=CASE_NAMES, dest="cases",
                   help="run only this case (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--answers", action="store_true", help="print every full answer (failed ones always are)")
    p.add_argument("--show-requests", action="store_true",
                   help="print each request (without authentication headers) to stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = _logger()
    try:
        key = read_key()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    cfg = gateway.GatewayConfig(base_url=args.base_url, api=args.api, model=args.model,
                                thinking=args.thinking, thinking_budget=args.thinking_budget,
                                max_tokens=args.max_tokens, timeout_s=args.timeout)
    cases = [c for c in build_cases(args.repetitions, args.lang) if not args.cases or c.name in args.cases]
    proxy = os.environ.get(PROXY_ENV) or None
    log.info("preflight.start", gateway=public_url(cfg.base_url), api=cfg.api, model=cfg.model,
             calls=len(cases), proxy=bool(proxy))
    results = []
    with gateway.make_client(cfg, proxy) as client:
        for case in cases:
            if args.show_requests:
                print("request " + json.dumps(gateway.describe_request(cfg, case), ensure_ascii=False),
                      file=sys.stderr)
            result = judge(case, gateway.call(client, cfg, case, key), cfg.api)
            log.info("preflight.case", case=case.name, repetition=case.repetition,
                     recall_passed=result.recall_passed, thinking_observed=result.thinking_observed,
                     status=result.status_code, request_id=result.request_id, ms=result.elapsed_ms)
            results.append(result)
    summary = summarize(results)
    if args.json:
        meta = {"gateway": public_url(cfg.base_url), "api": cfg.api, "model": cfg.model,
                "repetitions": args.repetitions, "thinking": cfg.thinking if cfg.api == "anthropic" else "high"}
        print(render_json(results, summary, meta))
    else:
        print(render_table(results, summary, all_answers=args.answers))
    return EXIT_OK if summary.recall_passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
