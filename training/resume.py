"""Where checkpoints are, and which one a run resumes from: the one resume policy, torch-free.

train.py's launch applies it before Hydra writes anything into the run directory (training/rundir.py: claim), and the
loop applies it again as it builds the run (training/loop.py), so both always agree:

    point = resume_point(run_dir, cfg.train.resume, cfg.train.overwrite)   # a checkpoint, or None: start afresh

A checkpoint is a `.pt` file or a sharded `.dcp` directory (training/checkpoint.py says what they hold); a run
directory's own resume point is the newest complete one of its checkpoints/last and best (.pt or .dcp).
"""

import os
from pathlib import Path

SHARDED = ".dcp"  # the suffix of a sharded checkpoint directory
MOVED_ASIDE = "replaced-"  # <directory>/replaced-<time>/: an earlier run's records, moved aside by a fresh start


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, foreign, or not matching the run."""

    user_error = True  # its message names the fix: train.py prints it as one `error:` line (training/launch.py)


def is_sharded(path: str | Path) -> bool:
    """Whether path is a sharded checkpoint directory (or the symlink to one)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def find_checkpoint(path: str | Path, names: tuple[str, ...] | None = None) -> Path | None:
    """path itself if it is a checkpoint (a .pt file or a sharded directory), else one of a run directory's
    checkpoints/<name>.pt or <name>.dcp: the first found of `names`, name by name, or without names the run's resume
    point, the newest complete one of last and best (an eval writes best, then last: a run killed between the two
    resumes from best, which is newer, and the only one before the first last was written). None if there is none."""
    path = Path(path)
    if path.is_file() or is_sharded(path):
        return path
    found = [candidate for name in names or ("last", "best")
             for candidate in (path / "checkpoints" / f"{name}.pt", path / "checkpoints" / f"{name}{SHARDED}")
             if candidate.is_file() or is_sharded(candidate)]
    if names or not found:
        return found[0] if found else None
    # The newest by the time it was published (a sharded checkpoint's symlink is renamed into place); last on a tie.
    return max(found, key=lambda p: p.lstat().st_mtime_ns)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint (a .pt file or a sharded directory), or a run directory, whose resume point is meant
    (find_checkpoint)."""
    found = find_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: point train.resume at a .pt file, a {SHARDED} directory or "
                              "a run directory")
    return found


def own_checkpoints(directory: Path, sweep: bool = False) -> list[Path]:
    """The resume point of a run directory (find_checkpoint), or, for a multirun's sweep directory,
    those of its job directories (`<n>/checkpoints/...`), records moved aside (MOVED_ASIDE) left out; empty if there
    is none."""
    if not directory.is_dir():
        return []
    runs = [p for p in sorted(directory.iterdir()) if p.is_dir() and not p.name.startswith(MOVED_ASIDE)] if sweep \
        else [directory]
    return [p for p in map(find_checkpoint, runs) if p is not None]


def resume_point(directory: Path, resume: str | None, overwrite: bool, sweep: bool = False) -> Path | None:
    """The checkpoint a run in `directory` (a multirun's jobs in it, with sweep) resumes from, None to start afresh.
    train.resume=auto continues the directory's own run if it has one; train.resume=<a checkpoint or run directory>
    resumes that one. A start afresh, or from another run's checkpoint, is refused where the directory holds
    checkpoints of its own (FileExistsError), unless train.overwrite=true."""
    own = own_checkpoints(directory, sweep)
    if resume == "auto":
        return own[0] if own else None
    target = find_checkpoint(resume) if resume else None
    if resume and target is None:
        raise ValueError(f"no checkpoint at {resume}: point train.resume at a .pt file, a {SHARDED} directory or a "
                         "run directory")
    if own and not overwrite and not (target and any(os.path.samefile(target, c) for c in own)):
        what, key = ("sweep", "hydra.sweep.dir") if sweep else ("run", "hydra.run.dir")
        raise FileExistsError(f"{directory} already holds a {what}'s checkpoints: continue it with train.resume=auto, "
                              f"choose another {key}, or set train.overwrite=true to start over (the earlier records "
                              f"are moved into {directory / MOVED_ASIDE}<time>/)")
    return target
