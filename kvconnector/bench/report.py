"""The run's record: a rich table on stdout, a JSON file, and a PNG plot.

rich and matplotlib are imported here only, lazily, so `kvconnector` works without the bench extra.
"""

from __future__ import annotations

import io
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from kvconnector.bench.sizing import format_bytes

LAYOUT_LABELS = {"block_major": "block-major", "layer_major": "layer-major"}
# Where a figure stands against its same-run ceiling (the ratio printed beside it): "at" it from
# AT_CEILING, "near" it from NEAR_CEILING, "well below" under that, "above" past ABOVE_CEILING.
AT_CEILING, NEAR_CEILING, ABOVE_CEILING = 0.9, 0.7, 1.05
SCALE = f"at = {AT_CEILING} of it or more, near = {NEAR_CEILING} or more"


def standing(ratio: float) -> str:
    """A ratio of a ceiling in words: "above", "at", "near" or "well below" (see AT_CEILING)."""
    if ratio > ABOVE_CEILING:
        return "above"
    if ratio >= AT_CEILING:
        return "at"
    return "near" if ratio >= NEAR_CEILING else "well below"


def judged(name: str, ratio: float) -> str:
    """'load 0.85 near': a figure's name, its ratio and where that stands."""
    return f"{name} {ratio:.2f} {standing(ratio)}"


def copy_verdicts(record: dict[str, Any]) -> list[str]:
    """What the copy figures are good against: the ceiling they are held to on this device, each
    case layout's standing, and why a ratio above 1 can occur here."""
    cpu = record["meta"]["device_type"] != "cuda"
    if cpu:
        lines = ["verdicts against the same-run memory copies: no GPU here, so every copy is host "
                 "to host, bounded by memory bandwidth, not PCIe (a check of the engine's path, "
                 f"not a GPU's rates); {SCALE}:"]
    else:
        lines = ["verdicts against the same-run pinned copies, the PCIe limit (both: its "
                 f"both-ways limit); {SCALE}:"]
    above = False
    for case in record["cases"]:
        for name, r in case["layouts"].items():
            ratios = [("load", r["h2d"]["ratio"]), ("store", r["d2h"]["ratio"]),
                      ("both", r["bidir"]["ratio"]), ("prefix load", r["prefix_ratio"])]
            above = above or any(ratio > ABOVE_CEILING for _, ratio in ratios)
            lines.append(f"  {case['case']['name']} {LAYOUT_LABELS[name]}: "
                         + ", ".join(judged(n, ratio) for n, ratio in ratios)
                         + f"; host time {_calls(r['host_ratio'])}")
    if above and cpu:
        c = record["ceilings"]
        contended = (" (here the both-ways one, two such copies at once, is below the one-way "
                     "ones: they contend for the cores)"
                     if c["bidir_gbps"] < max(c["h2d_gbps"], c["d2h_gbps"]) else "")
        lines.append("  above 1 on a CPU: the ceilings are large Tensor.copy_ calls on the same "
                     f"cores as everything else{contended}, so a job's block copies can beat "
                     "them; on a CPU a ceiling is a reference, not a hard limit")
    elif above:
        lines.append("  above 1: the ceiling read low in every round (each figure is its best "
                     "round); the copies then moved more than it, as the link allows")
    return lines


def _calls(ratio: float) -> str:
    """Host time per block submitted, in plain copy calls (about one a block: as cheap as a
    copy of its own; under one: batched)."""
    if ratio < 0.5:
        return f"{ratio:.2f} of a plain copy call a block (batched: less than a call each)"
    if ratio <= 2:
        return f"{ratio:.1f} plain copy calls a block (about one: as cheap as a copy each)"
    return f"{ratio:.1f} plain copy calls a block"


def shared_verdicts(shared: dict[str, Any], device_type: str) -> list[str]:
    """The shared pool's figures against raw copies of their directions taken in turns with their
    rounds; on a CPU, which of them mean nothing there."""
    rows = [row for row in shared["rows"] if "error" not in row]
    if not rows:
        return []
    if device_type != "cuda":
        lines = ["verdicts: on a CPU the shared pool's writer store, load and both are not "
                 "meaningful: the row sums a GPU's copy engine takes on the way are taken by "
                 "torch on the host here (GB/s of summing, not of copying); load by xxh3 is "
                 "hashing on this machine's cores, against host memory copies taken in turns:"]
        lines += [f"  {row['case']}: {judged('load by xxh3', row['xxh3_load_ratio'])}"
                  for row in rows]
        return lines
    lines = [f"verdicts against raw pinned copies taken in turns with the rounds, the PCIe "
             f"limit of the moment; {SCALE}:"]
    lines += [f"  {row['case']}: {judged('load', row['load_ratio'])}, "
              f"{judged('writer store', row['store_ratio'])}, "
              f"{judged('load by xxh3', row['xxh3_load_ratio'])}, "
              f"{judged('both', row['bidir_ratio'])}" for row in rows]
    return lines


def every_gpu_verdicts(every: dict[str, Any], device_type: str) -> list[str]:
    """Each direction's aggregate over every GPU against raw copies on every GPU at once, taken
    in turns with its rounds."""
    if device_type != "cuda":
        return ["verdicts: on a CPU the stand-in processes' rates are summing and hashing on "
                "this machine's cores, not copies: no verdict"]
    lines = [f"verdicts against raw copies on every GPU at once, in turns with the engines' "
             f"rounds; {SCALE}:"]
    for row in every["rows"]:
        ratios = row["ratios"]
        lines.append(f"  {format_bytes(row['block_bytes'])}: {judged('load', ratios['load'])}, "
                     f"{judged('store', ratios['store'])}, {judged('both', ratios['both'])}")
    return lines


def tier_verdicts(rows: list[dict[str, Any]], against: str, head: list[str]) -> list[str]:
    """put/get ratios against `against` (a same-run baseline), one line per row; `head`: the
    row's naming fields."""
    rows = [row for row in rows if "error" not in row and "ratio" in row["put"]]
    if not rows:
        return []
    return [f"verdicts against {against}; {SCALE}:"] + [
        f"  {' '.join(str(row[h]) for h in head)}: {judged('put', row['put']['ratio'])}, "
        f"{judged('get', row['get']['ratio'])}" for row in rows]


def cpu_model() -> str:
    """The host CPU's model name, for a run's record."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _gb(rate: dict[str, Any]) -> str:
    return f"{rate['gbps']:.2f} ({rate['ratio']:.2f})"


def print_report(record: dict[str, Any], console: Any) -> None:
    """Ceilings line, one row per case and layout, then the remote tier, then the Redis tier
    (only when the run was given --redis-url)."""
    from rich.table import Table

    c = record["ceilings"]
    console.print(
        f"ceilings ({format_bytes(c['copy_bytes'])} copies): load {c['h2d_gbps']:.2f} GB/s, "
        f"store {c['d2h_gbps']:.2f} GB/s, both at once {c['bidir_gbps']:.2f} GB/s; "
        f"one plain copy call {c['plain_call_us']:.2f} us ({c['plain_call']}); "
        f"{c['method']}")
    side = "GPU" if record["meta"]["device_type"] == "cuda" else "host"
    table = Table(title=f"kvconnector bench: {record['meta']['mover']}, random non-adjacent ids",
                  caption=f"load: pool -> {side} cache; store: {side} cache -> pool; both: "
                          "the two at once (a few jobs each way, submitted in turns). GB/s "
                          "(ratio of the same-run ceiling); host us per "
                          "block submitted (ratio of one plain copy call); prefix load ms "
                          "(ratio: ideal at the load ceiling / measured). layer-major: one copy "
                          f"per layer per block ({record['meta']['baseline']}).")
    for col in ("case", "layout", "copy", "blocks", "load", "store", "both", "host us/block",
                "prefix tokens", "prefix ms"):
        table.add_column(col, justify="left" if col in ("case", "layout") else "right")
    for case in record["cases"]:
        for i, (name, r) in enumerate(case["layouts"].items()):
            table.add_row(
                case["case"]["name"] if i == 0 else "", LAYOUT_LABELS[name],
                format_bytes(r["row_bytes"]), str(case["blocks"]), _gb(r["h2d"]), _gb(r["d2h"]),
                _gb(r["bidir"]), f"{r['host_us_per_block']:.2f} ({r['host_ratio']:.2f})",
                str(r["prefix_tokens"]), f"{r['prefix_ms']:.1f} ({r['prefix_ratio']:.2f})",
                end_section=i == len(case["layouts"]) - 1)
    console.print(table)
    _print_lines(copy_verdicts(record), console)
    _print_shared(record.get("shared_pool"), console, record["meta"]["device_type"])
    _print_remote(record.get("remote"), console)
    _print_redis(record.get("redis"), console)


def _print_lines(lines: list[str], console: Any) -> None:
    for line in lines:
        console.print(line, highlight=False, markup=False)


def _print_shared(shared: dict[str, Any] | None, console: Any, device_type: str) -> None:
    """The shared pool rows: a writer process's blocks loaded into this process's cache."""
    from rich.table import Table

    if shared is None:
        return
    st = Table(title="shared host pool: blocks another process stored, loaded into this "
                     "process's cache straight from the pool's slots",
               caption="ratios of raw copies (pinned on a GPU) of each phase's direction "
                       "taken in turns with its rounds; writer store GB/s, committed by row "
                       "sums; load GB/s, checked by row sums on the way (what GPU engines do) "
                       "and by xxh3 on threads (blocks without row sums); both: the writer "
                       "storing while "
                       "this process loads (against raw copies both ways at once); "
                       "metadata us per block, client side: lookup + pin + unpin (load), "
                       "allocate + commit (store)")
    for col in ("case", "block", "blocks", "writer store", "load", "load by xxh3", "both",
                "load meta us", "store meta us"):
        st.add_column(col, justify="left" if col == "case" else "right")
    for row in shared["rows"]:
        if "error" in row:
            st.add_row(row["case"], "", "", f"[red]failed: {row['error']}[/]", "", "", "", "",
                       "")
            continue
        st.add_row(row["case"], format_bytes(row["block_bytes"]), str(row["blocks"]),
                   f"{row['store_gbps']:.2f} ({row['store_ratio']:.2f})",
                   f"{row['load_gbps']:.2f} ({row['load_ratio']:.2f})",
                   f"{row['xxh3_load_gbps']:.2f} ({row['xxh3_load_ratio']:.2f})",
                   f"{row['bidir_gbps']:.2f} ({row['bidir_ratio']:.2f})",
                   f"{row['load_meta_us']:.2f}", f"{row['store_meta_us']:.2f}")
    console.print(st)
    _print_lines(shared_verdicts(shared, device_type), console)
    every = shared.get("every_gpu")
    if every is not None:
        from kvconnector.bench.shared_pool_gpus import format_tables  # imports torch

        console.print(f"\nshared host pool on {len(every['gpus'])} GPUs at once: one engine "
                      f"process per GPU, each storing and loading", highlight=False)
        if "error" in every:
            _print_lines([f"failed: {every['error']}"], console)
            return
        _print_lines(format_tables(every["ceilings"], every["rows"]).splitlines(), console)
        _print_lines(every_gpu_verdicts(every, device_type), console)


def _print_remote(remote: dict[str, Any] | None, console: Any) -> None:
    from rich.table import Table

    if remote is None:
        return
    if remote.get("skipped"):
        console.print(f"remote tier: skipped ({remote['skipped']})")
        return
    rt = Table(title="remote tier: in-process store on loopback, put/get of pool blocks",
               caption="GB/s (ratio of raw pyzmq streams of the same blocks over as many "
                       "connections, with the same security, same run)")
    for col in ("case", "security", "block", "blocks", "put", "get", "raw put", "raw get"):
        rt.add_column(col, justify="left" if col in ("case", "security") else "right")
    for row in remote["rows"]:
        head = [row["case"], row["security"], format_bytes(row["block_bytes"]), str(row["blocks"])]
        if "error" in row:
            rt.add_row(*head, "[red]failed[/]", "[red]failed[/]", "", "")
            continue
        rt.add_row(*head, _gb(row["put"]), _gb(row["get"]), f"{row['baseline_put_gbps']:.2f}",
                   f"{row['baseline_get_gbps']:.2f}")
    console.print(rt)
    _print_lines(tier_verdicts(remote["rows"], "raw pyzmq streams of the same blocks, same "
                               "security, same run (the sockets' limit)", ["case", "security"]),
                 console)
    for row in remote["rows"]:
        if "error" in row:
            console.print(f"[red]remote {row['case']} {row['security']} failed:[/] {row['error']}",
                          highlight=False)


def _print_redis(redis: dict[str, Any] | None, console: Any) -> None:
    """The Redis Cluster rows (present only when the run was given --redis-url)."""
    from rich.table import Table

    if redis is None:
        return
    if redis.get("skipped"):
        console.print(f"redis tier: skipped ({redis['skipped']})")
        return
    rt = Table(title=f"redis tier: Redis Cluster {redis['url']}, one client, put/get of pool "
                     "blocks",
               caption="GB/s (ratio of redis-benchmark SET/GET of values of the same size on "
                       "the same cluster, same run, one connection per master)")
    for col in ("case", "block", "blocks", "put", "get", "SET", "GET"):
        rt.add_column(col, justify="left" if col == "case" else "right")
    notes = []
    for row in redis["rows"]:
        head = [row["case"], format_bytes(row["block_bytes"]), str(row["blocks"])]
        if "error" in row:
            rt.add_row(*head, "[red]failed[/]", "[red]failed[/]", "", "")
            notes.append(f"[red]redis {row['case']} failed:[/] {row['error']}")
            continue
        if "baseline_put_gbps" not in row:
            rt.add_row(*head, f"{row['put']['gbps']:.2f}", f"{row['get']['gbps']:.2f}",
                       "n/a", "n/a")
            notes.append(f"redis {row['case']}: baseline unavailable "
                         f"({row.get('baseline_unavailable', 'no redis-benchmark run')})")
            continue
        rt.add_row(*head, _gb(row["put"]), _gb(row["get"]), f"{row['baseline_put_gbps']:.2f}",
                   f"{row['baseline_get_gbps']:.2f}")
    console.print(rt)
    _print_lines(tier_verdicts([row for row in redis["rows"] if "baseline_put_gbps" in row],
                               "redis-benchmark SET/GET of the same values on the same cluster "
                               "(the cluster's limit)", ["case"]), console)
    for note in notes:
        console.print(note, highlight=False)


def write_json(record: dict[str, Any], path: Path) -> None:
    _atomic_write(path, (json.dumps(record, indent=2) + "\n").encode())


def write_plot(record: dict[str, Any], path: Path) -> None:
    """Throughput against block size: both layouts, one way and bidirectional, ceilings drawn."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = record["ceilings"]
    cases = sorted(record["cases"], key=lambda c: c["case"]["block_bytes"])
    x = [c["case"]["block_bytes"] / 2**20 for c in cases]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    # Markers only: the cases are different models, not one curve.
    styles = {"block_major": "o", "layer_major": "s"}
    for name, style in styles.items():
        for key, color in (("h2d", "tab:blue"), ("d2h", "tab:orange")):
            ax1.plot(x, [c["layouts"][name][key]["gbps"] for c in cases], style, color=color,
                     label=f"{LAYOUT_LABELS[name]} {'load' if key == 'h2d' else 'store'}",
                     fillstyle="full" if name == "block_major" else "none")
        ax2.plot(x, [c["layouts"][name]["bidir"]["gbps"] for c in cases], style,
                 color="tab:green", label=LAYOUT_LABELS[name],
                 fillstyle="full" if name == "block_major" else "none")
    ax1.axhline(ceil["h2d_gbps"], color="tab:blue", lw=0.8, ls=":", label="ceiling load")
    ax1.axhline(ceil["d2h_gbps"], color="tab:orange", lw=0.8, ls=":", label="ceiling store")
    ax2.axhline(ceil["bidir_gbps"], color="tab:green", lw=0.8, ls=":", label="ceiling both ways")
    for ax, title in ((ax1, "one way"), (ax2, "bidirectional")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("block size over all layers (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    for c, xv in zip(cases, x, strict=True):  # name each case at its block-major load point
        ax1.annotate(c["case"]["name"], (xv, c["layouts"]["block_major"]["h2d"]["gbps"]),
                     textcoords="offset points", xytext=(0, 6), fontsize=7, rotation=30)
    ax1.set_ylabel("GB/s")
    meta = record["meta"]
    fig.suptitle(f"kvconnector bench on {meta['device']} ({meta['date']}): {meta['mover']}")
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=120)
    finally:
        plt.close(fig)
    _atomic_write(path, png.getvalue())  # nothing left behind if the write fails


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
