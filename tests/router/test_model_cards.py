"""The router's /v1/models passes its workers' `root` through (vLLM's card field naming what the
model was loaded from), so a client such as `pdserve bench serve` can find the tokenizer."""

from __future__ import annotations

import httpx


def test_root_of_the_workers_is_passed_through(launch):
    a = launch.fake_worker("--root", "/models/tiny")
    b = launch.fake_worker("--root", "/models/tiny")
    router = launch.router("--prefill", a.url, "--decode", b.url)
    (card,) = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
    assert card["id"] == "tiny" and card["root"] == "/models/tiny"
    assert httpx.get(router.url + "/v1/models/tiny", timeout=10).json()["root"] == "/models/tiny"


def test_no_root_when_workers_disagree_or_say_none(launch):
    a = launch.fake_worker("--root", "/models/a")
    b = launch.fake_worker("--root", "/models/b")
    c = launch.fake_worker()
    for urls in ((a.url, b.url), (c.url,)):
        router = launch.router(*[arg for u in urls for arg in ("--decode", u)])
        (card,) = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
        assert card["id"] == "tiny" and "root" not in card
