"""Bad input ends a run with one line on stderr, a non-zero exit, and nothing left behind; Ctrl-C or SIGTERM
(torchrun stopping the other ranks when one failed) with a checkpoint and one line; a failed trainer or rank with
one line naming it."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil

from ebrl.envs.base import one_line
from ebrl.envs.worker import free_blocks_now
from ebrl.errors import BadInput, StageFailed

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT

# A stop asked for while an update runs in this process (`update_then_stop`): the signal's name, raised as
# KeyboardInterrupt once the update has ended at its next optimizer step
_held = False
_asked: str | None = None
# The first stop signal and when it came, until the stop's line is written. GNU timeout (without --foreground) sends
# its signal to the command and then to the command's process group, which holds the command: the same signal twice,
# microseconds apart. Within ECHO_S of the first that is its echo, not a second Ctrl-C, and the stop goes on.
_first: tuple[int, float] | None = None
ECHO_S = 0.1


class RunStopped(StageFailed):
    """The run stopped itself on a failure it detected (e.g. NaN updates); the message is one line."""


def _hydra_output_dir() -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:
        return None


def remove_if_only_hydra_files(run_dir: Path) -> None:
    """Hydra made this folder for the failed invocation; when nothing but its own files (and the statistics a run
    copies from its checkpoint before it builds the policy) is there, drop it."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "run.log", "norm_stats.json"}:
        shutil.rmtree(run_dir, ignore_errors=True)


class StopLine:
    """What the stop line knows of the run: its folder, once the run has one (`Experiment.run_dir`)."""

    def __init__(self) -> None:
        self.run_dir: Path | None = None

    def resume_hint(self) -> str:
        """How to continue, with the real folder to copy; nothing where no checkpoint was written."""
        if self.run_dir is None or not (self.run_dir / "checkpoints" / "last.pt").exists():
            return ""
        return f"continue with resume={self.run_dir}"


@contextmanager
def exit_cleanly(process: str = "the supervisor process (generation, scheduling)") -> Iterator[StopLine]:
    """Around a run (or a benchmark, naming itself as `process`): bad input (`BadInput`) exits 2 with its line, a
    failed stage (`StageFailed`) or any other error exits 1 with one line and the resume hint, Ctrl-C or SIGTERM
    exits 130."""
    # the first Ctrl-C or SIGTERM stops the run (a checkpoint, the workers stopped), a second one at once
    global _asked, _first
    _asked = _first = None
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = StopLine()
    try:
        yield stop
    except BadInput as e:
        run_dir = _hydra_output_dir()
        if run_dir is not None:
            remove_if_only_hydra_files(run_dir)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    # the run folder keeps its last checkpoint
    except StageFailed as e:
        print(f"error: {_then(str(e), stop)}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except Exception as e:  # a failure in this process (generation, the schedule): one line, the traceback kept
        print(f"error: {_then(_report(e, process), stop)}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt as e:
        # Experiment.train wrote a checkpoint on its way out and the workers are stopped
        how = f" by {e.args[0]}" if e.args else ""  # SIGTERM: torchrun stops the other ranks when one failed
        hint = stop.resume_hint()
        print(f"interrupted{how}" + (f": {hint}" if hint else ""), file=sys.stderr)
        _first = None  # (from here any signal is a second one)
        previous = {}  # (a second signal while the process winds down still ends it at once, with its line)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _then(line: str, stop: StopLine) -> str:
    hint = stop.resume_hint()
    return f"{line}; {hint}" if hint else line


def _report(e: BaseException, process: str) -> str:
    """One line naming the process and its error and where its whole traceback is (`kept_traceback`)."""
    return f"{process} failed: {one_line(e)} (traceback in {kept_traceback(e)})"


def kept_traceback(e: BaseException) -> Path:
    """Write e's whole traceback to the run folder's error.txt (outside a run, or in a worker process, which has no
    run folder of its own, to a file of the temp folder); returns its path."""
    run_dir = _hydra_output_dir()
    text = "".join(traceback.format_exception(e))
    if run_dir is not None and run_dir.is_dir():
        path = run_dir / "error.txt"
        path.write_text(text)
    else:
        with tempfile.NamedTemporaryFile("w", prefix="ebrl-error-", suffix=".txt", delete=False) as f:
            f.write(text)
            path = Path(f.name)
    return path


def benchmark_main(main: Callable[[], object], name: str) -> None:
    """`python -m ebrl.bench.<name>`: main() under the run's one-line errors (a bad workload exits 2 with its line)."""
    with exit_cleanly(f"the benchmark {name}"):
        main()


@contextmanager
def update_then_stop() -> Iterator[None]:
    """Around an update in this process (a trainer in the supervisor): the first Ctrl-C or SIGTERM does not break it
    half-stepped, which would leave no state to checkpoint; the update ends at its next optimizer step (it polls
    `stop_asked`) and the KeyboardInterrupt is raised as this block ends."""
    global _held, _asked
    _held = True
    try:
        yield
    finally:
        _held = False
    if _asked is not None:
        name, _asked = _asked, None  # (delivered)
        raise KeyboardInterrupt(name)


def stop_asked() -> bool:
    """Whether a Ctrl-C or SIGTERM came while an update ran (`update_then_stop`)."""
    return _asked is not None


def _interrupt(signum: int, frame: object) -> None:
    """The first Ctrl-C or SIGTERM: KeyboardInterrupt, which the run stops on (a checkpoint, its workers stopped), or
    within an update the stop asked for (`update_then_stop`); from then on either signal stops the process at once
    (`_at_once`)."""
    global _asked, _first
    _first = (signum, time.monotonic())
    signal.signal(signal.SIGTERM, _at_once)
    signal.signal(signal.SIGINT, _at_once)
    if _held:
        _asked = signal.Signals(signum).name
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _at_once(signum: int, frame: object) -> None:
    """A second Ctrl-C or SIGTERM while the first one's stop is under way: every process this one started is killed,
    the simulators' shared slots freed, and this one exits 130 now. The checkpoint on disk is the
    last one written whole (checkpoints are written to a temporary file and renamed). The first one's echo (the
    same signal within ECHO_S, before the stop's line) is not a second one."""
    if _first is not None and signum == _first[0] and time.monotonic() - _first[1] < ECHO_S:
        return
    for child in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(child.cmdline()):  # (it frees what the dead held)
                child.kill()
        except psutil.Error:
            pass
    free_blocks_now()
    os.write(2, f"stopped at once by a second {signal.Signals(signum).name}\n".encode())
    os._exit(EXIT_INTERRUPTED)
