"""Simulator adapters and the simulator worker process. numpy and the simulator only, never torch."""
