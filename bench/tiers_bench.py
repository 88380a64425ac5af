"""`splitserve bench tiers`: how fast each offload tier restores KV blocks into an engine's
block-major KV cache, next to the time the engine takes to recompute those blocks.

One run, one set of blocks: `--blocks` random KV blocks of a realistic layout (default
bf16, 16 layers x 8 KV heads x head dim 128 x 16 tokens = 1 MiB per block, 384 MiB in
all) are stored in the host DRAM tier, the local disk tier (O_DIRECT where the
filesystem takes it) and the LMCache tier (its CPU backend), each alone in a
`TieredCache`. A restore is what the engine does on a prefix hit: `lookup` + `load`
of every block into the KV cache, checked bit-exact. Restores are interleaved across
the tiers, `--repeats` rounds; each figure is a tier's best restore (its median is
printed and kept too): this 2-core box is shared, and a copy's two threads stall for
up to seconds when other processes take the cores, which says nothing about the tier.

Recompute: a random-weight Llama whose KV layout is exactly the blocks' (16 layers,
8 KV heads, head dim 128; hidden 1024, so 8 query heads; bf16) prefills the tokens
those blocks cover (`--prompt-len`-token prompts, prefix caching off). Its compute per
KV byte (~0.4 GFLOP per 64 KiB token) is ~20x below a real model with this KV layout
(a GQA model with hidden 4096, 32 query heads: ~7 GFLOP per token), so the recompute
figure flatters recompute.

Target (issue 5): the host tier restores >= 1.5x faster than the LMCache CPU tier.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.block_hash import BlockHash
    from kvtransfer.layout import KVLayout
    from kvtransfer.tiers.config import TierConfig
    from kvtransfer.tiers.manager import TieredCache

MIB = 1 << 20
TARGET_HOST_OVER_LMCACHE = 1.5
LMCACHE_WRITE_DEADLINE_S = 30.0  # LMCache writes asynchronously


@dataclass(frozen=True, slots=True)
class TierResult:
    tier: str
    blocks: int
    bytes: int
    seconds: float  # best restore (the headline figure)
    median_seconds: float
    store_seconds: float
    all_seconds: tuple[float, ...]  # every restore, in order
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write the summary and every row here")
    p.add_argument("--blocks", type=int, default=384, help="KV blocks restored per tier")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=7,
                   help="restores per tier (interleaved; the best one counts)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per recompute prompt")
    p.add_argument("--disk-dir", default=None,
                   help="parent of the disk tier's directory (default: the temp dir)")
    p.add_argument("--quick", action="store_true", help="a few MiB, a tiny model (smoke test)")


def check_args(args: argparse.Namespace) -> None:
    if args.quick:
        args.blocks, args.layers, args.kv_heads, args.head_dim = 16, 2, 2, 64
        args.repeats, args.prompt_len = 2, 64
    if min(args.blocks, args.layers, args.kv_heads, args.head_dim, args.block_size,
           args.repeats, args.prompt_len) < 1:
        raise SystemExit("--blocks, --layers, --kv-heads, --head-dim, --block-size, "
                         "--repeats and --prompt-len must be >= 1")
    if args.prompt_len % args.block_size:
        raise SystemExit("--prompt-len must be a multiple of --block-size")
    if args.disk_dir is not None and not os.path.isdir(args.disk_dir):
        raise SystemExit(f"--disk-dir {args.disk_dir!r} is not a directory")


def make_blocks(layout: KVLayout, n: int, seed: int = 0
                ) -> tuple[list[BlockHash], torch.Tensor]:
    """n chained block hashes and random KV blocks (the data every tier restores)."""
    import torch

    from engine.block_hash import hash_blocks
    from kvtransfer.memory import torch_dtype

    rng = random.Random(seed)
    tokens = [rng.randrange(1 << 20) for _ in range(n * layout.block_size)]
    hashes = hash_blocks(tokens, layout.block_size, b"bench-tiers")
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(layout.tensor_shape(n), generator=g, dtype=torch_dtype(layout))
    return hashes, data


def store(name: str, config: TierConfig, layout: KVLayout, hashes: list[BlockHash],
          data: torch.Tensor) -> tuple[TieredCache, float]:
    """A TieredCache of this one tier holding every block; the seconds storing took
    (until `lookup` finds them all: LMCache writes asynchronously). The caller closes it."""
    from kvtransfer.tiers.manager import TieredCache

    tiers = TieredCache(config, layout)
    try:
        t0 = time.perf_counter()
        tiers.put(hashes, list(data))
        deadline = time.monotonic() + LMCACHE_WRITE_DEADLINE_S
        while (held := tiers.lookup(hashes)) < len(hashes):
            if time.monotonic() > deadline:
                raise SystemExit(f"tier {name}: only {held} of {len(hashes)} blocks stored "
                                 f"after {LMCACHE_WRITE_DEADLINE_S:.0f}s")
            time.sleep(0.005)
        return tiers, time.perf_counter() - t0
    except BaseException:
        tiers.close()
        raise


def restore(name: str, tiers: TieredCache, hashes: list[BlockHash], kv: torch.Tensor,
            data: torch.Tensor) -> float:
    """Seconds to restore every block into `kv` as the engine does on a prefix hit
    (lookup, then load into its blocks); checked bit-exact against `data`."""
    import torch

    kv.zero_()
    if kv.is_cuda:  # the zeroing is queued: it must not count as the restore's
        torch.cuda.synchronize(kv.device)
    t0 = time.perf_counter()
    n = tiers.lookup(hashes)
    got = tiers.load(hashes[:n], range(n), kv)
    seconds = time.perf_counter() - t0
    if got != len(hashes) or not torch.equal(kv, data):
        raise SystemExit(f"tier {name}: restored {got} of {len(hashes)} blocks, or not "
                         "bit-exact")
    return seconds


def measure_tiers(configs: list[tuple[str, TierConfig]], layout: KVLayout,
                  hashes: list[BlockHash], data: torch.Tensor, repeats: int
                  ) -> dict[str, TierResult]:
    """Every tier holds the same blocks; restores are interleaved across tiers (round r
    restores from each tier once), so a stall of this shared box hits no tier alone."""
    import torch

    kv = torch.zeros_like(data)
    nbytes = len(hashes) * layout.block_bytes
    with contextlib.ExitStack() as stack:
        opened = {}
        for name, config in configs:
            tiers, store_s = store(name, config, layout, hashes, data)
            stack.callback(tiers.close)
            opened[name] = (tiers, store_s)
        times: dict[str, list[float]] = {name: [] for name in [*opened, "memcpy"]}
        for _ in range(repeats):
            for name, (tiers, _) in opened.items():
                times[name].append(restore(name, tiers, hashes, kv, data))
            times["memcpy"].append(copy_blocks(kv, data))
        results = {name: TierResult(name, len(hashes), nbytes, min(times[name]),
                                    statistics.median(times[name]), store_s,
                                    tuple(times[name]), tier_kind(tiers))
                   for name, (tiers, store_s) in opened.items()}
    results["memcpy"] = TierResult("memcpy", len(hashes), nbytes, min(times["memcpy"]),
                                   statistics.median(times["memcpy"]), 0.0,
                                   tuple(times["memcpy"]), "reference: torch copy_ of "
                                   "the same blocks from one host tensor, no tier")
    return results


def copy_blocks(kv: torch.Tensor, data: torch.Tensor) -> float:
    """The ceiling of any host-memory tier here: a plain block-by-block copy."""
    kv.zero_()
    t0 = time.perf_counter()
    for dst, src in zip(kv, data, strict=True):
        dst.copy_(src)
    return time.perf_counter() - t0


def tier_kind(tiers: Any) -> str:
    """How a one-tier TieredCache holds its blocks (pinned or not, O_DIRECT or not)."""
    tier = tiers.tiers[0]
    if tier.name == "disk":
        return "O_DIRECT" if tier.direct_io else "buffered (no O_DIRECT here: page cache)"
    if tier.name == "host":
        return "pinned" if tier.pinned else "pageable"
    return "LocalCPUBackend"


def tier_configs(args: argparse.Namespace, disk_dir: str, layout: KVLayout
                 ) -> list[tuple[str, TierConfig | None, str]]:
    """(name, config or None, why not) per tier, host first."""
    from kvtransfer.tiers import LMCacheTierConfig, TierConfig
    from kvtransfer.tiers.lmcache_tier import IMPORT_ERROR

    n = args.blocks
    out: list[tuple[str, TierConfig | None, str]] = [
        ("host", TierConfig(host_blocks=n, pin_memory=None), ""),
        ("disk", TierConfig(disk_dir=disk_dir, disk_blocks=n), "")]
    if IMPORT_ERROR is not None:
        out.append(("lmcache", None, f"LMCache is not importable: {IMPORT_ERROR}"))
    else:
        gib = n * layout.block_bytes / (1 << 30) * 1.25 + 0.05  # room beyond the blocks
        lmc = LMCacheTierConfig(instance_id="bench-tiers", overrides=(
            ("local_cpu", True), ("max_local_cpu_size", round(gib, 3))))
        out.append(("lmcache", TierConfig(lmcache=lmc), ""))
    return out


def build_model(root: str, layout: KVLayout) -> dict[str, Any]:
    """A random Llama whose KV layout is `layout` (hidden = kv heads x head dim)."""
    from engine.default_model import llama_config, write_random_weights, write_tokenizer

    vocab = write_tokenizer(root)
    hidden = layout.num_kv_heads * layout.head_dim
    cfg = llama_config(vocab, 0, [4], hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layout.num_layers,
                       num_attention_heads=layout.num_kv_heads,
                       num_key_value_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                       torch_dtype=layout.dtype)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_random_weights(root, cfg)
    return cfg


def measure_recompute(layout: KVLayout, n_blocks: int, prompt_len: int,
                      seed: int = 0) -> tuple[float, dict[str, Any]]:
    """Seconds the engine takes to prefill n_blocks * block_size tokens (prompts of
    `prompt_len`, one token sampled each) on a bench model of this KV layout."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from kvtransfer.tiers.manager import engine_layout

    with tempfile.TemporaryDirectory(prefix="splitserve-bench-tiers-") as root:
        cfg = build_model(root, layout)
        per = prompt_len // layout.block_size
        num_prompts = -(-n_blocks // per)
        llm = LLM(root, dtype=layout.dtype, block_size=layout.block_size,
                  num_blocks=num_prompts * (per + 1) + 4, enable_prefix_caching=False,
                  max_num_batched_tokens=max(2048, prompt_len), max_num_seqs=num_prompts)
        if engine_layout(llm.engine.config) != layout:
            raise SystemExit("bench model's KV layout differs from the blocks'")
        rng = random.Random(seed)
        vocab = cfg["vocab_size"]
        lens = [prompt_len] * (n_blocks // per) + \
            ([(n_blocks % per) * layout.block_size] if n_blocks % per else [])
        prompts = [[rng.randrange(10, vocab) for _ in range(m)] for m in lens]
        one = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([prompts[0][:layout.block_size * 2]], one)  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, one)
        seconds = time.perf_counter() - t0
    model = {"hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
             "num_attention_heads": cfg["num_attention_heads"], "vocab_size": vocab,
             "prompts": len(prompts), "tokens": sum(lens)}
    return seconds, model


def summarize(results: dict[str, TierResult], recompute_s: float, total: int
              ) -> dict[str, float | bool | None]:
    def gbps(name: str) -> float | None:
        r = results.get(name)
        return r.gbps if r is not None else None

    host, lmc = gbps("host"), gbps("lmcache")
    ratio = host / lmc if host is not None and lmc is not None else None
    return {"host_gbps": host, "disk_gbps": gbps("disk"), "lmcache_gbps": lmc,
            "recompute_gbps": total / recompute_s / 1e9, "host_over_lmcache": ratio,
            "memcpy_gbps": gbps("memcpy"),
            "target_host_over_lmcache": TARGET_HOST_OVER_LMCACHE,
            "target_met": None if ratio is None else ratio >= TARGET_HOST_OVER_LMCACHE}


def run(args: argparse.Namespace) -> int:
    check_args(args)
    # This is the CLI: LMCache reads these itself (telemetry off, no per-store INFO lines).
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    import torch

    from kvtransfer.layout import KVLayout

    layout = KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype)
    total = args.blocks * layout.block_bytes
    print(f"blocks: {args.blocks} x {layout.block_bytes / MIB:.2f} MiB ({args.dtype}, "
          f"{args.layers} layers x {args.kv_heads} KV heads x head dim {args.head_dim} x "
          f"{args.block_size} tokens) = {total / MIB:.1f} MiB; best of {args.repeats} "
          f"restores per tier; torch threads: {torch.get_num_threads()}", flush=True)
    hashes, data = make_blocks(layout, args.blocks)
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-disk-", dir=args.disk_dir) as d:
        configs = []
        for name, config, why in tier_configs(args, d, layout):
            if config is None:
                skipped[name] = why
                print(f"{name}: skipped ({why})", flush=True)
            else:
                configs.append((name, config))
        results = measure_tiers(configs, layout, hashes, data, args.repeats)
    print_tiers(results)
    del data
    recompute_s, model = measure_recompute(layout, args.blocks, args.prompt_len)
    summary = summarize(results, recompute_s, total)
    print_verdict(args, results, summary, recompute_s, model)
    if args.json:
        write_json(args.json, args, layout, summary, results, skipped, recompute_s, model)
    return 0


def print_tiers(results: dict[str, TierResult]) -> None:
    print(f"{'':<10}{'best':>10}{'':>12}{'median':>10}")
    for r in results.values():
        print(f"{r.tier:<10}{r.seconds * 1e3:>7.1f} ms{r.gbps:>7.2f} GB/s"
              f"{r.median_seconds * 1e3:>7.1f} ms  ({r.note})", flush=True)


def print_verdict(args: argparse.Namespace, results: dict[str, TierResult],
                  summary: dict[str, Any], recompute_s: float, model: dict[str, Any]) -> None:
    print(f"{'recompute':<10}{recompute_s * 1e3:>7.1f} ms{summary['recompute_gbps']:>7.2f} GB/s"
          f"  (engine prefill of {model['tokens']} tokens in {model['prompts']} prompts on a "
          f"random Llama of this KV layout: hidden {model['hidden_size']}, "
          f"{model['num_attention_heads']} query heads, {args.dtype})")
    for name, r in results.items():
        if name != "memcpy":
            print(f"{name} restore is {recompute_s / r.seconds:.1f}x faster than recompute")
    ratio, copy, lmc = (summary["host_over_lmcache"], summary["memcpy_gbps"],
                        summary["lmcache_gbps"])
    if ratio is None:
        return
    verdict = "met" if summary["target_met"] else "MISSED"
    print(f"host / lmcache: {ratio:.2f}x (target >= {TARGET_HOST_OVER_LMCACHE}x: {verdict})")
    print(f"ceiling here: both restore with one host copy; memcpy / lmcache = "
          f"{copy / lmc:.2f}x, host at {results['host'].gbps / copy:.0%} of memcpy")


def write_json(path: str, args: argparse.Namespace, layout: KVLayout, summary: dict[str, Any],
               results: dict[str, TierResult], skipped: dict[str, str], recompute_s: float,
               model: dict[str, Any]) -> None:
    import torch

    result = {
        "summary": summary,
        "tiers": {n: {"gbps": r.gbps, "restore_s": r.seconds,
                      "restore_s_median": r.median_seconds, "store_s": r.store_seconds,
                      "restore_s_all": list(r.all_seconds), "blocks": r.blocks,
                      "bytes": r.bytes, "note": r.note}
                  for n, r in results.items()},
        "skipped": skipped,
        "recompute": {"seconds": recompute_s, "model": model},
        "config": {"layout": layout.to_json(), "block_bytes": layout.block_bytes,
                   **{k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "torch_threads": torch.get_num_threads()},
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
