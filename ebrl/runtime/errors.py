"""Bad input ends a run with one line on stderr, a non-zero exit, and nothing left behind; Ctrl-C with one line too."""
from __future__ import annotations

import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ebrl.config import ConfigError
from ebrl.envs.base import EnvSetupError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT


def _hydra_output_dir() -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:
        return None


def _remove_if_only_hydra_files(run_dir: Path) -> None:
    """Hydra made this folder for the failed invocation; when nothing but its own files is there, drop it."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "run.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextmanager
def exit_cleanly() -> Iterator[None]:
    from ebrl.runtime.checkpoint import CheckpointError

    try:
        yield
    except (ConfigError, EnvSetupError, CheckpointError) as e:
        run_dir = _hydra_output_dir()
        if run_dir is not None:
            _remove_if_only_hydra_files(run_dir)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        # Experiment.train wrote a checkpoint on its way out and the workers are stopped
        print("interrupted: continue with resume=<run folder>", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
