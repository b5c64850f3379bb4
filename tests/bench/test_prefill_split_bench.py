"""tools/gpu/prefill_split.py: the cuts it times are the connector's, and the CPU smoke run writes a
row per split with the prefill really cut that way (each chunk one step)."""

from __future__ import annotations

import pytest

from tools.gpu import prefill_split


@pytest.mark.parametrize("split, chunks", [
    (None, [3000]), ("tail", [2488, 512]), ("taper", [1464, 1024, 512]), ("even", [512] * 5 + [440]),
    ("taper", [512]), ("tail", [88, 512]),
])
def test_the_cuts_are_the_streamed_splits(split, chunks):
    assert prefill_split.chunks_of(split, sum(chunks)) == chunks


def test_smoke_run_writes_a_row_per_split_and_steps_each_chunk(tmp_path, monkeypatch):
    from pdserve.worker.executor.model_runner import ModelRunner

    steps = []
    launch = ModelRunner.launch

    def counted(self, batch, *a, **k):
        steps.append(batch.num_tokens)
        return launch(self, batch, *a, **k)

    monkeypatch.setattr(ModelRunner, "launch", counted)
    out = tmp_path / "split.md"
    assert (
        prefill_split.main(["--smoke", "--prompt", "600", "--repeat", "1", "--pressure", "0", "--out", str(out)]) == 0
    )
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 600 |")]
    assert [r.split(" | ")[1] for r in rows] == ["one step (600)", "tail 512 (88+512)", "taper 512 (88+512)",
                                                 "even 512 (512+88)"]
    for r in rows:
        wall, launch_ms = (float(v.split()[0]) for v in r.split(" | ")[3:5])
        assert wall > 0 and launch_ms > 0
    # Each split's prefills (two warm-ups and the timed one; no profiler on CPU) ran as its chunks.
    assert steps == [600] * 3 + [88, 512] * 3 + [88, 512] * 3 + [512, 88] * 3
