"""Mid-stream migration under load (issue 49's measurement, not a test): kill -9 the decode worker
serving streams until `--hits` streams were hit; every answer against its uninterrupted twin.

    pdserve bench migration --out DIR [--hits 50] [--concurrency 8] [--prefill 1] [--decode 3]
                            [--prompt-tokens 64] [--max-tokens 64] [--checkpoint DIR --worker-args='...']
    pdserve bench migration --make-checkpoint DIR [--shape llama-3.1-8b --config-only]

The stack is `pdserve up`'s (cli/stack.py's plan: a router, `--prefill` prefill and `--decode`
decode workers), each child started here so one can be killed alone. On a random-weight Llama (a
word tokenizer, one word per id, so prompts have exact lengths; a chat template that joins the
messages) a closed loop of `--concurrency` clients streams requests of six shapes in turn: greedy
completions with logprobs; seeded completions with penalties, `min_tokens` and a stop string;
seeded `n=2` with a stop list; two prompts; seeded chat with top logprobs; greedy chat with a stop.
Every request has its own seed and `x-request-id`.

The killer picks a stream in flight between `--kill-at` fractions of its tokens, among those that
cannot end early (no stop string, EOS ignored: the kill finds it with tokens left), finds the decode
worker serving it (each worker's `/debug/kv` lists the request ids it serves), SIGKILLs that
worker (every stream it served is hit), starts a replacement on the same ports and waits until
the router routes to it again before the next kill, so the pool keeps its capacity. Once the hits
are in, the clients stop, and each request is sent again to a worker that is never killed (the
prefill worker; with `--prefill 0` a reference worker of its own): its uninterrupted twin.

Reported (DIR/results.md, summary.json, gaps.png, logs/): failed requests (not 200, an error
event, no `[DONE]`), answers equal to their twins (text, finish, usage; logprobs to 1e-4), per
hit the gap the client saw (the longest of the intervals between its last event before the kill
and its third after) against the re-prefill time (the reference worker, idle, prefilling prompts
of the continuation's lengths: prompt + the tokens the router continued, per its log), the
router's migration metrics (by cause, tokens re-prefilled, its own gap histogram), and the
inter-event gaps of the streams away from any kill for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.report import markdown_table, publish

SHAPES = ("greedy-logprobs", "seeded-penalties-stop", "seeded-n2-stops", "seeded-2-prompts", "chat-seeded-logprobs",
          "chat-greedy-stop")
# Joins the messages: enough for chat requests on the word tokenizer (no special tokens: exact lengths).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
            initializer_range=0.2)  # peaked logits: greedy has no near-ties, as tests/checkpoints.py's
MOVED = re.compile(r"stream (\S+) moved to .* after its worker was (\w+) \((\d+) tokens continued\)")


def log(msg: str) -> None:
    print(f"[migration {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the checkpoint ------------------------------------------------------------------------------

def make_checkpoint(path: str, shape: str, config_only: bool) -> None:
    """bench/disagg.py's random Llama and word tokenizer, with a chat template; `config_only`: no
    weights (the workers then need --load-format dummy)."""
    from transformers import AutoTokenizer, LlamaConfig

    from pdserve.bench.disagg import save_word_tokenizer
    from pdserve.bench.model_shapes import MODELS

    spec = TINY if shape == "tiny" else MODELS[shape].hf
    cfg = LlamaConfig(**spec, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    if config_only:
        cfg.save_pretrained(path)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    save_word_tokenizer(path, cfg.vocab_size)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)


# ---- the requests ---------------------------------------------------------------------------------

def body_of(i: int, prompt_tokens: int, max_tokens: int, vocab: int, shapes=SHAPES) -> tuple[str, str, dict]:
    """Request i: its shape, route and body (its own prompt and seed)."""
    rng = random.Random(i)
    words = lambda n: " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(n))  # noqa: E731
    shape = shapes[i % len(shapes)]
    seed = 1000 + i
    common = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
    if shape == "greedy-logprobs":
        return shape, "completions", {**common, "prompt": words(prompt_tokens), "temperature": 0, "ignore_eos": True,
                                      "logprobs": 1}
    if shape == "seeded-penalties-stop":
        return shape, "completions", {**common, "prompt": words(prompt_tokens), "seed": seed, "temperature": 1.0,
                                      "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                                      "min_tokens": max_tokens // 2, "stop": [" w7"]}
    if shape == "seeded-n2-stops":
        return shape, "completions", {**common, "prompt": words(prompt_tokens), "seed": seed, "n": 2, "logprobs": 0,
                                      "stop": [" w5", " w9"], "ignore_eos": True}
    if shape == "seeded-2-prompts":
        return shape, "completions", {**common, "prompt": [words(prompt_tokens), words(prompt_tokens)], "seed": seed,
                                      "temperature": 0.8, "ignore_eos": True}
    messages = [{"role": "user", "content": words(prompt_tokens)}]
    if shape == "chat-seeded-logprobs":
        return shape, "chat", {**common, "messages": messages, "seed": seed, "temperature": 1.0, "logprobs": True,
                               "top_logprobs": 2, "ignore_eos": True}
    return shape, "chat", {**common, "messages": messages, "temperature": 0, "stop": ["w4"]}


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def answer(events: list[bytes], route: str) -> dict:
    """A stream as comparable data: per choice text, logprobs, finish; usage; [DONE]; an error."""
    choices: dict[int, dict] = {}
    out = {"choices": choices, "usage": None, "done": False, "error": None}
    for e in events:
        if not e.startswith(b"data: "):
            continue
        if e.strip() == b"data: [DONE]":
            out["done"] = True
            continue
        try:
            chunk = json.loads(e[6:])
        except ValueError:
            out["error"] = f"not JSON: {e[:200]!r}"
            continue
        if "error" in chunk:
            out["error"] = chunk["error"]
            continue
        if chunk.get("usage"):
            out["usage"] = {k: chunk["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for c in chunk.get("choices") or ():
            slot = choices.setdefault(c["index"], {"text": "", "logprobs": [], "finish": None})
            slot["text"] += (c.get("text") if route == "completions" else (c.get("delta") or {}).get("content")) or ""
            lp = c.get("logprobs")
            if lp:
                slot["logprobs"] += lp["content"] if route == "chat" else [
                    list(t) for t in zip(lp["tokens"], lp["token_logprobs"], lp.get("text_offset") or [])]
            slot["finish"] = c.get("finish_reason") or slot["finish"]
    return out


def close(a, b, tol: float) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, abs_tol=tol)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def first_diff(a, b, tol: float, path: str = "") -> str | None:
    """Where two answers first differ, and how (None: `close`)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=lambda k: (k != "text", str(k))):  # the text first
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'the stream' if k in a else 'the twin'}"
            if (d := first_diff(a[k], b[k], tol, f"{path}.{k}")) is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for k, (x, y) in enumerate(zip(a, b)):
            if (d := first_diff(x, y, tol, f"{path}[{k}]")) is not None:
                return d
        return None if len(a) == len(b) else f"{path}: {len(a)} items in the stream, {len(b)} in the twin"
    if isinstance(a, str) and isinstance(b, str) and a != b:
        k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"{path} at char {k}: {a[max(0, k - 40):k + 60]!r} != {b[max(0, k - 40):k + 60]!r}"
    return None if close(a, b, tol) else f"{path}: {a!r} != {b!r}"


@dataclass
class Stream:
    i: int
    rid: str
    shape: str
    route: str
    body: dict
    expected: int  # tokens it may produce (choices x max_tokens): its progress's denominator
    times: list[float] = field(default_factory=list)  # arrival of each event
    events: list[bytes] = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    finished: float | None = None
    kills: list[float] = field(default_factory=list)  # when a worker serving it was killed

    @property
    def progress(self) -> float:
        return len(self.events) / self.expected

    def runs_to_max(self) -> bool:
        """Every choice runs to max_tokens: no stop string can end it, nor EOS."""
        return bool(self.body.get("ignore_eos")) and not self.body.get("stop")

    def failure(self) -> str | None:
        if self.error:
            return self.error
        if self.status != 200:
            return f"status {self.status}"
        a = answer(self.events, self.route)
        if a["error"]:
            return f"error event {a['error']}"
        return None if a["done"] else "no [DONE]"

    def gap_at(self, t_kill: float) -> float | None:
        """The longest interval from its last event before the kill to its third after."""
        before = [k for k, t in enumerate(self.times) if t <= t_kill]
        if not before or before[-1] + 1 >= len(self.times):
            return None
        k = before[-1]
        return max(self.times[j + 1] - self.times[j] for j in range(k, min(k + 3, len(self.times) - 1)))


# ---- the processes ---------------------------------------------------------------------------------

@dataclass
class Proc:
    name: str
    argv: tuple
    env: dict
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0

    def start(self) -> "Proc":
        self.starts += 1
        out = open(self.log_path, "ab")
        out.write(f"\n==== start {self.starts} at {time.strftime('%H:%M:%S')}\n".encode())
        out.flush()
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                     process_group=0)  # not a session: cli/launcher.py says why
        return self

    async def kill(self) -> float:
        """SIGKILL; the seconds until the process is gone (its sockets close only then: the kernel
        frees its memory first). Waited for off the event loop, so the clients' clocks run on."""
        t = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(self.proc.wait, 60)
        return time.monotonic() - t

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(60)


async def wait_up(client, p: Proc, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}; its log: {p.log_path}")
        try:
            if (await client.get(p.url + path, timeout=5)).status_code == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{p.name} not ready after {timeout:.0f} s; its log: {p.log_path}")


async def routable(client, router: Proc, url: str) -> bool:
    try:
        ws = (await client.get(router.url + "/debug/workers", timeout=5)).json()
    except Exception:
        return False
    return any(w["url"] == url and w["routable"] for w in ws)


def build_stack(args, ckpt: str, logs: Path) -> tuple[Proc, list[Proc], list[Proc], Proc]:
    """router, prefill workers, decode workers, the reference (a prefill worker, else one of its own)."""
    from pdserve.cli.stack import StackConfig, free_port, plan, split_flags

    cfg = StackConfig(model=ckpt, prefill=args.prefill, decode=args.decode, host="127.0.0.1", port=free_port(),
                      device=args.device, kv_transfer=args.kv_transfer,
                      worker_args=("--max-model-len", str(args.max_model_len), *split_flags(args.worker_args)),
                      router_args=("--log-level", "info", "--pd-min-prompt-tokens", "1",
                                   *split_flags(args.router_args)))
    children = plan(cfg, ckpt, "bench")
    procs = [Proc(c.name, c.argv, c.env, c.url, logs / f"{c.name}.log") for c in children]
    router = procs[-1]
    prefill = [p for p, c in zip(procs, children) if c.role == "prefill"]
    decode = [p for p, c in zip(procs, children) if c.role == "decode"]
    if prefill:
        return router, prefill, decode, prefill[0]
    # A worker like the decode ones (role both without prefill workers), on ports of its own, outside the pool.
    argv = list(decode[0].argv)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    ref = Proc("reference", tuple(argv), dict(decode[0].env), f"http://127.0.0.1:{port}", logs / "reference.log")
    return router, prefill, decode, ref


# ---- the run -----------------------------------------------------------------------------------

class Run:
    def __init__(self, args, vocab: int):
        self.args = args
        self.vocab = vocab
        self.streams: dict[str, Stream] = {}
        self.kills: list[dict] = []
        self.hits: list[tuple[str, float]] = []  # (request id, kill time) per stream served by a killed worker
        self.stop_sending = asyncio.Event()
        self.next_i = 0
        self.t0 = time.monotonic()

    def new_stream(self) -> Stream:
        i, self.next_i = self.next_i, self.next_i + 1
        shape, route, body = body_of(i, self.args.prompt_tokens, self.args.max_tokens, self.vocab, self.args.shapes)
        choices = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
        s = Stream(i, f"mig-{os.getpid()}-{i}", shape, route, body, choices * self.args.max_tokens)
        self.streams[s.rid] = s
        return s

    async def client(self, http, url: str) -> None:
        while not self.stop_sending.is_set():
            s = self.new_stream()
            await stream_into(http, url, s, {"x-request-id": s.rid})

    async def killer(self, http, router: Proc, decode: list[Proc]) -> None:
        a, rng = self.args, random.Random(7)
        lo, hi = a.kill_at
        until = min(self.t0 + a.budget_s, a.started + a.deadline_s - a.reserve_s)
        while len(self.hits) < a.hits and time.monotonic() < until:
            running = [s for s in self.streams.values() if s.finished is None]
            live = [s for s in running if not s.kills and lo <= s.progress <= hi and s.runs_to_max()]
            if not live or len(running) < a.concurrency // 2:  # the loop's streams not all started yet
                await asyncio.sleep(0.01)
                continue
            chosen = rng.choice(live)
            kvs = await asyncio.gather(*(http.get(d.url + "/debug/kv", timeout=5) for d in decode),
                                       return_exceptions=True)
            victim = next((d for d, kv in zip(decode, kvs) if not isinstance(kv, BaseException)
                           and chosen.rid in kv.json().get("requests", ())), None)
            if victim is None:  # between its legs, or just finished: choose again
                await asyncio.sleep(0.005)
                continue
            if chosen.finished is not None:  # it ended while the workers were asked: choose again
                continue
            served = set(kvs[decode.index(victim)].json()["requests"])
            # A stream is hit if it was still open when the signal went: the router may move it and
            # finish it elsewhere before the dead process is reaped.
            t_kill = time.monotonic()
            death_s = await victim.kill()
            hit = [rid for rid in served if rid in self.streams
                   and (self.streams[rid].finished is None or self.streams[rid].finished > t_kill)]
            for rid in hit:
                self.streams[rid].kills.append(t_kill)
                self.hits.append((rid, t_kill))
            self.kills.append({"t": t_kill - self.t0, "worker": victim.name, "chosen": chosen.rid,
                               "served": sorted(served), "hit": sorted(hit), "death_s": round(death_s, 3)})
            log(f"kill {len(self.kills)}: {victim.name} serving {len(served)} ({len(hit)} in flight); "
                f"hits {len(self.hits)}/{a.hits}")
            if a.no_restart:
                decode = [d for d in decode if d is not victim]
                if len(decode) < 2:  # the last one's streams would have nowhere but the prefill worker
                    break
                continue
            # A replacement on the same ports; the next kill once the router routes to it again.
            t_restart = time.monotonic()
            victim.start()
            await wait_up(http, victim, "/health", a.ready_timeout_s)
            deadline = time.monotonic() + 60
            while not await routable(http, router, victim.url) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            self.kills[-1]["restart_s"] = round(time.monotonic() - t_restart, 2)
        self.stop_sending.set()


async def stream_into(http, url: str, s: Stream, headers: dict | None = None) -> None:
    """One streamed request, its events timed as they arrive."""
    buf = b""
    try:
        async with http.stream("POST", url + PATHS[s.route], json={"model": "bench", **s.body},
                               headers=headers or {}) as r:
            s.status = r.status_code
            if r.status_code != 200:
                s.error = f"status {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for data in r.aiter_raw():
                now = time.monotonic()
                buf += data
                *whole, buf = buf.split(b"\n\n")
                for e in whole:
                    if e:
                        s.events.append(e + b"\n\n")
                        s.times.append(now)
    except Exception as e:  # a failed request, reported
        s.error = f"{type(e).__name__}: {e}"
    finally:
        s.finished = time.monotonic()


async def twins(http, ref: Proc, streams: list[Stream], concurrency: int, tol: float) -> tuple[int, list[str]]:
    """Each request again on the reference worker: how many answers equal it, and what differed."""
    sem = asyncio.Semaphore(concurrency)
    equal, diffs = 0, []

    async def one(s: Stream) -> None:
        nonlocal equal
        twin = Stream(s.i, s.rid + "-twin", s.shape, s.route, s.body, s.expected)
        async with sem:
            await stream_into(http, ref.url, twin)
        if twin.failure():
            diffs.append(f"{s.rid} ({s.shape}): the twin failed: {twin.failure()}")
            return
        got, want = answer(s.events, s.route), answer(twin.events, s.route)
        if close(got, want, tol):
            equal += 1
        else:
            diffs.append(f"{s.rid} ({s.shape}, killed {len(s.kills)}x): {first_diff(got, want, tol)}")

    await asyncio.gather(*(one(s) for s in streams))
    return equal, diffs


async def reprefill_time(http, ref: Proc, lengths: list[int], vocab: int, seed: int) -> float:
    """The reference worker, idle, prefilling fresh prompts of these lengths in one request."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    t = time.monotonic()
    r = await http.post(ref.url + "/v1/completions", json={"model": "bench", "prompt": prompts, "max_tokens": 1,
                                                           "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:  # reported, not fatal: the rest of the run stands
        log(f"re-prefill of {lengths} tokens: {r.status_code} {r.text[:300]}")
        return float("nan")
    return time.monotonic() - t


def router_metrics(text: str) -> dict:
    out: dict = {"migrations": {}, "reprefilled_tokens": 0.0, "gap_sum": 0.0, "gap_count": 0.0}
    for line in text.splitlines():
        if line.startswith("pdserve_router_migrations_total{"):
            cause = re.search(r'cause="([^"]+)"', line).group(1)
            out["migrations"][cause] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_router_migration_reprefilled_tokens_total"):
            out["reprefilled_tokens"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_router_migration_gap_seconds_sum"):
            out["gap_sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_router_migration_gap_seconds_count"):
            out["gap_count"] = float(line.rsplit(" ", 1)[1])
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def run(args) -> dict:
    import httpx

    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = str(out / "checkpoint")
        if not (Path(ckpt) / "tokenizer.json").exists():
            make_checkpoint(ckpt, "tiny", config_only=False)
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    router, prefill, decode, ref = build_stack(args, ckpt, logs)
    workers = [*prefill, *decode] + ([] if ref in prefill else [ref])
    limits = httpx.Limits(max_connections=4 * args.concurrency + 16)
    summary: dict = {"args": {k: v for k, v in vars(args).items() if k != "func"}}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s), limits=limits) as http:
        try:
            t = time.monotonic()
            for w in workers:
                w.start()
            await asyncio.gather(*(wait_up(http, w, "/health", args.ready_timeout_s) for w in workers))
            router.start()
            await wait_up(http, router, "/ready", 60)
            summary["start_s"] = round(time.monotonic() - t, 1)
            log(f"stack up in {summary['start_s']} s: {len(prefill)} prefill, {len(decode)} decode; "
                f"{args.concurrency} clients")
            r = Run(args, vocab)
            # One request first on every path, so no kill lands on a cold worker's first step.
            await asyncio.gather(*(stream_into(http, router.url, r.new_stream()) for _ in range(len(decode))))
            r.streams.clear()
            r.t0 = time.monotonic()
            clients = [asyncio.create_task(r.client(http, router.url)) for _ in range(args.concurrency)]
            await r.killer(http, router, decode)
            await asyncio.gather(*clients)
            load_s = time.monotonic() - r.t0
            log(f"load done in {load_s:.1f} s: {len(r.streams)} requests, {len(r.kills)} kills, {len(r.hits)} hits")
            metrics = router_metrics((await http.get(router.url + "/metrics")).text)
            streams = sorted(r.streams.values(), key=lambda s: s.i)
            # Every stream hit, and up to --twins others (all by default), against its twin.
            others = [s for s in streams if not s.kills]
            if args.twins is not None:
                others = random.Random(3).sample(others, min(args.twins, len(others)))
            checked = sorted([s for s in streams if s.kills] + others, key=lambda s: s.i)
            equal, diffs = await twins(http, ref, checked, args.concurrency, args.logprob_tol)
            # The router's own account of each move: request id -> tokens continued, in order.
            moved: dict[str, list[tuple[str, int]]] = {}
            for m in MOVED.finditer(router.log_path.read_text(errors="replace")):
                moved.setdefault(m.group(1), []).append((m.group(2), int(m.group(3))))
            rows = []
            seen: dict[str, int] = {}
            for rid, t_kill in r.hits:
                s = r.streams[rid]
                k = seen[rid] = seen.get(rid, -1) + 1
                gap = s.gap_at(t_kill)
                a = answer(s.events, s.route)
                cont = moved.get(rid, [])[k][1] if k < len(moved.get(rid, [])) else None
                nprompts = len(s.body["prompt"]) if isinstance(s.body.get("prompt"), list) else 1
                per_prompt = (a["usage"] or {}).get("prompt_tokens", 0) // nprompts
                n = s.body.get("n", 1)
                before = answer([e for e, t in zip(s.events, s.times) if t <= t_kill], s.route)
                open_ = max(1, nprompts * n - sum(1 for c in before["choices"].values() if c["finish"]))
                rows.append({"rid": rid, "shape": s.shape, "gap_s": gap, "continued": cont, "choices": open_,
                             "lengths": ([per_prompt + (cont or 0) // open_] * open_)})
            for row in rows:
                row["lengths"] = [max(1, min(n, args.max_model_len - 8)) for n in row["lengths"]]
                row["reprefill_s"] = await reprefill_time(http, ref, row["lengths"], vocab, len(row["lengths"]))
            # Inter-event gaps away from any kill (more than 2 s from one), for scale.
            steady = [b - a_ for s in streams for a_, b in zip(s.times, s.times[1:])
                      if all(abs(a_ - t) > 2.0 for t in s.kills)]
        finally:
            for p in [router, *workers]:
                p.stop()
    failed = [f"{s.rid} ({s.shape}): {s.failure()}" for s in streams if s.failure()]
    gaps = [x["gap_s"] for x in rows if x["gap_s"] is not None]
    rep = [x["reprefill_s"] for x in rows if x["reprefill_s"] == x["reprefill_s"]]
    summary.update({
        "load_s": round(load_s, 1), "requests": len(streams), "kills": r.kills, "hits": len(r.hits),
        "streams_hit": len({rid for rid, _ in r.hits}), "failed": failed, "equal": equal, "checked": len(checked),
        "diffs": diffs[:20],
        "router": metrics, "moved_in_router_log": sum(map(len, moved.values())), "per_hit": rows,
        "gap_s": {"p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99), "max": max(gaps, default=float("nan"))},
        "reprefill_s": {"p50": pct(rep, 0.5), "p99": pct(rep, 0.99), "max": max(rep, default=float("nan"))},
        "steady_gap_s": {"p50": pct(steady, 0.5), "p99": pct(steady, 0.99)},
        "death_s": statistics.median([k["death_s"] for k in r.kills] or [float("nan")]),
        "restart_s": statistics.median([k["restart_s"] for k in r.kills if "restart_s" in k] or [float("nan")]),
    })
    return summary


# ---- the report ----------------------------------------------------------------------------------

def report(s: dict, machine: str) -> str:
    a = s["args"]
    ms = lambda x: f"{x * 1e3:.0f}" if x == x else "-"  # noqa: E731
    g, rp, st = s["gap_s"], s["reprefill_s"], s["steady_gap_s"]
    causes = ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["router"]["migrations"].items())) or "none"
    rg = s["router"]
    rows = [
        ["requests (closed loop)", f"{s['requests']} over {s['load_s']} s, {a['concurrency']} clients"],
        ["kills (SIGKILL of the decode worker serving a chosen stream)", str(len(s["kills"]))],
        ["streams hit (migrations the kills caused)", f"{s['hits']} ({s['streams_hit']} distinct streams)"],
        ["failed requests", str(len(s["failed"]))],
        ["answers equal to their uninterrupted twin", f"{s['equal']} of {s['checked']} checked (every stream hit"
         + (")" if s["checked"] == s["requests"] else f", {s['checked'] - s['hits']} others)")],
        ["router: migrations by cause", causes],
        ["router: tokens re-prefilled", f"{rg['reprefilled_tokens']:.0f}"],
        ["router: gap (its histogram's mean)",
         f"{ms(rg['gap_sum'] / rg['gap_count'])} ms" if rg["gap_count"] else "-"],
        ["SIGKILL to the process gone, its sockets closed (median)", f"{ms(s['death_s'])} ms"],
        ["replacement worker start to routable (median)", f"{s['restart_s']:.1f} s"],
    ]
    gaps = markdown_table(["per hit", "p50 ms", "p99 ms", "max ms"], [
        ["client-visible gap at the migration", ms(g["p50"]), ms(g["p99"]), ms(g["max"])],
        ["re-prefill of the continuation (idle reference worker)", ms(rp["p50"]), ms(rp["p99"]), ms(rp["max"])],
        ["gap between events away from kills (for scale)", ms(st["p50"]), ms(st["p99"]), "-"],
    ], right={1, 2, 3})
    lines = [f"Machine: {machine}. Stack: router + {a['prefill']} prefill + {a['decode']} decode workers "
             f"({a['kv_transfer'] or 'default'} KV transfer), prompts of {a['prompt_tokens']} tokens, "
             f"up to {a['max_tokens']} out, six request shapes in turn (bench/migration.py).", "",
             markdown_table(["", ""], rows), "", gaps]
    if s["failed"]:
        lines += ["", "Failed:", *[f"- {f}" for f in s["failed"][:20]]]
    if s["diffs"]:
        lines += ["", "Not equal:", *[f"- {d}" for d in s["diffs"][:10]]]
    return "\n".join(lines)


def plot(s: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    gaps = [x["gap_s"] * 1e3 for x in s["per_hit"] if x["gap_s"] is not None]
    rep = [x["reprefill_s"] * 1e3 for x in s["per_hit"] if x["reprefill_s"] == x["reprefill_s"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    top = max(gaps + rep + [1.0])
    bins = [top * k / 30 for k in range(31)]
    ax.hist(gaps, bins=bins, alpha=0.7, label=f"client-visible gap at the migration (n={len(gaps)})")
    ax.hist(rep, bins=bins, alpha=0.6, label="re-prefill of the continuation, idle worker")
    ax.axvline(s["steady_gap_s"]["p50"] * 1e3, color="k", ls="--", lw=1, label="median gap between events, no kill")
    ax.set_xlabel("ms")
    ax.set_ylabel("migrations")
    ax.set_title(f"{s['hits']} streams hit by {len(s['kills'])} SIGKILLs: {len(s['failed'])} failed, "
                 f"{s['equal']}/{s['checked']} equal", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", help="results.md, summary.json, gaps.png, logs/")
    p.add_argument("--hits", type=int, default=50, help="streams to hit (a kill hits every stream its worker serves)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: the decode workers prefill)")
    p.add_argument("--decode", type=int, default=3, help="decode workers (one is killed at a time)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="the request shapes sent in turn, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kill-at", default="0.2,0.7", help="a stream is chosen between these fractions of its tokens")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--kv-transfer", default=None, help="tcp | nixl (default: pdserve up's)")
    p.add_argument("--checkpoint", metavar="DIR", help="a checkpoint (default: a tiny random one made in DIR)")
    p.add_argument("--worker-args", default="", help="more flags for every worker, one quoted string")
    p.add_argument("--router-args", default="", help="more flags for the router")
    p.add_argument("--no-restart", action="store_true", help="a killed worker stays down (a quick check of the "
                   "harness: the pool shrinks, no kill leaves fewer than one decode worker)")
    p.add_argument("--budget-s", type=float, default=500.0, help="no kill after this many seconds of load")
    p.add_argument("--deadline-s", type=float, default=1e9, help="the whole run's wall limit: no kill after it "
                   "less --reserve-s (the twins, the report and the stop still fit)")
    p.add_argument("--reserve-s", type=float, default=60.0)
    p.add_argument("--twins", type=int, default=None, help="check every stream hit and this many others against "
                   "their twins (default: every request)")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--logprob-tol", type=float, default=1e-4)
    p.add_argument("--machine", default="this machine", help="named in the report")
    p.add_argument("--make-checkpoint", metavar="DIR", help="only write a checkpoint to DIR")
    p.add_argument("--shape", default="tiny", help="with --make-checkpoint: tiny or a bench/model_shapes.py name")
    p.add_argument("--config-only", action="store_true",
                   help="with --make-checkpoint: no weights (--load-format dummy)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench migration", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.shape, args.config_only)
        return 0
    if not args.out:
        p.error("--out is required")
    try:
        lo, hi = (float(x) for x in args.kill_at.split(","))
        assert 0 <= lo < hi <= 1
    except (ValueError, AssertionError):
        p.error(f"--kill-at: two fractions LO,HI with 0 <= LO < HI <= 1, got {args.kill_at!r}")
    args.kill_at = (lo, hi)
    args.shapes = tuple(x for x in args.shapes.split(",") if x)
    if not args.shapes or set(args.shapes) - set(SHAPES):
        p.error(f"--shapes: some of {', '.join(SHAPES)}, got {','.join(args.shapes)!r}")
    args.started = time.monotonic()
    if args.hits < 1 or args.concurrency < 1 or args.decode < 2:
        p.error("--hits and --concurrency must be >= 1, --decode >= 2 (a killed worker's streams need another)")
    s = asyncio.run(run(args))
    out = Path(args.out)
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    plot(s, out / "gaps.png")
    publish(report(s, args.machine), out / "results.md")
    return 0 if not s["failed"] and s["equal"] == s["checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
