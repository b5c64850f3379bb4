"""worker/parallel/ on CPU: each parallel layer loads its rank's slice of a full weight and, over
a real 2-process gloo group, computes what the unsharded layer computes; the all-reduce
communicator's dispatch (symmetric memory / NCCL / gloo by message) and its gloo path.

The CUDA methods (symmetric-memory one-shot / two-shot, NCCL) cannot run here: their dispatch is
tested as a pure function, the kernels on the GPU (tools/gpu/tp.sh, docs/tp-gpu-results.md)."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F

from pdserve.worker.config.model import ModelConfig
from pdserve.worker.parallel.communicator import AllReduceConfig, choose
from pdserve.worker.parallel.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    logits,
)
from pdserve.worker.parallel.shard import TPShard
from tests.worker.gloo_pair import join_gloo_group, run_gloo_pair

BF16, F32 = torch.bfloat16, torch.float32
AUTO = AllReduceConfig(method="auto")


def _cfg(heads=4, kv=2, hidden=32, inter=48, vocab=101) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab, hidden, inter, 1, heads, kv, hidden // heads, 1e-5, 128, False,
                       True, False, False, 1e4, (), ())


@pytest.mark.parametrize("nbytes,dtype,device,world,symm,config,want", [
    (8192, BF16, "cpu", 2, False, AUTO, "gloo"),  # CPU: always gloo
    (8192, BF16, "cuda", 4, True, AUTO, "one_shot"),  # bs=1 decode of an 8B model: 4096 x bf16
    (256 << 10, BF16, "cuda", 2, True, AUTO, "one_shot"),  # the one-shot limit itself
    ((256 << 10) + 64, BF16, "cuda", 4, True, AUTO, "two_shot"),
    (8 << 20, F32, "cuda", 8, True, AUTO, "two_shot"),  # the buffer's size
    ((8 << 20) + 64, BF16, "cuda", 2, True, AUTO, "nccl"),  # larger than the buffer (prefill)
    (8192, BF16, "cuda", 4, False, AUTO, "nccl"),  # no symmetric buffer (no P2P): NCCL for all
    (8192, torch.float16, "cuda", 2, True, AUTO, "nccl"),  # a dtype the ops do not reduce
    (8200, BF16, "cuda", 2, True, AUTO, "nccl"),  # not 16-byte aligned
    ((256 << 10) + 16 * 3, BF16, "cuda", 3, True, AUTO, "one_shot"),  # two-shot is for 2, 4 or 8 ranks
    (8192, BF16, "cuda", 4, True, AllReduceConfig(method="nccl"), "nccl"),
    (8192, BF16, "cuda", 4, True, AllReduceConfig(method="two_shot"), "two_shot"),
    (1 << 20, BF16, "cuda", 4, True, AllReduceConfig(method="one_shot"), "one_shot"),
])
def test_all_reduce_dispatch(nbytes, dtype, device, world, symm, config, want):
    assert choose(nbytes, dtype, device, world, symm, config) == want


def test_all_reduce_method_is_validated():
    with pytest.raises(ValueError, match="PDSERVE_TP_ALL_REDUCE must be one of auto, nccl, one_shot, two_shot"):
        AllReduceConfig(method="custom")


def test_column_parallel_loaders_slice_what_the_full_layer_computes():
    """No collective needed: the ranks' outputs side by side are the full layer's (fp32, exact)."""
    torch.manual_seed(0)
    cfg = _cfg(kv=1)  # 1 KV head on 2 ranks: replicated
    d, q, kv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    wq, wk, wv = torch.randn(q, 32), torch.randn(kv, 32), torch.randn(kv, 32)
    wg, wu = torch.randn(48, 32), torch.randn(48, 32)
    x = torch.randn(3, 32)
    qs, ks, vs, gs, us = [], [], [], [], []
    for r in range(2):
        shard = TPShard(r, 2, cfg)
        qkv = QKVParallelLinear(32, d, False, shard)
        for part, w in zip("qkv", (wq, wk, wv)):
            qkv.weight_loader(qkv.weight, w, part)
        a, b, c = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        qs.append(a), ks.append(b), vs.append(c)
        gate_up = MergedColumnParallelLinear(32, [48, 48], False, shard)
        gate_up.weight_loader(gate_up.weight, wg, 0)
        gate_up.weight_loader(gate_up.weight, wu, 1)
        g, u = gate_up(x).chunk(2, dim=-1)
        gs.append(g), us.append(u)
    assert torch.equal(torch.cat(qs, -1), x @ wq.t())
    assert torch.equal(ks[0], x @ wk.t()) and torch.equal(ks[1], ks[0])  # the replicated KV head
    assert torch.equal(vs[0], x @ wv.t()) and torch.equal(vs[1], vs[0])
    assert torch.equal(torch.cat(gs, -1), x @ wg.t()) and torch.equal(torch.cat(us, -1), x @ wu.t())


def test_tp1_layers_are_the_plain_layers():
    """TP = 1: the whole tensor, no collective (none could run: there is no process group)."""
    torch.manual_seed(0)
    shard = TPShard(0, 1, _cfg())
    w, b, emb = torch.randn(32, 16), torch.randn(32), torch.randn(101, 32)
    row = RowParallelLinear(16, 32, True, shard)
    row.weight_loader(row.weight, w)
    row.weight_loader(row.bias, b)
    x = torch.randn(5, 16)
    assert torch.equal(row(x), F.linear(x, w, b))
    vocab = VocabParallelEmbedding(101, 32, shard)
    vocab.weight_loader(vocab.weight, emb)
    ids = torch.tensor([0, 50, 100])
    assert torch.equal(vocab(ids), emb[ids])
    h = torch.randn(5, 32)
    assert torch.equal(logits(h, vocab.weight, shard), (h @ emb.t()).float())


def _rank_main(rank: int, port: int, results) -> None:
    """One rank of a 2-process gloo group: the parallel layers against the full ones."""
    try:
        from pdserve.worker.parallel import communicator
        from pdserve.worker.parallel.group import shutdown_tensor_parallel

        join_gloo_group(rank, port, results)
        comm = communicator._current
        out = {"method": comm.method(torch.zeros(4096, dtype=BF16))}
        # The communicator's gloo path is a plain sum.
        x = torch.arange(8, dtype=F32) * (rank + 1)
        out["sum"] = communicator.all_reduce(x.clone()).tolist()
        torch.manual_seed(0)  # the same full weights on both ranks
        cfg = _cfg()
        w, b, emb = torch.randn(32, 48), torch.randn(32), torch.randn(101, 32)
        x = torch.randn(3, 48)
        ids = torch.tensor([0, 7, 50, 51, 100])
        shard = TPShard(rank, 2, cfg)
        row = RowParallelLinear(48, 32, True, shard)
        row.weight_loader(row.weight, w)
        row.weight_loader(row.bias, b)
        mine = x[:, rank * 24:(rank + 1) * 24]  # the column-parallel layer before it leaves this rank its slice
        out["row"] = torch.allclose(row(mine), F.linear(x, w, b), atol=1e-5)
        vocab = VocabParallelEmbedding(101, 32, shard)
        vocab.weight_loader(vocab.weight, emb)
        out["embed"] = torch.allclose(vocab(ids), emb[ids], atol=0)
        full = logits(emb[ids], vocab.weight, shard)
        out["logits"] = None if full is None else torch.allclose(full, (emb[ids] @ emb.t()).float(), atol=1e-5)
        shutdown_tensor_parallel()
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_parallel_layers_over_gloo_equal_the_full_layers():
    got = run_gloo_pair(_rank_main)
    for rank in (0, 1):
        assert isinstance(got[rank], dict), got[rank]
        assert got[rank]["method"] == "gloo"
        assert got[rank]["sum"] == [3.0 * i for i in range(8)]  # 1x + 2x
        assert got[rank]["row"] and got[rank]["embed"]
    assert got[0]["logits"] is True and got[1]["logits"] is None  # gathered to rank 0 only


def test_tensor_parallel_imports_go_one_way():
    """parallel/ imports neither the runner, the engine, the model nor kv/ (the engine hands the
    runner class and the KV side of the ranks to the rank processes); the runner never imports
    the rank processes; kv/ takes the head ranges from parallel/shard.py, not from the model.
    Lazy imports included."""
    from tests.test_layering import imported_modules

    parallel = imported_modules("worker/parallel")
    assert set(parallel) >= {f"worker/parallel/{f}.py" for f in ("shard", "layers", "communicator", "group")}
    upward = ("pdserve.worker.executor.model_runner", "pdserve.worker.engine", "pdserve.worker.models",
              "pdserve.worker.kv")
    assert not {f: sorted(m for m in mods if m.startswith(upward)) for f, mods in parallel.items()
                if any(m.startswith(upward) for m in mods)}
    runner = imported_modules("worker")["worker/executor/model_runner.py"]
    assert "pdserve.worker.executor.tp_ranks" not in runner
    ranks = imported_modules("worker")["worker/executor/tp_ranks.py"]
    runner_or_engine = ("pdserve.worker.executor.model_runner", "pdserve.worker.engine")
    assert not {m for m in ranks if m.startswith(runner_or_engine)}
    kv = imported_modules("worker/kv")
    assert not {f for f, mods in kv.items() if any(m.startswith("pdserve.worker.models") for m in mods)}
    assert "pdserve.worker.parallel.shard" in kv["worker/kv/tp_transfer.py"]
