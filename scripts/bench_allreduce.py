"""All-reduce bandwidth between this host's GPUs through NCCL: the ceiling that data-parallel scaling works under.

    torchrun --standalone --nproc_per_node=2 scripts/bench_allreduce.py [--out DIR]
    NCCL_DEBUG=INFO torchrun ...   # NCCL also logs the transport it chose (P2P/NVLink, SHM through host memory, ...)

Per message size (fp32): median time of 20 all-reduces after 5 warm-ups, algorithm bandwidth (bytes / time) and bus
bandwidth (algbw * 2(n-1)/n, nccl-tests' definition: comparable with the link's rated bandwidth). DDP all-reduces a
GPT-2 124M step's fp32 gradients (~500 MB) in 25 MB buckets. NVLink multicast stays off unless the environment sets
it (common.NO_MULTICAST), as shared multi-GPU hosts require.

Rank 0 writes results.json and results.md to --out (default: a fresh outputs/bench/allreduce-<date>_<time>/; results
worth keeping go to docs/results/) and prints the table.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.common import NO_MULTICAST, default_out, run_meta, write_report  # noqa: E402


def measure(mib: int, world_size: int) -> dict[str, float]:
    """Median time of 20 all-reduces of mib MiB (after 5 warm-ups) and the bandwidths it implies."""
    x = torch.ones(mib * 2**20 // 4, device="cuda")
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(x)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    seconds = statistics.median(times)
    algbw = mib * 2**20 / seconds / 1e9
    return {"mib": mib, "ms": seconds * 1e3, "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (world_size - 1) / world_size}


def markdown(rows: list[dict[str, float]], meta: dict[str, Any]) -> str:
    lines = [f"All-reduce (fp32), {meta['world_size']} x {meta['device']}, torch {meta['torch']}, {meta['date']}.", "",
             "| MiB | ms | algbw GB/s | busbw GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['mib']} | {r['ms']:.3f} | {r['algbw_gbs']:.1f} | {r['busbw_gbs']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,25,128,512")
    parser.add_argument("--out", type=Path, default=default_out("allreduce"))
    args = parser.parse_args()
    for name, value in NO_MULTICAST.items():  # read by NCCL when the process group starts
        os.environ.setdefault(name, value)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    rows = [measure(mib, n) for mib in map(int, args.sizes_mib.split(","))]
    if dist.get_rank() == 0:
        meta = run_meta(torch.device("cuda"), world_size=n, env={k: os.environ[k] for k in NO_MULTICAST})
        table = markdown(rows, meta)
        write_report(args.out, {"meta": meta, "rows": rows}, table)
        print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
