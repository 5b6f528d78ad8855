"""Train a GPT. Hydra composes the config from conf/ (see conf/config.yaml); the loop lives in training/loop.py.

    python train.py                                         # tiny model on the offline stdlib text, CPU-friendly
    python train.py attention=triton model=gpt2 data=openwebtext train.batch_size=16 train.compile=true
    python train.py -m attention=naive,sdpa,triton          # one run per backend
    python train.py train.resume=outputs/<date>/<time>      # continue a run from its checkpoints/last.pt
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from training.config import register_configs
from training.loop import train

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    train(OmegaConf.to_object(cfg), run_dir, root=Path.cwd())


if __name__ == "__main__":
    main()
