"""A stand-in for `pdserve worker`, run as its own process, for router tests that need faults
the real worker cannot be made to produce on demand (500s, dying mid-stream, hanging) and for
checking exactly what the router sent. It implements the worker contract of the router issue:
OpenAI completions/chat (stream and not), the P/D handshake, /health, /metrics (vLLM names),
/v1/models, /debug/kv. "Generation" is deterministic text derived from the prompt, so P/D output
can be compared with a single worker's.

    python tests/router/fake_worker.py --port P [--model NAME] [--delay S] [--prefill-delay S] [--kv-events HOST]
        [--json-prefill]

Test hooks: POST /control {"mode": ok|500|request_failed|die_mid_stream|hang|exit_now|unhealthy, "after": n,
"waiting": x} (500 fails requests while /health stays 200, so the router must notice by itself;
request_failed is the 500 of a request the engine failed alone, which the router must not count);
{"refuse": code}: every completion is refused with that status (a client error of any class,
in OpenAI's shape; held, as any answer, while "answer" is held); 0 serves them again;
{"slow_health": n, "health_delay": s}: the next n /health answers each wait s seconds first
(a worker too busy to answer its probe in time); GET /debug/health counts the slow ones answered
and the /v1/models requests.
{"models_status": code}: what /v1/models answers (--models-status at start; a worker whose
model list the router cannot read yet).
GET /debug/requests (bodies and headers received).

The streamed hand-off (issue 24), as a prefill worker: a request whose kv_transfer_params ask for
`stream_kv` gets two NDJSON lines (unless --json-prefill: an old worker's one JSON answer), line
1 the early params (pinned at admission), line 2 the ordinary answer. POST /control
{"hold": "line1"|"line2"} holds that line until {"release": true} ("answer": a request served
whole is recorded, then held before it answers); {"handoff": "error"|"refuse"|"break"}
makes line 2 an error (a server's, or a refusal of the request's content), or breaks the connection
instead; "ok" again restores it ("delay" and
"header_delay" set those flags' values). As a decode
worker, a request with streamed params asks the prefill's side channel (POST /kv/progress) for
the prefill's state on arrival (recorded in /debug/requests as `prefill_state_at_arrival`), then
waits there for the first token. GET /debug/events: what happened to hand-offs, in order
(line1, line2, progress, release, error, break, abort = a prefill whose caller left before line
2, d_abort = a decode whose caller left before its end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import zlib

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.protocol.contract import CODE_REQUEST_FAILED, HEADER_REQUEST_FAILED
from pdserve.protocol.disconnect import wait_for_disconnect
from pdserve.protocol.sse import SSEResponse

TOTAL_BLOCKS = 100
BLOCK_SIZE = 4


def tokens_for(prompt: str, n: int, start: int = 0) -> list[str]:
    h = zlib.crc32(prompt.encode())
    return [f" w{(h + i * 7) % 97}" for i in range(start, n)]


class NDJSONResponse(SSEResponse):
    """Closes its iterator as soon as the caller leaves (SSEResponse), as the real worker notices
    a router that closed its prefill call while the prefill runs."""

    media_type = "application/x-ndjson"


class Prefill:
    """A streamed prefill, as its side channel reports it to a decode worker."""

    def __init__(self) -> None:
        self.state = "running"  # then done (first token known), finished (it ended the request), cancelled
        self.first: str | None = None
        self.over = asyncio.Event()

    def end(self, state: str, first: str | None = None) -> None:
        self.state, self.first = state, first
        self.over.set()


def prompt_of(route: str, body: dict) -> str:
    if route == "chat":
        return "\n".join(f"{m['role']}: {m['content']}" for m in body["messages"])
    return body["prompt"] if isinstance(body["prompt"], str) else " ".join(map(str, body["prompt"]))


class State:
    def __init__(self, args):
        self.args = args
        self.mode = "ok"
        self.refuse = 0  # a status every completion is refused with (0: none)
        self.after = 0
        self.waiting = 0.0
        self.used = 0  # blocks held by running requests
        self.pinned: dict[str, tuple[int, float]] = {}  # request id -> (blocks, expiry)
        self.requests: list[dict] = []
        self.events: list[dict] = []
        self.prefills: dict[str, Prefill] = {}
        self.gates = {"line1": asyncio.Event(), "line2": asyncio.Event(), "answer": asyncio.Event()}
        for gate in self.gates.values():
            gate.set()
        self.handoff = "ok"
        self.slow_health, self.health_delay, self.slow_answered = 0, 0.0, 0
        self.models_status, self.models_asked = args.models_status, 0
        self.delay, self.header_delay = args.delay, args.header_delay  # /control may change them
        self.client = httpx.AsyncClient()
        self.publisher = None
        self.tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        if args.kv_events:
            from pdserve.protocol.kv_events import KVEventPublisher

            pub, replay = args.kv_ports.split(",")
            self.publisher = KVEventPublisher(f"fake-{args.port}-{os.getpid()}", f"tcp://{args.kv_events}:{pub}",
                                              f"tcp://{args.kv_events}:{replay}")

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            return [zlib.crc32(w.encode()) % 1000 for w in prompt.split()]
        return self.tokenizer(prompt)["input_ids"]

    def log(self, event: str, rid: str, **kw) -> None:
        self.events.append({"event": event, "rid": rid, **kw})

    def expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, exp) in self.pinned.items() if exp < now]:
            del self.pinned[rid]


def build(args) -> Starlette:
    st = State(args)

    def blocks(prompt_tokens: int) -> int:
        return prompt_tokens // BLOCK_SIZE + 1

    async def generate(request: Request) -> Response:
        route = "chat" if request.url.path.endswith("chat/completions") else "completions"
        body = await request.json()
        record = {"path": request.url.path, "body": body, "headers": dict(request.headers)}
        st.requests.append(record)
        if st.mode == "500":
            return JSONResponse({"error": {"message": "injected", "type": "internal_server_error",
                                           "param": None, "code": None}}, status_code=500)
        if st.mode == "request_failed":  # the engine failed this request alone; the worker is fine
            return JSONResponse({"error": {"message": "injected", "type": "internal_server_error", "param": None,
                                           "code": CODE_REQUEST_FAILED}},
                                status_code=500, headers={HEADER_REQUEST_FAILED: "1"})
        if st.refuse:
            await st.gates["answer"].wait()  # a refusal is an answer: held as one
            return JSONResponse({"error": {"message": f"refused with {st.refuse}", "type": "invalid_request_error",
                                           "param": "messages", "code": "injected"}}, status_code=st.refuse)
        if st.mode == "exit_now":
            os._exit(1)
        if body.get("model") != args.model:
            return JSONResponse({"error": {"message": "no such model", "type": "not_found_error",
                                           "param": "model", "code": None}}, status_code=404)
        if body.get("max_tokens", 0) < 0:
            return JSONResponse({"error": {"message": "max_tokens must be >= 0", "type": "invalid_request_error",
                                           "param": "max_tokens", "code": None}}, status_code=400)
        prompt = prompt_of(route, body)
        n_prompt = len(prompt.split())
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        rid = request.headers.get("x-request-id", "local")
        kvp = body.get("kv_transfer_params") or {}
        stop_first = "STOP1" in prompt
        if args.kv_events and st.publisher:
            words = st.tokenize(prompt)
            full = len(words) // BLOCK_SIZE
            if full:
                st.publisher.publish([{"type": "BlockStored", "block_hashes": [hash((rid, i)) for i in range(full)],
                                       "parent_block_hash": None, "token_ids": words[:full * BLOCK_SIZE],
                                       "block_size": BLOCK_SIZE}])
        if kvp.get("do_remote_decode") and kvp.get("stream_kv") and not args.json_prefill:
            return NDJSONResponse(streamed_prefill(route, rid, prompt, n_prompt, stop_first))
        if kvp.get("do_remote_decode"):
            await asyncio.sleep(args.prefill_delay)  # not cut short by a hang-up: it pins all the same
            text = tokens_for(prompt, 1)[0]
            finish = "stop" if stop_first else "length"
            params = None
            if not stop_first:
                st.expire()
                st.pinned[rid] = (blocks(n_prompt), time.monotonic() + args.pin_ttl)
                params = {"remote_url": f"http://{args.host}:{args.port}", "request_id": rid, "first": text}
            return JSONResponse(completion(route, rid, text, finish, n_prompt, 1, params))
        start = 0
        streamed = bool(kvp.get("remote_url") and kvp.get("stream_kv"))
        if streamed:
            r = await st.client.post(kvp["remote_url"] + "/kv/progress", json={"request_id": kvp["request_id"]})
            record["prefill_state_at_arrival"] = r.json()["state"]
            start = 1
        elif kvp.get("remote_url"):
            # "Pull" the KV and release the prefill side, as the real connector does.
            await st.client.post(kvp["remote_url"] + "/kv/release", json={"request_id": kvp["request_id"]})
            start = 1
        finish_reason = "stop" if stop_first else "length"
        words = tokens_for(prompt, 1 if stop_first else max_tokens, start)
        if streamed and not body.get("stream"):
            # Until it answers, a caller that leaves is noticed: the decode aborts (and releases).
            if not await until_gone(request, rid, kvp, pull(kvp)):
                return Response(status_code=499)
            if not await until_gone(request, rid, None, asyncio.sleep(st.header_delay)):
                return Response(status_code=499)
        else:
            # A real worker answers only once its first token exists (queueing + prefill, or a KV pull).
            await st.gates["answer"].wait()
            await asyncio.sleep(st.header_delay)
        if not body.get("stream"):
            return JSONResponse(
                completion(
                    route, rid, "".join(words), finish_reason, n_prompt, max_tokens if not stop_first else 1, None
                )
            )

        async def events():
            st.used += blocks(n_prompt)
            ended, pulled = False, not streamed
            try:
                if route == "chat":
                    yield sse(chunk(route, rid, {"role": "assistant", "content": ""}, None))
                if streamed:
                    # The role chunk is out before the first token exists: the router holds it.
                    pulled = await pull(kvp)
                for i, w in enumerate(words):
                    if st.mode == "die_mid_stream" and i >= st.after:
                        os._exit(1)
                    if st.mode == "hang" and i >= st.after:
                        await asyncio.sleep(3600)
                    await asyncio.sleep(st.delay)
                    # As a real worker asked for token ids: each output closed by its ids (its index).
                    yield sse(chunk(route, rid, {"content": w} if route == "chat" else w, None)) + (
                        f": token_ids 0 {i}\n\n".encode() if reports_ids else b"")
                yield sse(chunk(route, rid, {} if route == "chat" else "", finish_reason)) + (
                    b": token_ids 0 \n\n" if reports_ids else b"")
                if (body.get("stream_options") or {}).get("include_usage"):
                    u = completion(route, rid, "", None, n_prompt, max_tokens, None)["usage"]
                    yield sse({"id": rid, "object": "x", "created": 0, "model": args.model, "choices": [], "usage": u})
                yield b"data: [DONE]\n\n"
                ended = True
            finally:
                st.used -= blocks(n_prompt)
                if not ended:
                    st.log("d_abort", rid)
                    if not pulled:
                        await release_remote(kvp)

        reports_ids = request.headers.get("x-pdserve-token-ids") == "1"
        ids_header = {"x-pdserve-token-ids": "1"} if reports_ids else None
        if streamed:  # notices a caller that leaves while it waits for the prefill
            return SSEResponse(events(), headers=ids_header)
        return StreamingResponse(events(), media_type="text/event-stream", headers=ids_header)

    def streamed_prefill(route, rid, prompt, n_prompt, stop_first):
        """Two NDJSON lines: the params at admission (blocks pinned, not computed), the answer at
        the end. A caller that leaves before line 2 aborts the prefill, which cancels its pin."""
        prefill = st.prefills[rid] = Prefill()

        async def lines():
            st.pinned[rid] = (blocks(n_prompt), float("inf"))  # no TTL while the prefill runs
            answered = False
            try:
                await st.gates["line1"].wait()
                params = {"remote_url": f"http://{args.host}:{args.port}", "request_id": rid, "stream_kv": True,
                          "first": None}
                st.log("line1", rid)
                yield json.dumps({"kv_transfer_params": params}).encode() + b"\n"
                await asyncio.sleep(args.prefill_delay)
                await st.gates["line2"].wait()
                if st.handoff == "break":
                    st.log("break", rid)
                    raise RuntimeError("injected: the prefill's connection breaks after line 1")
                if st.handoff in ("error", "refuse"):
                    st.log(st.handoff, rid)
                    answered = True
                    st.pinned.pop(rid, None)
                    prefill.end("cancelled")
                    kind = "internal_server_error" if st.handoff == "error" else "invalid_request_error"
                    yield json.dumps({"error": {"message": "injected", "type": kind, "code": None}}).encode() + b"\n"
                    return
                text = tokens_for(prompt, 1)[0]
                if stop_first:  # nothing to decode: the pin goes with the answer
                    st.pinned.pop(rid, None)
                    prefill.end("finished")
                    answer = completion(route, rid, text, "stop", n_prompt, 1, None)
                else:
                    st.pinned[rid] = (blocks(n_prompt), time.monotonic() + args.pin_ttl)
                    prefill.end("done", text)
                    answer = completion(route, rid, text, "length", n_prompt, 1, {**params, "first": text})
                st.log("line2", rid)
                answered = True
                yield json.dumps(answer).encode() + b"\n"
            finally:
                if not answered:
                    st.log("abort", rid)
                    st.pinned.pop(rid, None)
                    prefill.end("cancelled")

        return lines()

    async def pull(kvp) -> bool:  # True, or it waits to be cancelled
        """The decode side of a streamed hand-off: wait on the prefill's side channel for its
        first token, then release the pin (the KV is "pulled"). False: the prefill did not end
        for this decode (failed, aborted, or its first token ended the request); the decode then
        waits for its caller to close it, as the router does."""
        r = await st.client.post(kvp["remote_url"] + "/kv/progress", json={"request_id": kvp["request_id"],
                                                                           "wait": True}, timeout=120)
        if r.json()["state"] != "done":
            await asyncio.sleep(3600)
        await st.client.post(kvp["remote_url"] + "/kv/release", json={"request_id": kvp["request_id"]})
        return True

    async def release_remote(kvp) -> None:
        try:
            await st.client.post(kvp["remote_url"] + "/kv/release", json={"request_id": kvp["request_id"]})
        except httpx.HTTPError:
            pass

    async def until_gone(request: Request, rid, kvp, work) -> bool:
        """Run `work` unless the caller leaves first: then log d_abort (and release the pin
        named by `kvp`, which this decode had not pulled yet); False."""
        task, gone = asyncio.ensure_future(work), asyncio.ensure_future(wait_for_disconnect(request.receive))
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            gone.cancel()
            task.result()
            return True
        task.cancel()
        st.log("d_abort", rid)
        if kvp is not None:
            await release_remote(kvp)
        return False

    def chunk(route, rid, payload, finish):
        if route == "chat":
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 0, "model": args.model,
                    "choices": [{"index": 0, "delta": payload, "logprobs": None, "finish_reason": finish}]}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": 0, "model": args.model,
                "choices": [{"index": 0, "text": payload, "logprobs": None, "finish_reason": finish}]}

    def completion(route, rid, text, finish, n_prompt, n_out, params):
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        if route == "chat":
            out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": 0, "model": args.model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": finish}], "usage": usage}
        else:
            out = {"id": f"cmpl-{rid}", "object": "text_completion", "created": 0, "model": args.model,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": usage}
        if params is not None:
            out["kv_transfer_params"] = params
        return out

    def sse(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    async def release(request: Request) -> Response:
        rid = (await request.json())["request_id"]
        st.log("release", rid, pinned=rid in st.pinned)
        st.pinned.pop(rid, None)
        return JSONResponse({})

    async def progress(request: Request) -> Response:
        """The prefill's side channel: its state now, or once over with "wait"."""
        body = await request.json()
        prefill = st.prefills.get(body["request_id"])
        if prefill is None:
            return JSONResponse({"state": "cancelled", "first": None})
        if body.get("wait"):
            await prefill.over.wait()
        else:
            st.log("progress", body["request_id"], state=prefill.state)
        return JSONResponse({"state": prefill.state, "first": prefill.first})

    async def control(request: Request) -> Response:
        body = await request.json()
        st.mode = body.get("mode", st.mode)
        st.refuse = body.get("refuse", st.refuse)
        st.after = body.get("after", st.after)
        st.waiting = body.get("waiting", st.waiting)
        st.handoff = body.get("handoff", st.handoff)
        st.delay = body.get("delay", st.delay)
        st.header_delay = body.get("header_delay", st.header_delay)
        st.slow_health = body.get("slow_health", st.slow_health)
        st.health_delay = body.get("health_delay", st.health_delay)
        st.models_status = body.get("models_status", st.models_status)
        if body.get("hold"):
            st.gates[body["hold"]].clear()
        if body.get("release"):
            for gate in st.gates.values():
                gate.set()
        return JSONResponse({})

    async def health(request: Request) -> Response:
        if st.slow_health > 0:
            st.slow_health -= 1
            await asyncio.sleep(st.health_delay)
            st.slow_answered += 1
        return Response(status_code=503 if st.mode == "unhealthy" else 200)

    async def debug_health(request: Request) -> Response:
        return JSONResponse({"slow_answered": st.slow_answered, "models_asked": st.models_asked})

    async def metrics(request: Request) -> Response:
        lbl = f'{{model_name="{args.model}"}}'
        return Response(f"vllm:num_requests_waiting{lbl} {st.waiting}\nvllm:num_requests_running{lbl} 0.0\n"
                        f"vllm:kv_cache_usage_perc{lbl} {st.used / TOTAL_BLOCKS}\n")

    async def models(request: Request) -> Response:
        st.models_asked += 1
        if st.models_status != 200:
            return JSONResponse({"error": {"message": "not yet"}}, status_code=st.models_status)
        card = {"id": args.model, "object": "model"}
        if args.root:
            card["root"] = args.root
        return JSONResponse({"object": "list", "data": [card]})

    async def debug_kv(request: Request) -> Response:
        st.expire()
        pinned = sum(b for b, _ in st.pinned.values())
        return JSONResponse({"num_free_blocks": TOTAL_BLOCKS - st.used - pinned, "num_total_blocks": TOTAL_BLOCKS,
                             "num_pinned_blocks": pinned})

    async def debug_requests(request: Request) -> Response:
        return JSONResponse(st.requests)

    async def debug_events(request: Request) -> Response:
        return JSONResponse(st.events)

    return Starlette(routes=[
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/kv/release", release, methods=["POST"]),
        Route("/kv/progress", progress, methods=["POST"]),
        Route("/control", control, methods=["POST"]),
        Route("/health", health), Route("/debug/health", debug_health), Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/debug/kv", debug_kv), Route("/debug/requests", debug_requests), Route("/debug/events", debug_events),
    ])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--root", default=None, help="the /v1/models card's root (what vLLM loaded the model from)")
    p.add_argument("--delay", type=float, default=0.005)
    p.add_argument("--models-status", type=int, default=200, help="what /v1/models answers until told otherwise")
    p.add_argument("--prefill-delay", type=float, default=0.0)
    p.add_argument(
        "--header-delay", type=float, default=0.0, help="seconds before the answer's headers (decode requests)"
    )
    p.add_argument("--pin-ttl", type=float, default=30.0)
    p.add_argument("--json-prefill", action="store_true", help="answer a streamed hand-off's prefill in one JSON "
                                                                  "answer, as a worker before issue 24")
    p.add_argument("--kv-events", default=None, help="host to bind the KV event sockets on")
    p.add_argument("--kv-ports", default="5557,5558", help="PUB,REPLAY ports of the KV event sockets")
    p.add_argument("--tokenizer", default=None, help="token ids for KV events (completions prompts only)")
    a = p.parse_args()
    uvicorn.run(build(a), host=a.host, port=a.port, log_level="warning")
