"""The console's progress where stdout is not a terminal: plain lines a job log can show."""

import io
import time

from ebrl.telemetry.report import ProgressBar


def test_a_log_gets_a_line_per_iteration_and_a_heartbeat_while_one_runs_long():
    log = io.StringIO()  # (not a terminal)
    bar = ProgressBar(total=3, heartbeat_s=0.2, stream=log)
    bar.update({"perf/env_steps_per_s": 428.04, "env_steps": 640, "env/return": 0.5, "env/success_rate": 0.25})
    time.sleep(0.7)  # (the heartbeat looks every min(heartbeat_s, 5) s)
    bar.advance("success 40% of 5")
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith(
        "train 1/3  env steps 640  428.0 env steps/s  return 0.500  success 25.0%  elapsed 0:00:0"
    )
    assert "ETA 0:00:0" in lines[0]
    beats = [line for line in lines[1:-1] if "the next still running" in line]
    assert beats and beats[0].startswith("train 1/3  the next still running (0:00:0")
    assert lines[-1].startswith("train 2/3  success 40% of 5  elapsed 0:00:0")


def test_a_terminal_gets_the_bar_only():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    bar = ProgressBar(total=2, stream=out)
    bar.update({"perf/env_steps_per_s": 10.0, "env_steps": 10})
    bar.close()
    assert out.getvalue() == ""
