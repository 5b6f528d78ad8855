"""Train a GPT. Hydra composes the config from conf/ (see conf/config.yaml); the loop lives in training/loop.py.

    python train.py                                         # tiny model on the offline stdlib text, CPU-friendly
    python train.py attention=triton model=gpt2 data=openwebtext train.batch_size=16 train.compile=true
    python train.py -m attention=naive,sdpa,triton          # one run per backend
    python train.py train.resume=outputs/<date>/<time>      # continue a run from its checkpoints/last.pt

Before any heavy import, the config is composed and validated and the run directory locked and claimed
(training/launch.py: LaunchCallback); errors are one `error: ...` line, exit status 2 when the launch is refused and 1
when the run fails (docs/configuration.md).
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from training.config import register_configs, validate
from training.launch import exit_on_error, run_cli, sweep_job

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    # A run's error ends the process; a multirun job's is recorded and the sweep goes on to the next job.
    with sweep_job() if hydra_cfg.mode == RunMode.MULTIRUN else exit_on_error(status=1):
        config = OmegaConf.to_object(cfg)
        validate(config)  # a run's was checked before Hydra wrote its files (LaunchCallback); a multirun job's is here
        from training.loop import train  # torch, datasets, wandb (seconds): only once the config is known to be good

        train(config, Path(hydra_cfg.runtime.output_dir), root=Path.cwd())


if __name__ == "__main__":
    run_cli(main)
