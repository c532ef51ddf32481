"""Recognise replies that claim the conversation has no earlier messages.

The detector is deliberately **conservative**: it only knows explicit first-person
claims ("I don't have any previous messages", "this is the start of our conversation",
"我没有之前的对话记录", "这是我们对话的开始", ...), in English and Chinese, so an ordinary
answer that merely talks about earlier turns ("at the start of our conversation you
said hi") is not flagged.

It is also **literal**: it matches phrases, not meaning. A reply that quotes a bad claim
in order to correct it ("I won't say 'I don't have any previous messages' — you said
hi") is still rejected. That false positive is accepted on purpose: a preflight that
fails loudly and names the matched phrase (``ClaimMatch.phrase``) costs an operator one
look at the answer, while a detector that tried to understand negation and quotation
would let real missing-history claims through.

Two kinds of claim are told apart because one of them can be true:
  ``no_history``     there is no earlier message/conversation at all;
  ``nothing_asked``  the user has not asked for anything yet (true after a bare "hi").
Which kinds a case tolerates is decided by the case (see ``cases`` and ``verdict``).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

ClaimKind = Literal["no_history", "nothing_asked"]


class ClaimMatch(BaseModel):
    kind: ClaimKind
    phrase: str  # the text of the reply that matched, verbatim
    rule: str  # which rule matched, for the report
    tolerated: bool = False  # set by the verdict when the claim is true in that case


# English ---------------------------------------------------------------------------
_PRIOR = r"(?:previous|prior|earlier|past|preceding)"
_HISTORY = r"(?:messages?|conversations?|chats?|history|interactions?|requests?|context|exchanges?)"
_DONT = r"(?:don't|do not|dont)"

_EN: list[tuple[ClaimKind, str, str]] = [
    ("no_history", "en: I don't have/see previous messages",
     rf"\bI {_DONT} (?:have|see) (?:any )?(?:access to |memory of |record of |records of )?"
     rf"(?:any |our |the )?{_PRIOR} {_HISTORY}"),
    ("no_history", "en: I can't see previous messages",
     rf"\bI (?:can't|cannot|can not|am unable to|'m unable to|am not able to) "
     rf"(?:see|access|view|recall|remember) (?:any |our |the )?{_PRIOR} {_HISTORY}"),
    ("no_history", "en: I have no previous messages",
     rf"\bI have no (?:access to |memory of |record of )?(?:any |our )?{_PRIOR} {_HISTORY}"),
    ("no_history", "en: there are no previous messages",
     rf"\bthere (?:is|are) no {_PRIOR} {_HISTORY}"),
    ("no_history", "en: this is the start of our conversation",
     r"\b(?:this is|we're at|we are at) the (?:very )?(?:start|beginning) of (?:our|this|the) "
     r"(?:conversation|chat)"),
    ("no_history", "en: our conversation just started",
     r"\bour (?:conversation|chat) (?:has )?just (?:started|begun|began|starting)"),
    ("no_history", "en: this is your first message",
     r"\bthis is (?:your|the) (?:very )?first message"),
    ("nothing_asked", "en: you haven't asked me anything",
     r"\byou (?:haven't|have not|didn't|did not) (?:yet )?(?:asked|told|requested) me "
     r"(?:anything|to do anything|any(?:thing)? (?:yet|so far))"),
    ("nothing_asked", "en: you haven't given me a task",
     r"\byou (?:haven't|have not|didn't|did not) (?:yet )?(?:given|assigned) me "
     r"(?:any|a) (?:task|request|instructions?)"),
]

# Chinese ---------------------------------------------------------------------------
_ZH_PRIOR = r"(?:之前|以前|先前|此前|过去|上次|前面)"
_ZH_HISTORY = r"(?:对话|聊天|会话|消息|记录|交流|内容)"

# Chinese drops the subject freely ("还没有让我做任何事"), so 你 or 还 must be there, not both.
_ZH_YOU_NOT = r"(?:你(?:还|并)?|还)(?:没有|没)"

_ZH: list[tuple[ClaimKind, str, str]] = [
    ("no_history", "zh: 我没有之前的对话记录",
     rf"我(?:并)?(?:没有|没|无法|不能)(?:看到|查看|访问|获取|保留|记住|读取)?(?:任何)?"
     rf"(?:关于)?(?:我们)?{_ZH_PRIOR}的?{_ZH_HISTORY}+"),
    ("no_history", "zh: 没有之前的对话",
     rf"(?:并)?(?:没有|不存在)(?:任何)?{_ZH_PRIOR}的{_ZH_HISTORY}+"),
    ("no_history", "zh: 这是我们对话的开始",
     r"(?:这是|这里是|现在是)(?:我们)?(?:的)?(?:对话|聊天|会话)的(?:开始|开端|开头|起点)"),
    ("no_history", "zh: 我们的对话才刚开始",
     r"我们的?(?:对话|聊天|会话)(?:才|刚)刚?(?:刚)?开始"),
    ("no_history", "zh: 这是你的第一条消息",
     r"这是你(?:的)?第一(?:条|句)(?:消息|话)"),
    ("nothing_asked", "zh: 你还没有让我做任何事",
     rf"{_ZH_YOU_NOT}(?:让|要求|叫|请|交代)我做(?:过)?(?:任何|什么)(?:事情|事|任务)?"),
    ("nothing_asked", "zh: 你还没有问我任何问题",
     rf"{_ZH_YOU_NOT}(?:问|问过)我(?:任何|什么)(?:问题)?"),
    ("nothing_asked", "zh: 你还没有给我任务",
     rf"{_ZH_YOU_NOT}(?:给|交给|布置给)我(?:任何)?(?:任务|指令|要求)"),
]

_RULES = [(kind, label, re.compile(rx, re.IGNORECASE)) for kind, label, rx in _EN + _ZH]

# Typographic apostrophes are common in model output ("don’t"); the rules use ASCII.
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})


def find_history_claims(answer: str) -> list[ClaimMatch]:
    """Every recognised missing-history claim in ``answer``, in reply order."""
    text = re.sub(r"\s+", " ", answer.translate(_APOSTROPHES))
    spans = sorted(((m.start(), m.end(), kind, label) for kind, label, rx in _RULES
                    for m in rx.finditer(text)), key=lambda s: (s[0], -s[1]))
    claims: list[ClaimMatch] = []
    end_of_last = -1
    for start, end, kind, label in spans:
        # Rules overlap (我没有之前的对话 / 没有之前的对话): report each phrase once.
        if end <= end_of_last:
            continue
        claims.append(ClaimMatch(kind=kind, phrase=text[start:end], rule=label))
        end_of_last = end
    return claims
