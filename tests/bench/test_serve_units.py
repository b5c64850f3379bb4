"""`pdserve bench serve` pieces without a server: exact prompt lengths, the JSONL dataset, the
statistics and SLO parsing, gamma arrivals, and bad flags answered with the flag's name."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

import numpy as np
import pytest

from pdserve.bench import dataset, serve
from pdserve.bench.serve_metrics import RequestResult, parse_goodput, summarize


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return dataset.load_tokenizer(str(default_model_dir))


@pytest.mark.parametrize("input_len,range_ratio", [(1, 0.0), (7, 0.0), (300, 0.0), (200, 0.5)])
def test_random_prompts_encode_to_their_exact_length(tokenizer, input_len, range_ratio):
    specs = dataset.random_requests(tokenizer, 12, input_len, 9, range_ratio, seed=3)
    lo, hi = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
    for s in specs:
        assert len(tokenizer.encode(s.prompt)) == s.prompt_len  # as the server counts (special tokens too)
        assert lo <= s.prompt_len <= hi
        assert int(9 * (1 - range_ratio)) <= s.output_len <= int(9 * (1 + range_ratio))
    if range_ratio:
        assert len({s.prompt_len for s in specs}) > 1
    assert len({s.prompt for s in specs}) == len(specs)  # fresh random ids: no shared prefix cache hits
    assert specs == dataset.random_requests(tokenizer, 12, input_len, 9, range_ratio, seed=3)  # seeded


def test_file_dataset(tokenizer, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "Hello there", "output_len": 5}\n\n{"prompt": "The capital of France is"}\n')
    specs = dataset.file_requests(f, tokenizer, 5, output_len=7)
    assert len(specs) == 5
    assert {(s.prompt, s.output_len) for s in specs} == {("Hello there", 5), ("The capital of France is", 7)}
    assert all(s.prompt_len == len(tokenizer.encode(s.prompt)) for s in specs)
    f.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1"):
        dataset.file_requests(f, tokenizer, None, 7)


def test_summary_matches_numpy_and_vllm_definitions():
    rng = random.Random(0)
    results = []
    for i in range(50):
        itls = [rng.uniform(0.005, 0.05) for _ in range(9)]
        ttft = rng.uniform(0.05, 3.0)
        results.append(RequestResult(100, 10, ttft=ttft, e2e=ttft + sum(itls), itls=itls, output_tokens=10))
    results.append(RequestResult(100, 10, error="http_503:service_unavailable"))
    s = summarize(results, duration_s=10.0, slos=parse_goodput(["ttft:2000", "itl:40"]))
    ttfts = [r.ttft for r in results[:50]]
    assert s["completed"] == 50 and s["failed"] == 1 and s["errors"] == {"http_503:service_unavailable": 1}
    assert s["ttft_s"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    assert s["ttft_s"]["mean"] == pytest.approx(statistics.fmean(ttfts))
    assert s["itl_s"]["p50"] == pytest.approx(np.percentile([g for r in results[:50] for g in r.itls], 50))
    assert s["tpot_s"]["mean"] == pytest.approx(statistics.fmean((r.e2e - r.ttft) / 9 for r in results[:50]))
    good = sum(r.ttft <= 2.0 and max(r.itls) <= 0.04 for r in results[:50])
    assert 0 < good < 50
    assert s["request_goodput"] == pytest.approx(good / 10.0)
    assert s["output_throughput"] == pytest.approx(500 / 10.0)


@pytest.mark.parametrize("item", ["ttft", "foo:10", "ttft:abc", "ttft:-1", "itl:0"])
def test_bad_goodput_items(item):
    with pytest.raises(ValueError):
        parse_goodput([item])


def test_gamma_arrivals_have_the_asked_mean_and_burstiness():
    gaps = serve.arrival_gaps(8.0, 1.0, random.Random(1))
    poisson = [next(gaps) for _ in range(20000)]
    assert statistics.fmean(poisson) == pytest.approx(1 / 8, rel=0.03)
    assert statistics.pstdev(poisson) / statistics.fmean(poisson) == pytest.approx(1.0, rel=0.05)  # exponential
    gaps = serve.arrival_gaps(8.0, 4.0, random.Random(1))
    regular = [next(gaps) for _ in range(20000)]
    assert statistics.pstdev(regular) / statistics.fmean(regular) == pytest.approx(0.5, rel=0.05)  # 1/sqrt(shape)
    assert next(serve.arrival_gaps(math.inf, 1.0, random.Random(1))) == 0.0


BASE = ["--base-url", "http://127.0.0.1:9", "--model", "m"]


@pytest.mark.parametrize("flags,named", [
    (["--goodput", "latency:5"], "--goodput"),
    (["--range-ratio", "1.5"], "--range-ratio"),
    (["--sweep-rates", "1,x"], "--sweep-rates"),
    (["--sweep-rates", "1,0"], "--sweep-rates"),
    (["--num-requests", "0"], "--num-requests"),
    (["--input-len", "0"], "--input-len"),
    (["--output-len", "-3"], "--output-len"),
    (["--dataset", "/nonexistent.jsonl"], "--dataset"),
    (["--request-rate", "0"], "--request-rate"),
    (["--burstiness", "0"], "--burstiness"),
    (["--concurrency", "0"], "--concurrency"),
    (["--duration", "5"], "--duration"),  # no rate and no concurrency: unbounded
    (["--duration", "5", "--num-requests", "3"], "--num-requests"),
    (["--label", "a/b"], "--label"),
    (["--endpoint", "embeddings"], "--endpoint"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--tokenizer", "/nonexistent/tokenizer"], "--tokenizer"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(BASE + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert "Traceback" not in err


def test_dataset_and_input_len_are_exclusive(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(SystemExit):
        serve.main(BASE + ["--dataset", str(f), "--input-len", "10"])
    assert "--input-len" in capsys.readouterr().err


def test_requests_spread_over_lora_adapters():
    from itertools import islice

    def models(**kw) -> list[str]:
        return list(islice(serve.request_models(serve.LoadConfig("http://x", "base", **kw)), 300))

    assert models() == ["base"] * 300
    assert models(lora_adapters=("a", "b", "c")) == ["a", "b", "c"] * 100
    drawn = models(lora_adapters=("a", "b", "c"), lora_pick="random", seed=7)
    assert drawn == models(lora_adapters=("a", "b", "c"), lora_pick="random", seed=7)  # the seed decides
    assert drawn != models(lora_adapters=("a", "b", "c"), lora_pick="random", seed=8)
    assert set(drawn) == {"a", "b", "c"} and drawn != ["a", "b", "c"] * 100
    args = serve.build_parser().parse_args(BASE + ["--lora-adapters", "a, b"])
    cfgs, _ = serve.configs_from_args(args)
    assert cfgs[0].lora_adapters == ("a", "b") and cfgs[0].lora_pick == "round-robin"
    with pytest.raises(ValueError, match="--lora-adapters"):
        serve.configs_from_args(serve.build_parser().parse_args(BASE + ["--lora-adapters", "a,,b"]))


def test_multi_turn_prompts_resend_the_whole_history(tokenizer):
    specs = dataset.multi_turn_requests(tokenizer, 3, 4, 20, 7, seed=5)
    assert [(s.conversation, s.turn) for s in specs[:4]] == [(0, 0), (1, 0), (2, 0), (0, 1)]  # turn-major
    for c in range(3):
        turns = [s for s in specs if s.conversation == c]
        assert [s.turn for s in turns] == [0, 1, 2, 3]
        for before, after in zip(turns, turns[1:]):
            assert after.prompt.startswith(before.prompt)  # the history, then a reply and a new message
            assert after.prompt_len >= before.prompt_len + 20 + 7 - 2  # retokenized at the seams
        assert all(len(tokenizer.encode(s.prompt)) == s.prompt_len for s in turns)
    assert specs[0].prompt[:40] != specs[1].prompt[:40]  # conversations share nothing


def test_staggered_multi_turn_schedule(tokenizer):
    specs = dataset.multi_turn_requests(tokenizer, 40, 3, 4, 2, seed=1)
    sched = serve.multi_turn_schedule(specs, 4.0, 1.0, 2.5, random.Random(7))
    assert len(sched) == len(specs) and all(x >= 0 for x in sched)
    starts = [x for s, x in zip(specs, sched) if s.turn == 0]  # gaps between conversations' first turns
    thinks = [x for s, x in zip(specs, sched) if s.turn > 0]  # pauses before later turns
    assert len(starts) == 40 and len(thinks) == 80
    assert 0.15 < sum(starts) / 40 < 0.4  # mean gap 1/4 s
    assert 1.5 < sum(thinks) / 80 < 3.5  # mean think time 2.5 s
    assert sched == serve.multi_turn_schedule(specs, 4.0, 1.0, 2.5, random.Random(7))  # the seed fixes it
    # The defaults: every conversation at once, every later turn as soon as the previous one ended.
    assert serve.multi_turn_schedule(specs, math.inf, 1.0, 0.0, random.Random(7)) == [0.0] * len(specs)
    # The flags reach the load's config.
    cfgs, _ = serve.configs_from_args(serve.build_parser().parse_args(
        BASE + ["--multi-turn", "4", "2", "--conversation-rate", "0.5", "--think-time", "3"]))
    assert cfgs[0].conversation_rate == 0.5 and cfgs[0].think_time_s == 3.0


@pytest.mark.parametrize("flags, named", [
    (["--multi-turn", "2", "0"], "--multi-turn"),
    (["--multi-turn", "2", "3", "--num-requests", "5"], "--multi-turn"),
    (["--conversation-rate", "2"], "--conversation-rate"),
    (["--think-time", "2"], "--think-time"),
    (["--multi-turn", "2", "3", "--conversation-rate", "0"], "--conversation-rate"),
    (["--multi-turn", "2", "3", "--conversation-rate", "1", "--request-rate", "3"], "--conversation-rate"),
    (["--multi-turn", "2", "3", "--think-time", "-1"], "--think-time"),
])
def test_bad_multi_turn_flags(flags, named, capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["--base-url", "http://127.0.0.1:1", "--model", "m", *flags])
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [
    ([], serve.Workload("run", 1024, 128)),
    (["--label", "mt", "--multi-turn", "3", "4", "--input-len", "50"],
     serve.Workload("mt", 50, 128, multi_turn=(3, 4))),
    (["--dataset", "{data}", "--range-ratio", "0.5"], serve.Workload("run", None, 128, 0.5, "{data}")),
])
def test_a_records_workload_is_the_commands_flags(flags, expected, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi", "output_len": 3}\n')
    flags = [f.format(data=data) for f in flags]
    if expected.dataset:
        expected = dataclasses.replace(expected, dataset=str(data))
    args = serve.build_parser().parse_args(["--base-url", "http://127.0.0.1:1", "--model", "m", *flags])
    serve.configs_from_args(args)  # the command's defaults and checks, as main applies them
    work = serve.Workload.from_args(args)
    assert work == expected
    record = serve.run_record(work, serve.LoadConfig("http://127.0.0.1:1", "m"), {"completed": 0}, [], {})
    assert (record["label"], record["input_len"], record["output_len"], record["range_ratio"], record["dataset"],
            record["multi_turn"]) == (work.label, work.input_len, work.output_len, work.range_ratio, work.dataset,
                                      list(work.multi_turn) if work.multi_turn else None)


def test_a_harness_names_its_workload_without_the_commands_flags():
    # bench/handoff.py records its runs through run_record with a Workload of its own (a namespace
    # that lacked a newer flag once broke every one of its GPU runs).
    record = serve.run_record(serve.Workload("nixl-on-len3000", 3000, 32), serve.LoadConfig("http://h:1", "llama"),
                              {"completed": 0}, [], {})
    assert (record["label"], record["input_len"], record["output_len"], record["multi_turn"]) == \
        ("nixl-on-len3000", 3000, 32, None)
