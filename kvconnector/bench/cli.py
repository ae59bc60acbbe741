"""`kvconnector bench`: flags, sizing, the run with its progress, and the record it leaves.

The default is what a newcomer needs first, in about two minutes on a GPU: one preset, both
layouts, the ceilings, the remote tier in one security mode. `--preset all` measures the rest.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

from kvconnector.bench.presets import KV_DTYPES, PRESETS, build_cases
from kvconnector.bench.remote import SECURITY_MODES
from kvconnector.bench.report import cpu_model
from kvconnector.bench.sizing import (
    BenchError,
    blocks_for_tokens,
    cgroup_memory_left,
    format_bytes,
    jobs_blocks,
)
from kvconnector.cli.units import parse_size

DEFAULT_PRESET = "llama-3.1-8b"
DEFAULT_SECURITY = "secret"  # the mode a store off loopback runs with; none costs the same
DEFAULT_BLOCKS = 1024
DEFAULT_BUDGET = {"cuda": "24G", "cpu": "512M"}  # both sides; CPU: the process stays < 1 GiB
DEFAULT_PREFIX_TOKENS = 16384
DEFAULT_DISK_BYTES = "1G"
SEED = 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="measure block offload throughput (block-major vs vLLM's layer-major)",
        description="Measure GPU <-> pinned CPU pool block copies (host <-> host without a GPU) "
                    "for block-major caches beside vLLM's own copy path for layer-major ones, "
                    "against same-run ceilings; then the remote tier on loopback (and a Redis "
                    "Cluster, given --redis-url).")
    p.error = _one_line_error  # type: ignore[method-assign]
    p.add_argument("--preset", default=None,
                   help=f"comma list of {', '.join(PRESETS)}, or 'all' (with every remote "
                        f"security mode); default {DEFAULT_PRESET}")
    p.add_argument("--kv-dtype", default="bf16",
                   help=f"comma list of KV cache dtypes: {', '.join(KV_DTYPES)} (default bf16)")
    p.add_argument("--block-size", type=_int_list, default=None, metavar="TOKENS[,TOKENS]",
                   help="tokens per block, overriding the presets' (vLLM's) block size")
    shape = p.add_argument_group("explicit shape (instead of --preset)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--kv-heads", type=int, help="KV heads per rank")
    shape.add_argument("--head-size", type=int, help="head size (MLA: latent + rope)")
    shape.add_argument("--mla", action="store_true", help="an MLA cache (one latent, no V)")
    p.add_argument("--blocks", type=int, default=None,
                   help=f"blocks per job (default {DEFAULT_BLOCKS}, fewer if the budget is short)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="memory for the cache side and the host pool together "
                        f"(default {DEFAULT_BUDGET['cuda']} with a GPU, {DEFAULT_BUDGET['cpu']} "
                        "without)")
    p.add_argument("--prefix-tokens", type=int, default=None,
                   help=f"prefix length for the load-time figure (default {DEFAULT_PREFIX_TOKENS},"
                        " less if the budget is short)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (median)")
    p.add_argument("--gpus", default=None, metavar="all|I,J,...",
                   help="also run the shared pool on these GPUs at once, one engine process "
                        "each storing and loading, against the same run's raw copies on all of "
                        "them (two or more; without a GPU, stand-in processes)")
    p.add_argument("--remote-security", default=None, metavar="MODES",
                   help=f"comma list of {', '.join(SECURITY_MODES)}, or 'all': the remote "
                        f"tier's security modes (default {DEFAULT_SECURITY}; all with "
                        "--preset all)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the full record as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG: GB/s vs block size")
    redis = p.add_argument_group("Redis tier (measured only with --redis-url)")
    redis.add_argument("--redis-url", metavar="URL",
                       help="redis://[USER@]HOST:PORT[,...] (rediss:// for TLS): also put and get "
                            "the cases' blocks to this Redis Cluster, against redis-benchmark")
    redis.add_argument("--redis-user", metavar="USER", help="ACL user (if not in the URL)")
    redis.add_argument("--redis-password-file", type=Path, metavar="FILE",
                       help="the user's password (else $KVCONNECTOR_REDIS_PASSWORD)")
    redis.add_argument("--redis-ca-file", type=Path, metavar="FILE",
                       help="CA of the nodes' certificates (rediss://)")
    disk = p.add_argument_group("disk tier (measured alone, with --disk)")
    disk.add_argument("--disk", type=Path, metavar="DIR",
                      help="measure only the disk tier: write and read the cases' blocks through "
                           "a slab in DIR (O_DIRECT) against fio on the same file system")
    disk.add_argument("--disk-bytes", default=DEFAULT_DISK_BYTES, metavar="SIZE",
                      help=f"bytes per case and direction (default {DEFAULT_DISK_BYTES})")
    disk.add_argument("--disk-threads", type=int, default=None, metavar="N",
                      help="requests in flight, the tier's threads and fio's iodepth (default "
                           "the tier's default)")
    p.set_defaults(func=run)


def _one_line_error(message: str) -> NoReturn:
    print(f"kvconnector bench: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        return _run_disk(args) if args.disk is not None else _run(args)
    except BenchError as exc:
        print(f"kvconnector bench: error: {exc}", file=sys.stderr)
        return 2


def _split(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _cases(args: argparse.Namespace) -> list[Any]:
    explicit = (args.layers, args.kv_heads, args.head_size)
    if any(v is not None for v in explicit) or args.mla:
        if any(v is None for v in explicit):
            raise BenchError("an explicit shape needs --layers, --kv-heads and --head-size")
        if args.preset is not None:
            raise BenchError("give --preset or an explicit shape, not both")
    for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads),
                        ("--head-size", args.head_size), ("--blocks", args.blocks),
                        ("--prefix-tokens", args.prefix_tokens), ("--repeats", args.repeats),
                        *(("--block-size", n) for n in args.block_size or [])):
        if value is not None and value <= 0:
            raise BenchError(f"{flag} must be a positive integer, got {value}")
    presets = list(PRESETS) if args.preset == "all" else _split(args.preset or DEFAULT_PRESET)
    shape = explicit if explicit[0] is not None else None
    try:
        return build_cases(presets, _split(args.kv_dtype), args.block_size, shape, args.mla)
    except ValueError as exc:
        raise BenchError(str(exc)) from None


def _securities(args: argparse.Namespace) -> list[str]:
    text = args.remote_security or ("all" if args.preset == "all" else DEFAULT_SECURITY)
    modes = list(SECURITY_MODES) if text == "all" else _split(text)
    for mode in modes:
        if mode not in SECURITY_MODES:
            raise BenchError(f"unknown --remote-security {mode!r}; choose from "
                             f"{', '.join(SECURITY_MODES)} or 'all'")
    return modes


def _check_extras(args: argparse.Namespace, cuda: bool) -> None:
    """Optional packages this run will need, imported before anything is measured: BenchError
    (one line, exit 2) naming the extra that brings the first one missing."""
    needs = [("rich", "bench", "kvconnector bench")]
    if args.plot is not None:
        needs.append(("matplotlib", "bench", "--plot"))
    if args.redis_url is not None:
        needs.append(("redis", "bench", "--redis-url"))
    if cuda:
        needs += [("cuda.bindings", "gpu", "the GPU path"), ("cupy", "gpu", "the GPU path")]
    for module, extra, what in needs:
        try:
            importlib.import_module(module)
        except ImportError:
            raise BenchError(f"{what} needs {module}, which is not installed: "
                             f"pip install 'kvconnector[{extra}]'") from None


def _redis_auth(args: argparse.Namespace) -> Any:
    """The Redis tier's credentials, or None without --redis-url (checked before the run)."""
    if args.redis_url is None:
        if args.redis_user or args.redis_password_file or args.redis_ca_file:
            raise BenchError("--redis-user, --redis-password-file and --redis-ca-file need "
                             "--redis-url")
        return None
    try:
        from transfer.remote.redis.values import RedisAuth, RedisURL

        RedisURL.parse(args.redis_url)
        return RedisAuth.from_sources(args.redis_user, args.redis_password_file,
                                      args.redis_ca_file)
    except (ImportError, ValueError) as exc:
        raise BenchError(f"--redis-url: {exc}") from None


def _budget(args: argparse.Namespace, device: torch.device) -> int:
    try:
        budget = parse_size(args.budget or DEFAULT_BUDGET[device.type])
    except ValueError as exc:
        raise BenchError(f"--budget: {exc}") from None
    host_need = budget if device.type == "cpu" else budget // 2
    left = cgroup_memory_left()
    if left is not None and host_need > left:
        raise BenchError(f"--budget {format_bytes(budget)} needs {format_bytes(host_need)} of "
                         f"host memory; the cgroup allows {format_bytes(left)} more")
    return budget


def _gpus(args: argparse.Namespace, sizes: list[int], cuda: bool) -> list[int] | None:
    """`--gpus` resolved, and room for a pool of `sizes` checked, before anything runs."""
    if args.gpus is None:
        return None
    from kvconnector.bench.shared_pool_gpus import blocks_per_set, resolve_gpus

    try:
        gpus = resolve_gpus(args.gpus, cuda)
        if len(gpus) < 2:
            raise ValueError(f"--gpus {args.gpus} names one GPU: the shared pool on one GPU is "
                             f"measured anyway; give two or more")
        blocks_per_set(sizes, len(gpus), "cuda" if cuda else "cpu")
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    return gpus


def _every_gpu(gpus: list[int], device_type: str, sizes: list[int], repeats: int,
               step: Any) -> dict[str, Any]:
    """measure_every_gpu, or {"error": why}: a failure there is a finding, and the figures
    already measured are still reported and written."""
    from kvconnector.bench.shared_pool_gpus import measure_every_gpu  # CUDA-side modules

    try:
        return measure_every_gpu(gpus, device_type, sizes, repeats, step)
    except Exception as exc:
        return {"gpus": gpus, "error": f"{type(exc).__name__}: {exc}"}


def _pool_sizes(cases: list[Any]) -> list[int]:
    """The cases' distinct block sizes in a pool, in their order."""
    from kvconnector.bench.shared_pool import pool_block_bytes  # the transfer engine's modules

    return list(dict.fromkeys(pool_block_bytes(case) for case in cases))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} (CPU only)"


def _shape_args(args: argparse.Namespace) -> list[str]:
    """The cases' flags as the run took them: the explicit shape, else the presets (the default
    spelled out)."""
    if args.layers is not None:
        return ["--layers", str(args.layers), "--kv-heads", str(args.kv_heads),
                "--head-size", str(args.head_size)] + (["--mla"] if args.mla else [])
    return ["--preset", args.preset or DEFAULT_PRESET]


def _check_outputs(args: argparse.Namespace) -> None:
    """--json and --plot: files this run can write, checked before anything is measured (a
    BenchError, one line, names the flag, the path and what is wrong)."""
    outputs = [(flag, path) for flag, path in (("--json", args.json), ("--plot", args.plot))
               if path is not None]
    if len(outputs) == 2 and outputs[0][1].absolute() == outputs[1][1].absolute():
        raise BenchError(f"--json and --plot both name {str(args.json)!r}: give two files")
    for flag, path in outputs:
        try:
            is_dir = path.is_dir()
        except OSError as exc:
            raise BenchError(f"{flag} {str(path)!r}: {exc.strerror or exc}") from None
        if is_dir:
            example = path / ("bench.json" if flag == "--json" else "bench.png")
            raise BenchError(f"{flag} {str(path)!r} is a directory: give a file path in it, "
                             f"e.g. {str(example)!r}")
        _check_writable_dir(flag, path, path.parent)


def _check_writable_dir(flag: str, given: Path, directory: Path) -> None:
    """BenchError unless a file can be created in `directory` (what `flag` `given` needs): tried
    with a temporary file, as the record is written (a temporary file, then renamed)."""
    try:
        if not directory.is_dir():
            raise BenchError(f"{flag} {str(given)!r}: no directory {str(directory)!r}")
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".kvconnector-bench-probe.")
    except OSError as exc:
        raise BenchError(f"{flag} {str(given)!r}: cannot create a file in {str(directory)!r}: "
                         f"{exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def _command(args: argparse.Namespace, budget: str, securities: list[str]) -> str:
    """The effective command line, every choice spelled out, for docs/benchmarks.md."""
    parts = ["kvconnector", "bench", *_shape_args(args)]
    parts += ["--kv-dtype", args.kv_dtype, "--remote-security", ",".join(securities)]
    if args.block_size:
        parts += ["--block-size", ",".join(map(str, args.block_size))]
    for flag, value in (("--blocks", args.blocks), ("--budget", budget),
                        ("--prefix-tokens", args.prefix_tokens), ("--repeats", args.repeats),
                        ("--gpus", args.gpus),
                        ("--json", args.json), ("--plot", args.plot),
                        ("--redis-url", args.redis_url), ("--redis-user", args.redis_user),
                        ("--redis-password-file", args.redis_password_file),
                        ("--redis-ca-file", args.redis_ca_file)):
        if value is not None:
            parts += [flag, str(value)]
    return " ".join(parts)


def _run_disk(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvconnector.bench.disk import measure_disk, print_disk
    from transfer.disk.io import DEFAULT_THREADS

    for flag, value in (("--plot", args.plot), ("--redis-url", args.redis_url),
                        ("--gpus", args.gpus)):
        if value is not None:
            raise BenchError(f"{flag} is not measured with --disk, which measures the disk tier "
                             f"alone: run them apart")
    cases = _cases(args)
    try:
        total = parse_size(args.disk_bytes)
    except ValueError as exc:
        raise BenchError(f"--disk-bytes: {exc}") from None
    threads = DEFAULT_THREADS if args.disk_threads is None else args.disk_threads
    if threads <= 0 or args.repeats <= 0:
        raise BenchError(f"--disk-threads and --repeats must be positive, got {threads}, "
                         f"{args.repeats}")
    _check_extras(args, cuda=False)
    if not args.disk.is_dir():
        raise BenchError(f"--disk {str(args.disk)!r} is not a directory")
    _check_writable_dir("--disk", args.disk, args.disk)
    _check_outputs(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    disk = measure_disk(cases, args.disk, total, threads, args.repeats)
    parts = ["kvconnector", "bench", *_shape_args(args), "--kv-dtype", args.kv_dtype,
             "--disk", str(args.disk), "--disk-bytes", str(args.disk_bytes),
             "--disk-threads", str(threads), "--repeats", str(args.repeats)]
    if args.block_size:
        parts += ["--block-size", ",".join(map(str, args.block_size))]
    if args.json is not None:
        parts += ["--json", str(args.json)]
    record = {"meta": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                       "host": platform.node(), "device": _device_name(device),
                       "command": " ".join(parts), "disk": {k: v for k, v in disk.items()
                                                            if k != "rows"}},
              "disk": disk}
    out = Console() if Console().is_terminal else Console(width=200)
    print_disk(record, out)
    if args.json is not None:
        from kvconnector.bench.report import write_json

        _write(write_json, record, "--json", args.json)
        out.print(f"wrote {args.json}")
    return 0


def _write(writer: Any, record: dict[str, Any], flag: str, path: Path) -> None:
    """`writer(record, path)`; a BenchError naming `flag` if the file system refuses it now
    (checked before the run, but a disk can fill or a directory go meanwhile)."""
    try:
        writer(record, path)
    except OSError as exc:
        raise BenchError(f"{flag} {str(path)!r}: cannot write it: {exc.strerror or exc}") from None


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    cases = _cases(args)
    securities = _securities(args)
    cuda = torch.cuda.is_available()
    _check_extras(args, cuda)
    redis_auth = _redis_auth(args)
    pool_sizes = _pool_sizes(cases) if args.gpus is not None else []
    gpus = _gpus(args, pool_sizes, cuda)
    device = torch.device("cuda" if cuda else "cpu")
    budget = _budget(args, device)
    _check_outputs(args)

    from rich.console import Console

    # The measuring modules pull in the transfer engine; `kvconnector --help` should not.
    from kvconnector.bench.ceilings import CeilingMeter
    from kvconnector.bench.progress import BenchProgress
    from kvconnector.bench.redis_tier import measure_redis, redis_steps
    from kvconnector.bench.remote import measure_remote, remote_steps
    from kvconnector.bench.report import LAYOUT_LABELS
    from kvconnector.bench.runner import (
        BOTH_WAYS_JOBS,
        LAYOUTS,
        CaseRun,
        allocate_arenas,
        case_capacity,
    )
    from kvconnector.bench.shared_pool import measure_shared, shared_steps

    out, err = Console(), Console(stderr=True)
    if not out.is_terminal:  # a file or a pipe: the record's table, not wrapped at 80 columns
        out = Console(width=200)
    if device.type == "cpu":
        out.print("[bold]No CUDA device:[/] CPU path, host-to-host copies through the same "
                  "engine plus the remote tier; rates are memory bandwidth, not PCIe.")

    arenas = allocate_arenas(budget // 2, device)
    try:
        plan = []
        for case in cases:
            capacity = case_capacity(case, arenas)
            if capacity < 2:
                raise BenchError(f"budget {format_bytes(budget)} holds no two "
                                 f"{format_bytes(case.layout.block_bytes)} blocks of "
                                 f"{case.name} per side; raise --budget")
            try:
                blocks = jobs_blocks(capacity, args.blocks, DEFAULT_BLOCKS)
            except ValueError as exc:
                raise BenchError(f"{case.name}: {exc}") from None
            max_tokens = (capacity // 2) * case.layout.block_size
            tokens = args.prefix_tokens or min(DEFAULT_PREFIX_TOKENS, max_tokens)
            if blocks_for_tokens(tokens, case.layout.block_size) > capacity // 2:
                raise BenchError(f"{case.name}: --prefix-tokens {tokens} needs more than the "
                                 f"{max_tokens} tokens the budget holds; raise --budget")
            plan.append((case, blocks, tokens))

        # one unit per case layout (a ceiling round first), the last ceiling round, the remote
        # rows
        units = (len(plan) * len(LAYOUTS) + 1 + remote_steps(len(plan), securities)
                 + shared_steps(len(plan)))
        if redis_auth is not None:
            units += redis_steps(len(plan))
        if gpus is not None:  # the raw copies, then each block size
            units += 1 + len(pool_sizes)
        with BenchProgress(err, units) as progress:
            meter = CeilingMeter(arenas.device, arenas.host, args.repeats)
            try:
                runs = []
                for case, blocks, tokens in plan:
                    run = CaseRun(case, arenas, blocks, tokens, args.repeats, SEED)
                    for name in LAYOUTS:
                        progress.next(f"{case.name} {LAYOUT_LABELS[name]}")
                        meter.measure()
                        run.measure(name)
                    runs.append(run)
                progress.next("ceilings: last round")
                meter.measure()
                ceilings = meter.best("one before each case's layout and one after the last")
            finally:
                meter.close()
            results = [run.as_dict(ceilings) for run in runs]
            shared = measure_shared(plan, ceilings, device, args.repeats, progress.next)
            remote = measure_remote(plan, arenas.host, budget, args.repeats, progress.next,
                                    securities)
            redis = None if redis_auth is None else measure_redis(
                plan, arenas.host, budget, args.repeats, progress.next, args.redis_url,
                redis_auth)
            if gpus is not None:
                arenas.close()  # their memory back before an engine starts on every GPU
                shared["every_gpu"] = _every_gpu(gpus, device.type, pool_sizes, args.repeats,
                                                 progress.next)
        mover_name = results[0]["mover"] if results else ""
        baseline_name = results[0]["baseline"] if results else ""
        record = {
            "meta": {
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "host": platform.node(),
                "device": _device_name(device),
                "device_type": device.type,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "command": _command(args, args.budget or DEFAULT_BUDGET[device.type],
                                    securities),
                "mover": mover_name,
                "baseline": baseline_name,
                "budget_bytes": budget,
                "arenas_ready_s": arenas.ready_s,
                "repeats": args.repeats,
                "ids": "random, non-adjacent within a job; bidirectional sets disjoint",
                "both_ways": f"bidir: {BOTH_WAYS_JOBS} jobs each way, submitted in turns; "
                             "bidir_pair: one whole store job, then one whole load job",
                "wall_s": time.perf_counter() - started,
            },
            "ceilings": ceilings.as_dict(),
            "cases": results,
            "shared_pool": shared,
            "remote": remote,
        }
        if redis is not None:
            record["redis"] = redis
    finally:
        arenas.close()

    from kvconnector.bench.report import print_report, write_json, write_plot
    from kvconnector.bench.shared_pool_gpus import mismatched_blocks_in

    print_report(record, out)
    if args.json is not None:
        _write(write_json, record, "--json", args.json)
        out.print(f"wrote {args.json}")
    if args.plot is not None:
        _write(write_plot, record, "--plot", args.plot)
        out.print(f"wrote {args.plot}")
    every = shared.get("every_gpu")
    if every is not None and ("error" in every or mismatched_blocks_in(every["rows"])):
        return 1  # it failed, or a block came back unlike what was stored: the report says
    return 0
