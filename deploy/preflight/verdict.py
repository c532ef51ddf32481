"""Pass or fail of one case, from the call's outcome.

A case fails (``recall_passed`` false) on any of, in this order of reporting:
  * no HTTP answer (transport error) or a non-200 status;
  * a stream error event;
  * truncation: the stream ended without its final event (Anthropic ``message_stop``;
    OpenAI ``[DONE]`` or a ``finish_reason``), or it stopped on the token limit
    (``max_tokens`` / ``length``);
  * an empty answer;
  * a required fact missing from the answer;
  * a recognised missing-history claim the case does not tolerate (``detector``).

Thinking is reported beside the verdict, never inside it: a correct answer without
observed thinking passes with ``thinking_observed`` false, so an operator can tell
"the model forgot" from "the gateway dropped the thinking request".
"""

from __future__ import annotations

from pydantic import BaseModel

from deploy.preflight.cases import Case
from deploy.preflight.detector import ClaimMatch, find_history_claims
from deploy.preflight.gateway import Api, CallOutcome

_TOKEN_LIMIT_STOPS = {"max_tokens", "length"}
_FINAL_EVENT = {"anthropic": "message_stop", "openai": "[DONE] or a finish_reason"}


class CaseResult(BaseModel):
    case: str
    repetition: int
    lang: str
    recall_passed: bool
    thinking_observed: bool
    request_id: str | None
    answer: str
    failures: list[str]
    missing_facts: list[str]
    history_claims: list[ClaimMatch]
    status_code: int | None
    stop_reason: str | None
    thinking_chars: int
    elapsed_ms: int


class Summary(BaseModel):
    cases: int
    failed: int
    recall_passed: bool
    thinking_observed: bool  # in every case
    thinking_observed_cases: int


def _call_failures(out: CallOutcome, api: Api) -> list[str]:
    if out.status_code is None:
        return [f"no HTTP answer: {out.transport_error}"]
    if out.status_code != 200:
        return [f"HTTP {out.status_code}: {(out.http_error or '').strip()}"]
    if out.stream_error:
        return [f"stream error: {out.stream_error}"]
    failures = []
    if not out.completed:
        cut = f" ({out.transport_error})" if out.transport_error else ""
        failures.append(f"truncated: stream ended without {_FINAL_EVENT[api]}{cut}")
    if out.stop_reason in _TOKEN_LIMIT_STOPS:
        failures.append(f"truncated: stop reason {out.stop_reason}")
    if not out.answer.strip():
        failures.append("empty answer")
    return failures


def judge(case: Case, out: CallOutcome, api: Api) -> CaseResult:
    failures = _call_failures(out, api)
    missing: list[str] = []
    claims: list[ClaimMatch] = []
    # Content checks only make sense for a delivered stream; on a 500 they would only
    # add noise to the one real reason.
    if out.status_code == 200 and not out.stream_error:
        missing = [f.label for f in case.facts if not f.found_in(out.answer)]
        failures += [f"missing fact: {label}" for label in missing]
        for claim in find_history_claims(out.answer):
            # A claim true in this case ("you only said hi") is tolerated only beside the
            # required facts, so "you haven't asked me anything" alone still fails.
            tolerated = claim.kind in case.tolerated_claims and not missing
            claims.append(claim.model_copy(update={"tolerated": tolerated}))
            if not tolerated:
                failures.append(f'missing-history claim: "{claim.phrase}" ({claim.rule})')
    return CaseResult(
        case=case.name, repetition=case.repetition, lang=case.lang,
        recall_passed=not failures, thinking_observed=out.thinking_observed,
        request_id=out.request_id, answer=out.answer, failures=failures,
        missing_facts=missing, history_claims=claims, status_code=out.status_code,
        stop_reason=out.stop_reason, thinking_chars=out.thinking_chars, elapsed_ms=out.elapsed_ms,
    )


def summarize(results: list[CaseResult]) -> Summary:
    failed = sum(not r.recall_passed for r in results)
    thinking = sum(r.thinking_observed for r in results)
    return Summary(cases=len(results), failed=failed, recall_passed=failed == 0,
                   thinking_observed=bool(results) and thinking == len(results),
                   thinking_observed_cases=thinking)
