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
