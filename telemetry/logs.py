"""Logging set-up: JSON lines for services, a readable console renderer in a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, json: bool | None = None, level: str = "INFO") -> None:
    """Configure structlog once per process.

    ``json=None`` picks JSON when stderr is not a terminal (services, CI) and the
    console renderer when a person is watching.
    """
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
