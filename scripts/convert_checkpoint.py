"""Convert a sharded checkpoint (the .dcp directory an FSDP2 run writes) into one single-file .pt checkpoint.

    python scripts/convert_checkpoint.py outputs/<date>/<time> last.pt        # the run's checkpoints/last.dcp
    python scripts/convert_checkpoint.py outputs/<date>/<time>/checkpoints/best.dcp best.pt

The .pt file holds the same state (model, optimizer, schedule, step, RNG, data position, config): it resumes a run
(train.resume=last.pt) on any number of processes, starts one (init_from=last.pt), and samples (sample.py). One
process reads every shard, so it needs host memory for the whole state (16 bytes per parameter with AdamW);
scripts/export_hf.py and sample.py read a .dcp directory directly.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from training.resume import CheckpointError, resolve_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a .dcp directory, or a run directory (its checkpoints/last.dcp)")
    p.add_argument("out", type=Path, help="the .pt file to write")
    args = p.parse_args(argv)
    try:
        state = load_checkpoint(args.checkpoint)
    except CheckpointError as e:
        p.error(str(e))
    state.pop("format")  # save_checkpoint writes it
    save_checkpoint(state, args.out)
    print(f"{resolve_checkpoint(args.checkpoint)} (step {state['step']}) -> {args.out}")
    return args.out


if __name__ == "__main__":
    main()
