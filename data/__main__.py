"""Prepare a data preset's token files from the command line (conf/data/<preset>.yaml, plus key=value overrides):

    python -m data --preset stdlib
    python -m data --preset local_text data_files='[notes.txt]' encoding=gpt2
    python -m data --preset tinystories num_proc=8
"""

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from data.config import DataConfig
from data.prepare import prepare_dataset

PRESETS = Path(__file__).resolve().parents[1] / "conf" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description="Prepare the token files of a data preset (conf/data/<preset>.yaml)")
    parser.add_argument("--preset", default="stdlib", help="a file name in conf/data/, without .yaml")
    parser.add_argument("overrides", nargs="*", help="DataConfig fields as key=value, e.g. data_files='[a.txt]'")
    args = parser.parse_args()
    node = OmegaConf.merge(
        OmegaConf.structured(DataConfig),
        OmegaConf.load(PRESETS / f"{args.preset}.yaml"),
        OmegaConf.from_dotlist(args.overrides),
    )
    data = prepare_dataset(OmegaConf.to_object(node))
    print(f"{data.dir}: {data.n_train:,} train + {data.n_val:,} val tokens ({data.encoding}, {data.dtype}, "
          f"vocab {data.vocab_size})")


if __name__ == "__main__":
    main()
