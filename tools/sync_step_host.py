"""The synchronous engine step's host time outside the model forward, on CPU, for two trees side by side.

    python tools/sync_step_host.py --tree new=/path/to/checkout [--tree old=/path/to/older] \
        [--rounds 3] [--steps 200] [--batches 1 64 256] [--profile DIR]

Each tree is imported from a link farm of its top-level folders (as tools/gpu/lib.sh builds), in
its own subprocess; the trees take turns, `--rounds` times, so a drift in the machine's load lands
on both. The engine runs a tiny random Qwen2 on CPU with async scheduling off and the decode
graphs' static-buffer path (`static_decode=True`: the buffers and padding of a CUDA-graph step,
the forward called instead of replayed). The model forward is a stub that returns zeros of the
right shape, and the whole of `DecodeGraphs._forward` (what a graph replay replaces on a GPU) is
timed and subtracted: what is left is everything else the host does per step (scheduling, input
planning, the step's copies, sampling, reading the tokens back, the requests' bookkeeping,
outputs). The logits projection stays real (tiny here; on a GPU a launch) and is reported apart.
"Exposed" is the part a GPU would idle through: from the step's start to the replay, and from the
tokens' read-back (where the host waits for the device) to the step's end; the host work between
the replay and the wait (logits, sampling launches, the read-back's setup) overlaps the device.

Per batch size B: B greedy requests of 16 prompt tokens decode `--steps` tokens; the steps where
all B decode are timed (median ms/step, and the share in the logits projection). `--profile`:
cProfile of the same steps, per function tottime in us/step, written per tree and batch size.
Numbers name this machine only: CUDA syncs, pinned copies and kernel launches are absent here
(the docs page that reports a run says which ones the GPU path adds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import cProfile, json, pstats, statistics, sys, time, io
import torch
torch.set_num_threads(1)
ckpt, batches, steps, prof_dir, tag = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
kv_bytes = int(sys.argv[6])
try:
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.request.sampling_params import SamplingParams
except ImportError:  # the tree of 2026-11-26
    from pdserve.worker.engine import LLMEngine
    from pdserve.worker.config import EngineConfig
    from pdserve.worker.sampling_params import SamplingParams
kw = dict(model=ckpt, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=max(batches),
          max_num_batched_tokens=8192, enable_prefix_caching=False, kv_cache_memory=kv_bytes)
if "async_scheduling" in EngineConfig.__dataclass_fields__:
    kw["async_scheduling"] = False
engine = LLMEngine(EngineConfig(**kw), attention_backend="torch", static_decode=True)
model = engine.runner.model
hidden_size = model.cfg.hidden_size if hasattr(model, "cfg") else engine.model_config.hidden_size
zeros = torch.zeros(max(batches) * 64 + 8192, hidden_size)
proj = [0.0]
real_logits = model.compute_logits
def stub_forward(input_ids, positions, meta, *a, **k):
    return zeros[: input_ids.shape[0]]
def timed_logits(rows):
    t0 = time.perf_counter()
    out = real_logits(rows)
    proj[0] += time.perf_counter() - t0
    return out
model.forward = stub_forward
model.compute_logits = timed_logits
# On a GPU the whole of DecodeGraphs._forward (metadata views and the forward) is the graph: timed apart.
graphs = engine.runner.graphs
fwd = [0.0]
real_graph_forward = graphs._forward
marks = {}
def timed_graph_forward(*a, **k):
    t0 = marks["replay"] = time.perf_counter()
    out = real_graph_forward(*a, **k)
    fwd[0] += time.perf_counter() - t0
    return out
graphs._forward = timed_graph_forward
# On a GPU the host waits for the step's tokens where the runner reads them back (the old tree:
# inside run(); main: in collect()); what runs after that, and before the replay, is exposed:
# the device idles through it. Between the replay and the wait the host overlaps the device.
runner = engine.runner
wait_fn = "collect" if hasattr(runner, "collect") else "run"
real_wait = getattr(runner, wait_fn)
def timed_wait(*a, **k):
    out = real_wait(*a, **k)
    marks["read"] = time.perf_counter()
    return out
setattr(runner, wait_fn, timed_wait)
vocab = engine.model_config.vocab_size
result = {}
for B in batches:
    for warm in (True, False):
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        for i in range(B):
            engine.add_request(f"{tag}-{B}-{warm}-{i}", [(7 * i + j) % (vocab - 3) + 3 for j in range(16)], params)
        times, projs, fwds, exposed = [], [], [], []
        prof = cProfile.Profile() if (prof_dir and not warm) else None
        while engine.has_work():
            running = len(engine.scheduler.running)
            waiting = engine.scheduler.num_waiting + len(engine._inbox)
            decode = running == B and waiting == 0 and all(r.num_computed_tokens > r.num_prompt_tokens
                                                          for r in engine.scheduler.running)
            p0, f0 = proj[0], fwd[0]
            if decode and prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            dt = t1 - t0
            if decode and prof is not None:
                prof.disable()
            if decode:
                fwds.append(fwd[0] - f0)
                exposed.append((marks["replay"] - t0) + (t1 - marks["read"]))
                times.append(dt - fwds[-1])
                projs.append(proj[0] - p0)
    result[B] = dict(ms=1e3 * statistics.median(times), proj_ms=1e3 * statistics.median(projs),
                     fwd_ms=1e3 * statistics.median(fwds), exposed_ms=1e3 * statistics.median(exposed),
                     steps=len(times))
    if prof is not None:
        st = pstats.Stats(prof)
        rows = []
        for (fn, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
            short = fn.split("/pdserve/")[-1] if "/pdserve/" in fn else fn.rsplit("/", 1)[-1]
            rows.append((f"{short}:{name}", nc / len(times), 1e6 * tt / len(times), 1e6 * ct / len(times)))
        with open(f"{prof_dir}/{tag}-bs{B}.json", "w") as f:
            json.dump(rows, f)
print(json.dumps(result))
"""


def link_farm(tree: str, root: str) -> str:
    farm = os.path.join(root, "pdserve")
    os.makedirs(farm)
    for d in ("worker", "kernels", "bench", "protocol", "router", "cli"):
        if os.path.isdir(os.path.join(tree, d)):
            os.symlink(os.path.join(tree, d), os.path.join(farm, d))
    return root


def make_checkpoint(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(256)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                            unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--profile", help="write per-function cProfile rows (JSON) here")
    ap.add_argument("--kv-mib", type=int, default=64,
                    help="KV cache MiB (4 KiB blocks: the default 64 is 16k blocks; an H200 holds 673k of the 0.5B's)")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    tmp = tempfile.mkdtemp(prefix="sync-step-host-")
    ckpt = os.path.join(tmp, "ckpt")
    make_checkpoint(ckpt)
    farms = {name: link_farm(os.path.abspath(path), os.path.join(tmp, name)) for name, path in trees.items()}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            env = dict(os.environ, PYTHONPATH=farms[name], OMP_NUM_THREADS="1")
            prof = args.profile if (args.profile and r == 0) else ""
            out = subprocess.run([sys.executable, "-c", CHILD, ckpt, json.dumps(args.batches), str(args.steps),
                                  prof, name, str(args.kv_mib << 20)], env=env, capture_output=True, text=True, cwd=tmp)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print("| batch | tree | host ms/step (each round) | exposed ms/step | logits projection ms | graph forward ms (subtracted) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for b in args.batches:
        for n in trees:
            rs = [x[str(b)] for x in runs[n]]
            med = {k: statistics.median(r[k] for r in rs) for k in ("ms", "exposed_ms", "proj_ms", "fwd_ms")}
            each = ", ".join(f"{r['ms']:.3f}" for r in rs)
            print(f"| {b} | {n} | {med['ms']:.3f} ({each}) | {med['exposed_ms']:.3f} | {med['proj_ms']:.3f} | "
                  f"{med['fwd_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
