"""lm-eval's `local-completions` backend against a real worker equals its `hf` backend on the same
tiny fp32 checkpoint: a small local multiple-choice task (a jsonl file written here, lm-eval's
task YAML), per-sample loglikelihoods within 1e-4 and the same is_greedy flags. This is the
echo + prompt-logprobs path (`echo=True, logprobs=1, max_tokens=1`, token-id prompts, batched)."""

from __future__ import annotations

import json

import pytest

from tests.worker.test_server_harness import WorkerProcess

lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval (the dev extra)")

# Dispatched with the slow modules, before the quick ones (tests/conftest.py):
# a worker server and lm-eval's hf backend, each running both tasks once (~40 s on CI).
pytestmark = pytest.mark.slow

NAME = "tiny-lm-eval"
TOL = 1e-4
DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Madrid", " a large city in Europe"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " 22"], "answer": 0},
    {"question": "Water boils at", "choices": [" 100 degrees", " room temperature"], "answer": 0},
    {
        "question": "Q: What colour is the sky?\nA:",
        "choices": [" blue", " green", " the colour of the sea"],
        "answer": 0,
    },
]


def _task_dir(tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny.yaml").write_text(f"""task: pdserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return tmp_path


def _results(model, task_dir) -> tuple[list[tuple[float, bool]], list[str]]:
    """Both tasks in one evaluation: (per-choice (loglikelihood, is_greedy), generations), by doc."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, tasks=["pdserve_tiny_mc", GEN_NAME],
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True, bootstrap_iters=0)

    def samples(task: str) -> list[dict]:
        return sorted(out["samples"][task], key=lambda s: s["doc_id"])

    return ([tuple(r) for s in samples("pdserve_tiny_mc") for r in s["filtered_resps"]],
            [s["resps"][0][0] for s in samples(GEN_NAME)])


@pytest.fixture(scope="module")
def hf_and_worker(tiny_checkpoint, tmp_path_factory):
    """lm-eval's hf backend, then local-completions against one real worker, each running both
    tasks once: (hf's results, the worker's). One worker and one evaluation per backend for the
    module's tests (two of each cost CI ~35 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        from lm_eval.models.huggingface import HFLM
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        ckpt = str(tiny_checkpoint("llama"))
        task_dir = tmp_path_factory.mktemp("lm-eval-tasks")
        _task_dir(task_dir), _gen_task_dir(task_dir)
        want = _results(HFLM(pretrained=ckpt, device="cpu", dtype="float32", batch_size=1), task_dir)
        with WorkerProcess(ckpt, "--served-model-name", NAME, "--max-model-len", "256",
                           "--kv-cache-memory", str(32 << 20)) as w:
            api = LocalCompletionsAPI(base_url=f"{w.url}/v1/completions", model=NAME, tokenizer=ckpt,
                                      tokenizer_backend="huggingface", tokenized_requests=True, batch_size=4,
                                      num_concurrent=1, max_retries=1)
            yield want, _results(api, task_dir)


def test_local_completions_equals_hf_backend(hf_and_worker):
    (want, _), (got, _) = hf_and_worker
    assert len(got) == len(want) == sum(len(d["choices"]) for d in DOCS)
    worst = max(abs(g[0] - h[0]) for g, h in zip(got, want))
    print(f"lm-eval local-completions vs hf: max |loglikelihood difference| = {worst:.2e}, "
          f"is_greedy {[g[1] for g in got]}")
    assert worst < TOL, (worst, got, want)
    assert [g[1] for g in got] == [h[1] for h in want]


# ---- generate_until: greedy generations ----------------------------------------------------------

GEN_NAME = "pdserve_tiny_gen"


def _gen_task_dir(tmp_path):
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps({"question": d["question"], "answer": d["choices"][0]}) + "\n" for d in DOCS))
    (tmp_path / "gen.yaml").write_text(f"""task: {GEN_NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n", "."]
  do_sample: false
  max_gen_toks: 24
metric_list:
  - metric: exact_match
""")
    return tmp_path


def test_local_completions_generations_equal_hf_backend(hf_and_worker):
    """generate_until (greedy, stop strings, max_gen_toks): the worker's text equals HF generate's."""
    (_, want), (_, got) = hf_and_worker
    print(f"lm-eval generate_until local-completions vs hf: {sum(g == h for g, h in zip(got, want))}/{len(want)} equal")
    assert len(got) == len(want) == len(DOCS)
    assert all(w for w in want)  # something was generated: an empty string would equal trivially
    assert got == want
