"""ca-keeper's JSON and event loop on C modules only (issue 16): the keeper's first hello, so
a launched CLI's first line, waited for ~10 ms of imports (json's decoder imports re and enum,
socket and signal import enum, selectors collections). Its ``Json`` on ``_json`` must read and
write what the json package does; a keeper that has started imports none of those modules."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.keeper_local import KEEPER


def keeper_module() -> Any:
    spec = importlib.util.spec_from_loader("ca_keeper", SourceFileLoader("ca_keeper", str(KEEPER)))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.load_keeper_modules()
    return mod


CODEC = keeper_module().json

values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(values)
def test_what_it_writes_the_json_package_reads_back_and_so_does_it(value: Any) -> None:
    text = CODEC.dumps(value)
    assert text.isascii()  # escaped as json.dumps does by default: a hello's size bound counts on it
    assert json.loads(text) == value
    assert CODEC.loads(text) == value
    assert CODEC.loads(text.encode()) == value


@given(values)
def test_it_reads_what_the_json_package_writes(value: Any) -> None:
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=2)):
        assert CODEC.loads(text) == value


def test_a_hello_with_a_turn_note_reads_back_whole() -> None:
    note = 'caf\u00e9 \U0001f600 "quoted" \\ \n\t\x00 \u2028'
    hello = {"protocol": 1, "keeper_id": "ab" * 16, "pid": 7, "accepted": True, "refused": None,
             "acked": 0, "written": 2**40, "tags": {"k": "v"}, "turn_notes": True, "turn_note": note}
    assert json.loads(CODEC.dumps(hello)) == hello


@pytest.mark.parametrize("text", ["", "  ", "NaN", "Infinity", "[1,", "{} x", '{"a" 1}', "\"unterminated",
                                  "[" * 100_000 + "]" * 100_000, b"\xff"])
def test_what_is_not_json_is_a_value_error(text: str | bytes) -> None:
    with pytest.raises(ValueError):
        CODEC.loads(text)


def test_nan_and_objects_are_not_written() -> None:
    with pytest.raises(ValueError):
        CODEC.dumps(float("nan"))
    with pytest.raises(TypeError):
        CODEC.dumps({"a": object()})


def test_a_started_keeper_imported_no_python_wrapper() -> None:
    probe = (  # the modules the keeper imported itself, not this probe's loader
        "import importlib.util, sys\n"
        "from importlib.machinery import SourceFileLoader\n"
        "before = set(sys.modules)\n"
        f"spec = importlib.util.spec_from_loader('k', SourceFileLoader('k', {str(KEEPER)!r}))\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "mod.load_keeper_modules(); mod.Selector(); mod.json_frame(b'H', {'a': 1}); mod.json.loads('{\"a\": [1]}')\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    got = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=30,
                         check=True)
    assert got.stdout.strip() == "['_json', '_socket', '_struct', 'select', 'struct']", got.stdout
