"""kvconnector/vllm/namespace.py: which slot bytes share a name, and the keys each worker rank
puts and gets under in a remote store (through vLLM in vllm_connector/test_vllm_remote.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec  # noqa: E402

from kvconnector.vllm.namespace import rank_namespace, slot_order  # noqa: E402
from transfer.keys import Namespace  # noqa: E402

pytestmark = pytest.mark.vllm

ENGINE = Namespace(model="m", dtype="bfloat16", block_size=16, block_layout="x", tp_size=2,
                   salt="s")
GQA = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def parallel(rank: int, tp: int = 2, dcp: int = 1, pcp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, tensor_parallel_size=tp,
                           decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp)


def ranks(spec: FullAttentionSpec, world: int, **kw: int) -> list[tuple[bytes, bool]]:
    """(digest, writes) of every rank."""
    out = []
    for rank in range(world):
        namespace, writes = rank_namespace(ENGINE, spec, parallel(rank, **kw))
        out.append((namespace.digest, writes))
    return out


def test_slot_order_names_equal_bytes_equally() -> None:
    # A slot holds one block of every layer: the block-major chunk, or the per-layer pages in
    # layer order. Layouts that give the same slot bytes share a namespace; BHLNC does not.
    assert {slot_order(x) for x in ("BLNHC", "LBNHC")} == {"LNHC"}
    assert {slot_order(x) for x in ("BLHNC", "LBHNC", "LHBNC")} == {"LHNC"}
    assert slot_order("BHLNC") == "HLNC"


def test_each_tp_rank_of_a_gqa_cache_puts_its_own_bytes_under_its_own_keys() -> None:
    (d0, w0), (d1, w1) = ranks(GQA, 2)
    assert d0 == ENGINE.digest  # what the scheduler looks up
    assert d1 == replace(ENGINE, tp_rank=1).digest != d0
    assert (w0, w1) == (True, True)


def test_the_tp_ranks_of_an_mla_cache_share_rank_0s_keys_and_only_rank_0_puts() -> None:
    got = ranks(MLA, 4, tp=4)
    assert [d for d, _ in got] == [ENGINE.digest] * 4
    assert [w for _, w in got] == [True, False, False, False]


def test_pipeline_stages_keep_keys_of_their_own_under_mla() -> None:
    stage0, stage1 = ranks(MLA, 4)[:2], ranks(MLA, 4)[2:]  # TP 2 x PP 2, TP numbered fastest
    assert {d for d, _ in stage0} == {ENGINE.digest}
    assert {d for d, _ in stage1} == {replace(ENGINE, salt="s/pp1").digest}
    assert [w for _, w in stage0 + stage1] == [True, False, True, False]


@pytest.mark.parametrize("split", [{"dcp": 2}, {"pcp": 2}])
def test_context_parallel_mla_ranks_hold_different_tokens_so_each_puts_its_own(
        split: dict[str, int]) -> None:
    (d0, w0), (d1, w1) = ranks(MLA, 2, **split)
    assert d0 != d1 and (w0, w1) == (True, True)
