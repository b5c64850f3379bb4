"""A live worker compiles no new Triton kernel variants mid-traffic.

Triton compiles one variant of a kernel per specialization key: the constexprs, each integer
argument's "equals 1" / "divisible by 16" property and type, each pointer's 16-byte alignment,
and the launch options. A key that depends on a request's shape (batch size, prompt length,
block-table width, a static buffer's row offset) means a compile of seconds in the middle of
serving, the first time a workload meets it (docs/performance.md, v3).

The test drives a Triton-backend engine through a start-up warm-up (what the GPU engine does
before serving: one long prefill, decode at batch 1 and at max_num_seqs, as graph capture does)
and then through many requests of random prompt lengths, output lengths and arrival times,
with a small token budget, so steps are prefill chunks, mixed steps and decode batches of every
size over growing block tables. It records each launch's key and requires the traffic phase to
meet no key the warm-up did not.

On CPU the kernels run under TRITON_INTERPRET=1, which compiles nothing; the key of each launch
is computed by Triton's own binder logic (`native_specialize_impl` over the kernel's signature
and its do_not_specialize lists): what the compiled JITFunction would look up in its cache.
On a CUDA machine the test also counts the entries of every kernel's compiled-variant cache.
"""

from __future__ import annotations

import inspect
import random
from collections import defaultdict

import pytest
import torch

from tests.kernels.kernel_inputs import ON_GPU

KERNEL_MODULES = ["kv_cache_write", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "rotary",
                  "rotary_kv_write", "silu_and_mul"]


def launchable_kernels() -> dict[str, object]:
    """Every @triton.jit function of pdserve.kernels (device-side helpers included: never launched)."""
    import importlib

    from triton.runtime.jit import KernelInterface

    found = {}
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(f"pdserve.kernels.{mod_name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, KernelInterface):
                found[f"{mod_name}.{name}"] = obj
    return found


def _binder(kernel):
    """Triton's argument binder for this kernel: (*args, **kwargs) -> (args, specialization, options)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel.device_caches[torch.cuda.current_device()][-1]
    from triton.backends import BaseBackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    opts = kernel.kwargs  # the InterpretedFunction keeps the decorator's arguments
    dns, dns_oa = opts.get("do_not_specialize") or [], opts.get("do_not_specialize_on_alignment") or []
    sig = inspect.signature(kernel.fn)
    params = [KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
              for i, p in enumerate(sig.parameters.values())]
    return create_function_from_signature(sig, params, BaseBackend)


class KeyRecorder:
    """Wraps each kernel's launch path and records the specialization key of every launch."""

    def __init__(self, monkeypatch):
        self.keys: dict[str, set] = defaultdict(set)
        self.launches: dict[str, int] = defaultdict(int)
        self.kernels = launchable_kernels()
        for name, kernel in self.kernels.items():
            monkeypatch.setattr(kernel, "run", self._wrap(name, kernel, kernel.run))

    def _wrap(self, name, kernel, run):
        binders = {}

        def recorded_run(*args, grid, warmup, **kwargs):
            if "b" not in binders:
                binders["b"] = _binder(kernel)
            _, spec, options = binders["b"](*args, **kwargs)
            self.keys[name].add((tuple(repr(s) for s in spec), tuple(sorted(map(repr, options.items())))))
            self.launches[name] += 1
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        return recorded_run

    def snapshot(self) -> dict[str, set]:
        return {k: set(v) for k, v in self.keys.items()}


def compiled_variants(kernels: dict[str, object]) -> dict[str, int]:
    """GPU only: how many variants each kernel holds in Triton's in-memory cache."""
    dev = torch.cuda.current_device()
    return {name: len(k.device_caches[dev][0]) for name, k in kernels.items() if dev in k.device_caches}


def _engine(tmp_path_factory, arch: str):
    from tests.checkpoints import write_checkpoint, write_word_tokenizer
    from tests.helpers.engines import device_engine

    tok = write_word_tokenizer(tmp_path_factory.mktemp("tok"))
    # One layer: the interpreter costs ~0.3 s a launch, and every layer launches the same kernels.
    ckpt = write_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, tok, num_hidden_layers=1,
                            **({"layer_types": ["full_attention"]} if arch.startswith("qwen") else {}))
    # static_decode: decode-only steps go through the CUDA-graph buffers (captured on the GPU,
    # run directly on CPU), everything else eagerly: both paths, as in production.
    return device_engine(ckpt, attention_backend="triton", static_decode=True, max_model_len=160,
                         max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET, gpu_memory_utilization=0.2,
                         enable_prefix_caching=False)


def _serve(engine, rng: random.Random, requests: list[tuple[int, int]]) -> None:
    """Requests (prompt length, output length) arrive a few per step at random; runs to completion."""
    from pdserve.worker.request.sampling_params import SamplingParams

    pending = list(requests)
    n = 0
    while pending or engine.has_work():
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if pending:
                prompt_len, out_len = pending.pop()
                prompt = [rng.randrange(10, 1000) for _ in range(prompt_len)]
                engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0,
                                                                   ignore_eos=True))
                n += 1
        engine.step()


MAX_NUM_SEQS = 8
BUDGET = 24  # tokens per step: long prompts are chunked, and chunks share steps with decodes


def _warm_up(engine, rng: random.Random) -> None:
    # What start-up runs before traffic: a prefill at the token budget, decode at batch 1, and
    # decode at max_num_seqs (on the GPU, graph capture runs every bucket once eagerly too).
    _serve(engine, rng, [(BUDGET, 2)])
    _serve(engine, rng, [(2, 2)] * MAX_NUM_SEQS)


# qwen2: the qkv bias in the fused epilogue, tied embeddings; qwen3: the q/k norms in it.
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_traffic_meets_no_specialization_the_warm_up_missed(tmp_path_factory, monkeypatch, arch):
    recorder = KeyRecorder(monkeypatch)
    engine = _engine(tmp_path_factory, arch)
    rng = random.Random(17)
    _warm_up(engine, rng)
    warm, warm_compiled = recorder.snapshot(), compiled_variants(recorder.kernels) if ON_GPU else {}
    launches_after_warm_up = dict(recorder.launches)

    # Prompts past a block-table width of 16 columns (block size 4) change the eager table's
    # padded width; 1-token prompts are prefills that look like decodes.
    traffic = [(rng.choice([1, 3, 9, 30, 70]) + rng.randint(0, 4), rng.randint(1, 5)) for _ in range(12)]
    _serve(engine, rng, traffic)

    assert sum(recorder.launches.values()) > 3 * sum(launches_after_warm_up.values()) // 2, "traffic ran little"
    new = {k: recorder.keys[k] - warm.get(k, set()) for k in recorder.keys}
    new = {k: v for k, v in new.items() if v}
    assert not new, f"kernel variants first met during traffic (each a compile mid-serving): {new}"
    # Bounded per kernel: decode has two (split with the merge fused in, and unsplit), the rest one.
    # rms_norm: with and without the residual (the first layer's input norm has none).
    for name, keys in recorder.keys.items():
        assert len(keys) <= (2 if "decode" in name or "rms_norm" in name else 1), (name, keys)
    if ON_GPU:
        assert compiled_variants(recorder.kernels) == warm_compiled


def test_per_step_integers_are_not_specialized():
    # The arguments that change every step are excluded from the key by name: if a refactor
    # renames one, this says which, instead of a silent return of mid-traffic compiles.
    kernels = launchable_kernels()

    def excluded(kernel, attr):
        opts = getattr(kernel, "kwargs", None) or {attr: getattr(kernel, attr, None)}
        return set(opts.get(attr) or [])

    expect = {
        "paged_decode_attention._decode_split_kernel": ({"num_splits", "stride_btb"},
                                                        {"bt_ptr", "ctx_ptr", "pos_ptr", "slot_ptr"}),
        "paged_decode_attention._decode_reduce_kernel": ({"num_splits"}, set()),
        "paged_prefill_attention._prefill_kernel": ({"num_seqs", "stride_btb"}, {"bt_ptr", "cu_q_ptr", "ctx_ptr"}),
        "rotary_kv_write._rotary_kv_write_kernel": (set(), {"pos_ptr", "slot_ptr"}),
    }
    for name, (dns, dns_oa) in expect.items():
        k = kernels[name]
        params = set(inspect.signature(k.fn).parameters)
        assert dns | dns_oa <= params, (name, (dns | dns_oa) - params)
        assert dns <= excluded(k, "do_not_specialize"), name
        assert dns_oa <= excluded(k, "do_not_specialize_on_alignment"), name
