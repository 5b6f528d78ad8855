"""All-reduce bandwidth between this host's GPUs through NCCL: the ceiling that data-parallel scaling works under.

    torchrun --standalone --nproc_per_node=2 scripts/bench_allreduce.py [--out allreduce.json]
    NCCL_DEBUG=INFO torchrun ...   # NCCL also logs the transport it chose (P2P/NVLink, SHM through host memory, ...)

Per message size (fp32): median time of 20 all-reduces after 5 warm-ups, algorithm bandwidth (bytes / time) and bus
bandwidth (algbw * 2(n-1)/n, nccl-tests' definition: comparable with the link's rated bandwidth). DDP all-reduces a
GPT-2 124M step's fp32 gradients (~500 MB) in 25 MB buckets.
"""

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,25,128,512")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n, rows = dist.get_world_size(), []
    for mib in map(int, args.sizes_mib.split(",")):
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
        rows.append({"mib": mib, "ms": seconds * 1e3, "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (n - 1) / n})
    if dist.get_rank() == 0:
        print(f"all-reduce, {n} GPUs ({torch.cuda.get_device_name()}), torch {torch.__version__}")
        for r in rows:
            print(f"{r['mib']:5d} MiB {r['ms']:9.3f} ms  algbw {r['algbw_gbs']:7.1f} GB/s  "
                  f"busbw {r['busbw_gbs']:7.1f} GB/s")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world_size": n, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
