"""The router's HTTP/1.1 client (router/http1.py) against real sockets: a scripted asyncio
server answers each request as the test says (content-length, chunked, cut off, reset)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from pdserve.router.http1 import Client, UpstreamConnectionError

BOUND_S = 10.0  # every wait below is for a condition; this only stops a broken test hanging


class Worker:
    """A TCP server whose handler, per connection, is `script(reader, writer, worker)`."""

    def __init__(self, script):
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.eof = asyncio.Event()  # a connection was closed by the client
        self.server = None

    async def __aenter__(self) -> "Worker":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader) -> bytes | None:
        """One request, head and body; None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.eof.set()
            return None
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


def run(coro):
    async def bounded():
        async with asyncio.timeout(BOUND_S):
            return await coro

    return asyncio.run(bounded())


async def keep_alive_json(reader, writer, worker):
    while (body := await worker.request(reader)) is not None:
        answer = b'{"echo": ' + body + b"}"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
            b"X-Multi: a\r\nX-Multi: b\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer
        )


def test_content_length_answers_reuse_one_connection_and_send_one_head():
    async def main():
        async with Worker(keep_alive_json) as w:
            client = Client(limit=8, headers={"Authorization": "Bearer k"})
            for i in range(3):
                r = await client.post(w.url, "/v1/completions", b"%d" % i, {"x-request-id": "r%d" % i})
                assert r.status == 200 and r.content_type == "application/json"
                assert r.headers.get("X-MULTI") == "a, b"
                assert await r.read() == b'{"echo": %d}' % i
                r.close()
            client.close()
            return w

    w = run(main())
    assert w.connections == 1
    head = w.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"POST /v1/completions HTTP/1.1"
    assert {b"x-request-id: r0", b"Content-Length: 1", b"Authorization: Bearer k"} <= set(head)
    assert any(line.startswith(b"Host: 127.0.0.1:") for line in head)


def test_chunked_body_is_relayed_as_it_comes():
    """The second chunk is written only once the client has read the first: nothing waits for
    the whole body."""
    first_read = asyncio.Event()

    async def chunked(reader, writer, worker):
        await worker.request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n"
        )
        await first_read.wait()
        writer.write(b"2\r\n1\n\r\n1\r\n\n\r\n0\r\n\r\n")
        await writer.drain()
        await worker.request(reader)  # the connection went back to the pool: a second request comes
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    async def main():
        async with Worker(chunked) as w:
            client = Client(limit=8)
            r = await client.post(w.url, "/x", b"{}", {})
            got = [await r.readany()]
            assert got == [b"data: "] and not r.at_eof()
            first_read.set()
            while data := await r.readany():
                got.append(data)
            assert b"".join(got) == b"data: 1\n\n" and r.at_eof()
            r.close()
            again = await client.post(w.url, "/x", b"{}", {})
            assert again.status == 204 and await again.read() == b""
            client.close()
            return w

    assert run(main()).connections == 1


def cut_off(answer_head: bytes, partial_body: bytes):
    async def script(reader, writer, worker):
        await worker.request(reader)
        writer.write(answer_head + partial_body)
        await writer.drain()

    return script


@pytest.mark.parametrize(
    "head, partial",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"0123456789"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"a\r\n0123456789\r\n"),
    ],
    ids=["content-length", "chunked"],
)
def test_a_connection_closed_mid_body_fails_the_reader(head, partial):
    async def main():
        async with Worker(cut_off(head, partial)) as w:
            client = Client(limit=8)
            r = await client.post(w.url, "/x", b"{}", {})
            assert r.status == 200
            got = b""
            with pytest.raises(UpstreamConnectionError, match="mid-answer"):
                while True:
                    got += await r.readany()
            assert got == b"0123456789"
            client.close()

    run(main())


def test_a_body_ended_by_the_connection_is_complete():
    async def main():
        async with Worker(cut_off(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"all of it")) as w:
            client = Client(limit=8)
            r = await client.post(w.url, "/x", b"{}", {}, total_s=60.0)
            assert await r.read() == b"all of it"
            assert client._in_use == 0  # the connection's slot is free again
            client.close()

    run(main())


async def reset(reader, writer, worker):
    """Read the request, then close with SO_LINGER 0: the client gets a TCP reset."""
    await worker.request(reader)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def test_a_worker_that_resets_or_refuses_fails_the_call():
    async def main():
        async with Worker(reset) as w:
            client = Client(limit=8)
            with pytest.raises(UpstreamConnectionError):
                await client.post(w.url, "/x", b"{}", {})
            url = w.url
        with pytest.raises(UpstreamConnectionError, match="cannot connect"):
            await client.post(url, "/x", b"{}", {})  # the server is gone: refused
        assert client._in_use == 0  # every slot given back
        client.close()

    run(main())


def test_closing_an_unread_answer_closes_the_connection():
    """That is how a worker learns that the client left (it aborts the request)."""

    async def endless(reader, writer, worker):
        await worker.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await worker.request(reader)  # EOF: sets worker.eof

    async def main():
        async with Worker(endless) as w:
            client = Client(limit=8)
            r = await client.post(w.url, "/x", b"{}", {})
            assert await r.readany() == b"hello"
            r.close()
            await w.eof.wait()
            assert client._in_use == 0
            client.close()

    run(main())


async def silent(reader, writer, worker):
    """Reads a request and never answers; reads the next one too, so the client's close shows as EOF."""
    await worker.request(reader)
    await worker.request(reader)


def test_total_timeout_and_cancellation_close_the_connection():
    async def main():
        async with Worker(silent) as w:
            client = Client(limit=8)
            with pytest.raises(asyncio.TimeoutError):
                await client.post(w.url, "/x", b"{}", {}, total_s=0.05)
            await w.eof.wait()
            w.eof.clear()
            task = asyncio.ensure_future(client.post(w.url, "/x", b"{}", {}))
            while len(w.requests) < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await w.eof.wait()
            assert client._in_use == 0
            client.close()

    run(main())


def test_the_connection_limit_holds_a_call_until_one_is_free():
    gate = asyncio.Event()

    async def held(reader, writer, worker):
        while await worker.request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
            await gate.wait()  # the rest of the body only when the test says
            gate.clear()
            writer.write(b"cd")

    async def main():
        async with Worker(held) as w:
            client = Client(limit=1)
            first = await client.post(w.url, "/x", b"1", {})
            second = asyncio.ensure_future(client.post(w.url, "/x", b"2", {}))
            while not client._waiters:  # the second call waits for the one connection allowed
                await asyncio.sleep(0)
            assert len(w.requests) == 1
            gate.set()
            assert await first.read() == b"abcd"
            first.close()
            answer = await second
            gate.set()
            assert await answer.read() == b"abcd"
            client.close()
            return w

    assert run(main()).connections == 1


def test_a_kept_alive_connection_closed_unanswered_is_retried_once_on_a_new_one():
    """The worker closed an idle connection (its keep-alive timeout) just as it was reused: it
    answered nothing on it, so the request goes once more on a fresh connection."""

    async def closes_the_second(reader, writer, worker):
        if worker.connections > 1:
            await keep_alive_json(reader, writer, worker)
            return
        body = await worker.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await worker.request(reader)  # read, never answered: the connection closes

    async def main():
        async with Worker(closes_the_second) as w:
            client = Client(limit=8)
            assert await (await client.post(w.url, "/x", b"1", {})).read() == b"1"
            assert await (await client.post(w.url, "/x", b"2", {})).read() == b'{"echo": 2}'
            client.close()
            return w

    w = run(main())
    assert w.connections == 2 and len(w.requests) == 3


def test_idle_bound_fails_a_wait_for_data_not_a_slow_reader():
    gate = asyncio.Event()

    async def stalls(reader, writer, worker):
        await worker.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await gate.wait()
        writer.write(b"1\r\nb\r\n")
        await worker.request(reader)  # then nothing, until the client closes

    async def main():
        async with Worker(stalls) as w:
            client = Client(limit=8)
            r = await client.post(w.url, "/x", b"{}", {})
            r.idle_s = 0.05
            await asyncio.sleep(0.1)  # longer than idle_s, but no read waited: no timeout
            assert await r.readany() == b"a"
            gate.set()
            assert await r.readany() == b"b"
            with pytest.raises(asyncio.TimeoutError):
                await r.readany()
            r.close()
            await w.eof.wait()
            client.close()

    run(main())


def test_first_byte_bound_fails_a_silent_worker_and_closes_the_connection():
    async def main():
        async with Worker(silent) as w:
            client = Client(limit=8)
            with pytest.raises(asyncio.TimeoutError):
                await client.post(w.url, "/x", b"{}", {}, first_byte_s=0.05)
            await w.eof.wait()
            assert client._in_use == 0
            client.close()

    run(main())


def test_a_call_bound_ends_with_its_call_on_a_kept_alive_connection():
    """The bounds are one timer per connection: a finished call's bound, passed while the
    connection is idle, fails nothing; a later call with a shorter bound than the one the timer
    was armed for is still cut off at its own."""
    gate = asyncio.Event()

    async def answers_then_stalls(reader, writer, worker):
        body = await worker.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        body = await worker.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await gate.wait()
        await worker.request(reader)  # read, never answered
        await worker.request(reader)

    async def main():
        async with Worker(answers_then_stalls) as w:
            client = Client(limit=8)
            assert await (await client.post(w.url, "/x", b"1", {}, total_s=0.05)).read() == b"1"
            await asyncio.sleep(0.1)  # past the first call's bound, with the connection idle
            assert await (await client.post(w.url, "/x", b"2", {}, total_s=60.0)).read() == b"2"
            gate.set()
            # The timer is armed for the second call's 60 s; this call's 0.05 s bound comes first.
            with pytest.raises(asyncio.TimeoutError):
                await client.post(w.url, "/x", b"3", {}, first_byte_s=0.05)
            await w.eof.wait()
            assert client._in_use == 0
            client.close()
            return w

    assert run(main()).connections == 1


def test_the_total_bound_covers_the_body():
    async def head_then_nothing(reader, writer, worker):
        await worker.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        await worker.request(reader)

    async def main():
        async with Worker(head_then_nothing) as w:
            client = Client(limit=8)
            r = await client.post(w.url, "/x", b"{}", {}, total_s=0.1)
            with pytest.raises(asyncio.TimeoutError):
                await r.read()
            await w.eof.wait()
            assert client._in_use == 0
            client.close()

    run(main())


def test_a_body_past_the_read_buffer_then_another_answer_on_the_connection():
    """A body larger than what is buffered unread pauses the socket; once it is read, the
    connection carries the next call."""
    big = b"x" * (3 << 20)

    async def large(reader, writer, worker):
        while await worker.request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)

    async def main():
        async with Worker(large) as w:
            client = Client(limit=8)
            for _ in range(2):
                r = await client.post(w.url, "/x", b"{}", {})
                assert await r.read() == big
                r.close()
            client.close()
            return w

    assert run(main()).connections == 1
