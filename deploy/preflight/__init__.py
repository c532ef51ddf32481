"""Opt-in model-context preflight against a real inference gateway (SPEC 9.5).

Run by an operator by hand, never by CI or deployment scripts (CI has no gateway key):

    CLOUD_AGENT_TEST_API_KEY_FILE=/path/to/key \\
      uv run python -m deploy.preflight.check_model_context https://gateway.example.com

Modules: ``cases`` (the synthetic conversations), ``detector`` (missing-history claims),
``gateway`` (one streaming call per case), ``verdict`` (pass/fail of a case), ``report``
(table / JSON) and ``check_model_context`` (the command).
"""
