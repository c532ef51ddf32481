"""The five synthetic conversations of the preflight (SPEC 9.5).

Every case ends with a user question whose correct answer depends on the earlier turns
(or, for ``no_history``, on there being none). The earlier turns are in English; the
final question alternates between Chinese and English by repetition (odd repetitions
ask in Chinese) unless ``--lang`` fixes one language, because the incident that
motivated this check was a Chinese follow-up ("我刚才让你做什么了") answered with a
claim that no earlier message existed.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

from deploy.preflight.detector import ClaimKind

Lang = Literal["zh", "en"]

CASE_NAMES = ("greeting", "repeated_question", "task", "fact_update", "no_history")

# Mentions persistent memory files on purpose: that mention is what tempted models into
# "I have no memory of earlier messages" answers although the history was in the request.
SYSTEM_PROMPT = (
    "You are a coding assistant working in the user's repository. You have persistent "
    "memory files (MEMORY.md and notes/*.md) that you can read and update to remember "
    "things across sessions. Be concise."
)


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str


class Fact(BaseModel):
    """A fact the answer must state; ``pattern`` is a case-insensitive regex."""

    label: str
    pattern: str

    def found_in(self, answer: str) -> bool:
        # Markdown renderers escape underscores (load\_config); the fact is still there.
        return re.search(self.pattern, answer.replace("\\_", "_"), re.IGNORECASE) is not None


class Case(BaseModel):
    name: str
    repetition: int
    lang: Lang
    system: str = SYSTEM_PROMPT
    messages: list[Message]
    facts: list[Fact] = []
    # Claim kinds that are true statements in this conversation (see verdict.judge).
    tolerated_claims: frozenset[ClaimKind] = frozenset()


def _conv(*turns: str) -> list[Message]:
    """Alternate user/assistant messages, starting with the user."""
    return [Message(role="user" if i % 2 == 0 else "assistant", content=t) for i, t in enumerate(turns)]


_WHAT_DID_I_ASK = {"zh": "我刚才让你做什么了", "en": "What did I just ask you to do?"}

_QUESTIONS: dict[str, dict[str, str]] = {
    "greeting": _WHAT_DID_I_ASK,
    "repeated_question": {
        "zh": "我在这段对话里哪个问题问了你两次？",
        "en": "Which question have I asked you twice in this conversation?",
    },
    "task": {
        "zh": "提醒我一下：我们之前约定好的任务是什么？",
        "en": "Remind me: which task did we agree on earlier?",
    },
    "fact_update": {
        "zh": "预发布（staging）数据库的主机名现在是什么？只回答主机名。",
        "en": "What is the staging database host now? Answer with the host name only.",
    },
    "no_history": _WHAT_DID_I_ASK,
}

# A reference to the user's "hi". A salutation at the very start of the reply ("Hi! ...")
# is the model greeting back, not recalling, so a bare hi/hello must not open the reply.
_GREETING_REF = r"greet|招呼|问候|问好|(?<=.)(?<![a-z])(?:hi|hello|你好|嗨)(?![a-z])"

_PG_QUESTION = "Which port does PostgreSQL listen on by default?"


def _history(name: str) -> tuple[list[str], list[Fact], frozenset[ClaimKind]]:
    if name == "greeting":
        # "You haven't asked me to do anything yet" is true here (the user only said hi),
        # so that claim kind is tolerated, but only next to a reference to the greeting.
        return (["hi", "Hi! How can I help you with your code today?"],
                [Fact(label="refers to the earlier greeting", pattern=_GREETING_REF)],
                frozenset({"nothing_asked"}))
    if name == "repeated_question":
        return ([_PG_QUESTION, "5432.", _PG_QUESTION, "As I said: 5432."],
                [Fact(label="names the repeated PostgreSQL port question", pattern=r"postgres|5432")],
                frozenset())
    if name == "task":
        return ([
            "In src/settings.py, please rename the function parse_cfg to load_config and "
            "update every call site. Don't start until I say go.",
            "Got it: rename parse_cfg to load_config in src/settings.py and update all call "
            "sites. I'll wait for your go.",
            "Unrelated question first: is Python's list.sort stable?",
            "Yes. list.sort (Timsort) is stable.",
        ], [Fact(label="recalls the agreed rename to load_config", pattern=r"load_config")], frozenset())
    if name == "fact_update":
        return ([
            "For this project, the staging database host is db-blue.internal. Please remember it.",
            "Noted: the staging database host is db-blue.internal.",
            "Update: we migrated. The staging database host is now db-green.internal.",
            "Updated: the staging database host is now db-green.internal.",
        ], [Fact(label="gives the updated host db-green.internal", pattern=r"db-green\.internal")], frozenset())
    if name == "no_history":
        # A fresh conversation: "there is no earlier message" is the correct answer.
        return [], [], frozenset({"no_history", "nothing_asked"})
    raise ValueError(f"unknown case {name!r}")


def lang_for(repetition: int, lang: Lang | Literal["alternate"]) -> Lang:
    if lang != "alternate":
        return lang
    return "zh" if repetition % 2 == 1 else "en"


def build_case(name: str, repetition: int, lang: Lang) -> Case:
    turns, facts, tolerated = _history(name)
    return Case(name=name, repetition=repetition, lang=lang,
                messages=_conv(*turns, _QUESTIONS[name][lang]),
                facts=facts, tolerated_claims=tolerated)


def build_cases(repetitions: int, lang: Lang | Literal["alternate"] = "alternate") -> list[Case]:
    """All cases, repetition-major: 5 per repetition."""
    return [build_case(name, rep, lang_for(rep, lang))
            for rep in range(1, repetitions + 1) for name in CASE_NAMES]
