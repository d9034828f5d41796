"""The two kinds of failure a run ends on, which every component's error derives from.

- `BadInput`: what the user gave cannot work (a config value, a simulator package or asset, a checkpoint, a profile,
  a node that cannot host the plan). The run ends before it trained, with one line saying what was wrong and what
  would be right, exit code 2, and nothing left behind.
- `StageFailed`: a part of a running run failed (the trainer, generation, the simulators, another rank, the run's
  own NaN guard). One line naming it, exit code 1; the run folder keeps its last checkpoint.

`ebrl.runtime.errors.exit_cleanly` catches these two. Each error also keeps the builtin base it had (ValueError,
RuntimeError), so code that catches those still does.
"""

from __future__ import annotations


class BadInput(Exception):
    """The user's input cannot work; the message is one line: what was wrong and what would be right."""


class StageFailed(RuntimeError):
    """A stage of a running run failed; the message is one line naming it."""


class DiskFull(StageFailed):
    """A write of the run found its disk full; the message says where, what was needed, what is free and what is
    intact."""


def megabytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def free_bytes(folder: object) -> int:
    """The bytes free on the filesystem that holds `folder`."""
    import shutil

    return shutil.disk_usage(folder).free


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or what caused it, is a full disk: ENOSPC / EDQUOT, or torch's serializer giving up on a
    short write (`unexpected pos ...`, `file write failed`)."""
    import errno

    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(error, RuntimeError) and any(
            sign in str(error) for sign in ("unexpected pos", "file write failed")
        ):
            return True
        error = error.__cause__ or error.__context__
    return False
