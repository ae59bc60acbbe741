"""Decode attention on block-major layer views vs layer-major views vs a contiguous cache.

The cost of the block-major layout (docs/design.md): one layer's pages lie num_layers x
further apart. This times the same stride-reading Triton decode kernel
(benchmarks/attention_kernels.py) on one layer of
- a block-major buffer (BLHNC / BLNHC) through kvconnector's layer-view factory,
- a layer-major buffer (LBHNC / LBNHC, vLLM's default) through the same factory,
- a contiguous per-layer cache,
all holding the same values (outputs are checked bit-identical), with a random non-adjacent block
table. Repetitions are interleaved (variant order rotated each round); the figure is the median
of the per-round medians. Bar: block-major / layer-major within 2% (docs/benchmarks.md).

    python benchmarks/bench_attention.py --json bench_attention.json

Needs a CUDA GPU; about 70 GB of GPU memory at the default batch (64 seqs x 2048 tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton
import triton.testing
from attention_kernels import paged_decode_attention, paged_decode_mla

from kvconnector.layout.descriptor import KVForm, KVLayout
from kvconnector.layout.views import layer_view

DEVICE = "cuda"
TARGET_RATIO = 1.02


@dataclass(frozen=True)
class Preset:
    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_q_heads: int
    form: KVForm
    view_kind: str
    pairs: tuple[tuple[str, str], ...]  # (block-major order, layer-major order)


PRESETS = (
    Preset("llama-3.1-8b", 32, 8, 128, 16, 32, KVForm.PACKED, "vllm",
           (("BLHNC", "LBHNC"), ("BLNHC", "LBNHC"))),
    # DeepSeek-V3 MLA at TP 8: 61 layers, one latent head (512 + 64 rope), 16 query heads, block 64.
    Preset("deepseek-v3-mla", 61, 1, 576, 64, 16, KVForm.MLA, "mla", (("BLNHC", "LBNHC"),)),
)


def time_call(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` (triton's do_bench: L2 flushed between calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def random_block_table(num_seqs: int, blocks_per_seq: int) -> tuple[torch.Tensor, int]:
    """(table, num_blocks): a random permutation of odd block ids, so no two are adjacent."""
    needed = num_seqs * blocks_per_seq
    ids = 2 * torch.randperm(needed) + 1
    return ids.view(num_seqs, blocks_per_seq).to(torch.int32).to(DEVICE), 2 * needed + 1


def make_views(preset: Preset, block_order: str, layer_order: str, num_blocks: int,
               layer: int) -> dict[str, torch.Tensor]:
    """The three caches of `layer`, holding the same values (random normal)."""
    views = {}
    raws = []
    for variant, order in (("block-major", block_order), ("layer-major", layer_order)):
        layout = KVLayout(preset.num_layers, preset.num_kv_heads, preset.head_size,
                          preset.block_size, torch.bfloat16, preset.form, order)
        raw = torch.empty(layout.buffer_bytes(num_blocks), dtype=torch.uint8, device=DEVICE)
        raws.append(raw)
        views[variant] = layer_view(raw, layout, num_blocks, layer, preset.view_kind)
    raws[0].view(torch.bfloat16).normal_()  # every layer of the block-major buffer
    views["layer-major"].copy_(views["block-major"])
    views["contiguous"] = views["block-major"].contiguous()
    return views


def bench_pair(preset: Preset, block_order: str, layer_order: str, num_seqs: int, seq_len: int,
               reps: int) -> dict[str, object]:
    blocks_per_seq = -(-seq_len // preset.block_size)
    table, num_blocks = random_block_table(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEVICE)
    query = torch.randn(num_seqs, preset.num_q_heads, preset.head_size, device=DEVICE,
                        dtype=torch.bfloat16)
    layer = preset.num_layers // 2
    views = make_views(preset, block_order, layer_order, num_blocks, layer)
    kernel = paged_decode_mla if preset.form is KVForm.MLA else paged_decode_attention
    calls = {name: (lambda cache=cache: kernel(query, cache, table, seq_lens))
             for name, cache in views.items()}

    outputs = {name: call() for name, call in calls.items()}
    identical = all(torch.equal(out, outputs["contiguous"]) for out in outputs.values())

    names = list(calls)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            rounds[name].append(time_call(calls[name]))
    median_ms = {name: statistics.median(times) for name, times in rounds.items()}

    content = views["contiguous"].shape[-1]
    kv_bytes = num_seqs * seq_len * preset.num_kv_heads * content * 2
    del views, outputs, calls
    torch.cuda.empty_cache()
    return {
        "preset": preset.name, "block_order": block_order, "layer_order": layer_order,
        "layer": layer, "num_blocks": num_blocks, "kv_bytes_read": kv_bytes,
        "outputs_identical": identical,
        "rounds_ms": rounds, "median_ms": median_ms,
        "gbps": {name: kv_bytes / (ms * 1e-3) / 1e9 for name, ms in median_ms.items()},
        "ratio_block_over_layer": median_ms["block-major"] / median_ms["layer-major"],
        "ratio_block_over_contiguous": median_ms["block-major"] / median_ms["contiguous"],
    }


def print_table(results: list[dict[str, object]]) -> None:
    print(f"{'preset':<16} {'orders':<13} {'block us':>9} {'layer us':>9} {'contig us':>9} "
          f"{'block GB/s':>10} {'blk/layer':>9} {'blk/contig':>10}  bit-identical")
    for r in results:
        ms, gbps = r["median_ms"], r["gbps"]
        ok = "ok" if r["ratio_block_over_layer"] <= TARGET_RATIO else "OVER 2%"
        print(f"{r['preset']:<16} {r['block_order'] + '/' + r['layer_order']:<13} "
              f"{ms['block-major'] * 1e3:>9.1f} {ms['layer-major'] * 1e3:>9.1f} "
              f"{ms['contiguous'] * 1e3:>9.1f} {gbps['block-major']:>10.0f} "
              f"{r['ratio_block_over_layer']:>9.4f} {r['ratio_block_over_contiguous']:>10.4f}  "
              f"{'yes' if r['outputs_identical'] else 'NO'}  ({ok})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=7, help="interleaved rounds per variant")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    results = [bench_pair(preset, block_order, layer_order, args.num_seqs, args.seq_len,
                          args.reps)
               for preset in PRESETS for block_order, layer_order in preset.pairs]
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "command": " ".join([sys.executable, *sys.argv]),
        "num_seqs": args.num_seqs, "seq_len": args.seq_len, "reps": args.reps,
        "presets": [asdict(p) for p in PRESETS],
        "results": results,
    }
    print(f"{record['date']}  {record['gpu']}  torch {record['torch']}  "
          f"triton {record['triton']}  {args.num_seqs} seqs x {args.seq_len} tokens, "
          f"median of {args.reps} interleaved rounds, middle layer")
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2, default=str)
    # A mismatch means a view reads the wrong bytes: the timing would be meaningless.
    return 0 if all(r["outputs_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
