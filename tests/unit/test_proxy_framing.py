"""proxy.framing: the HTTP/1.1 events both sides of the proxy read, and the bytes they write."""

from __future__ import annotations

import pytest

from proxy.framing import (CLOSED, END, NEED_DATA, FramingError, Head, Parser, ProtocolError, request_bytes,
                           response_head)


def events(parser: Parser) -> list[object]:
    out: list[object] = []
    while (event := parser.next_event()) is not NEED_DATA:
        out.append(event)
        if event is CLOSED:
            break
    return out


def test_pipelined_requests_come_out_in_order_with_lower_case_names_and_stripped_values() -> None:
    p = Parser(request=True)
    p.feed(b"POST /m/a/v1/messages?beta=true HTTP/1.1\r\nHost: x\r\nX-Thing:  v1 \r\ncontent-length: 3\r\n\r\nab")
    p.feed(b"cGET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    first, body_a, body_b, end1, second, end2 = events(p)
    assert isinstance(first, Head) and isinstance(second, Head)
    assert (first.method, first.target, first.headers, first.keep_alive) == (
        b"POST", b"/m/a/v1/messages?beta=true", [(b"host", b"x"), (b"x-thing", b"v1"), (b"content-length", b"3")],
        True)
    assert (body_a, body_b, end1, end2) == (b"ab", b"c", END, END)
    assert (second.method, second.target, second.keep_alive) == (b"GET", b"/v1/models", False)


def test_chunked_request_body_is_de_chunked() -> None:
    p = Parser(request=True)
    p.feed(b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    head, *rest = events(p)
    assert rest == [b"abc", b"de", END]


def test_a_clean_close_between_requests_is_closed_and_mid_message_is_an_error() -> None:
    p = Parser(request=True)
    p.feed(b"")
    assert p.next_event() is CLOSED
    p = Parser(request=True)
    p.feed(b"POST / HTTP/1.1\r\ncontent-length: 5\r\n\r\nab")
    assert [type(e) for e in (p.next_event(), p.next_event())] == [Head, bytes]
    p.feed(b"")
    with pytest.raises(ProtocolError, match="mid-message"):
        p.next_event()


def test_garbage_is_a_400_after_the_events_before_it() -> None:
    p = Parser(request=True)
    p.feed(b"GET / HTTP/1.1\r\n\r\n\x16\x03\x01 not http\r\n\r\n")
    assert [type(e) for e in (p.next_event(), p.next_event())] == [Head, type(END)]
    with pytest.raises(ProtocolError) as err:
        p.next_event()
    assert err.value.status == 400


def test_a_head_over_its_bound_is_a_431_even_before_it_ends() -> None:
    p = Parser(request=True, max_head_bytes=64)
    p.feed(b"POST / HTTP/1.1\r\nx-big: " + b"y" * 100)
    with pytest.raises(ProtocolError) as err:
        p.next_event()
    assert err.value.status == 431


def test_responses_skip_nothing_themselves_but_mark_1xx_and_end_close_delimited_bodies_at_eof() -> None:
    p = Parser(request=False)
    p.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
    cont, cont_end, ok, data = events(p)
    assert (cont.status, cont_end, ok.status, ok.reason, data) == (100, END, 200, b"OK", b"data: 1\n\n")
    p.feed(b"")
    assert (p.next_event(), p.next_event()) == (END, CLOSED)


def test_a_cut_length_delimited_response_is_an_error() -> None:
    p = Parser(request=False)
    p.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
    assert [type(e) for e in (p.next_event(), p.next_event())] == [Head, bytes]
    p.feed(b"")
    with pytest.raises(ProtocolError):
        p.next_event()


def test_a_response_to_head_ends_at_its_head_whatever_its_length_says() -> None:
    p = Parser(request=False)
    p.end_at_head = True
    p.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n")
    head, end = events(p)
    assert (head.status, head.keep_alive, end) == (200, False, END)


def test_answer_framing_follows_h11s_rules() -> None:
    http11 = Head([], method=b"POST", http_version="1.1", keep_alive=True)
    head, framing, keep = response_head(http11, 200, [(b"content-type", b"text/event-stream")])
    assert head == b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    assert (framing.data(b"abc"), framing.end(), keep) == (b"3\r\nabc\r\n", b"0\r\n\r\n", True)

    head, framing, keep = response_head(http11, 400, [(b"content-length", b"2")], b"Nope")
    assert (head, framing.data(b"no"), framing.end(), keep) == (
        b"HTTP/1.1 400 Nope\r\ncontent-length: 2\r\n\r\n", b"no", b"", True)

    http10 = Head([], method=b"POST", http_version="1.0", keep_alive=False)
    head, framing, keep = response_head(http10, 200, [])
    assert (head, framing.data(b"x"), keep) == (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", b"x", False)

    head_req = Head([], method=b"HEAD")
    head, framing, keep = response_head(head_req, 200, [(b"content-length", b"42")])
    assert (head, framing.data(b"ignored"), framing.end(), keep) == (
        b"HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n", b"", b"", True)

    closing = Head([], method=b"POST", keep_alive=False)
    assert response_head(closing, 200, [(b"content-length", b"0")])[2] is False


def test_a_body_that_does_not_fit_its_length_is_a_framing_error() -> None:
    _, framing, _ = response_head(Head([], method=b"POST"), 200, [(b"content-length", b"2")])
    with pytest.raises(FramingError):
        framing.data(b"abc")
    _, framing, _ = response_head(Head([], method=b"POST"), 200, [(b"content-length", b"2")])
    framing.data(b"a")
    with pytest.raises(FramingError):
        framing.end()


def test_headers_that_would_split_a_message_are_never_written() -> None:
    with pytest.raises(FramingError):
        request_bytes("POST", b"/v1/messages", [(b"x-evil", b"a\r\nhost: other")], b"")
    assert request_bytes("POST", b"/v1/messages", [(b"host", b"gw"), (b"content-length", b"2")], b"{}") == (
        b"POST /v1/messages HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\n\r\n{}")
