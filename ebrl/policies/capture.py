"""Generation's denoising loop without its per-kernel overhead (`policy.capture`; docs/use/policies.md, "Capture").

After the prefix, a chunk is K velocity steps of small kernels, each launched from Python. `FlowPolicy.walk` is that
loop as a function of tensors that draws no random numbers and branches on no tensor, so it can be recorded once:
- graph (CUDA): a CUDA graph per input signature (the loop's mode and each input's shape and dtype: another
  generation batch is another capture), over static input buffers. A call copies its inputs in, replays the graph and
  returns copies of its outputs. The graph reads the weights where they are, so weights copied in place (the
  channel's pull, an optimizer step, load_state_dict) are seen; a policy moved or cast drops its graphs
  (`FlowPolicy._apply`). A signature whose capture fails runs the loop as it is, after one warning.
- compile: torch.compile of the loop, specialised per signature up to dynamo's recompile limit (then as it is).
- off: the loop as it is. auto: graph on CUDA, off on a CPU (where compile did not pay: docs/use/policies.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ebrl.config import ConfigError
from ebrl.policies.layers import map_tensors

CAPTURES = ("auto", "off", "graph", "compile")

Loop = Callable[..., Any]  # fn(mode, *inputs) -> a tree of tensors


def check_capture(capture: str) -> None:
    """One line for a `policy.capture` that is not one of CAPTURES."""
    if capture not in CAPTURES:
        raise ConfigError(f"policy.capture={capture!r} is not available; accepted: {', '.join(CAPTURES)}")


def capture_on(capture: str, device: torch.device) -> str:
    """What `policy.capture` does on `device`: off, graph or compile."""
    check_capture(capture)
    if capture == "auto":
        return "graph" if device.type == "cuda" else "off"
    if capture == "graph" and device.type != "cuda":
        raise ConfigError(f"policy.capture=graph needs a CUDA device, not {device}; accepted here: auto, off, compile")
    return capture


def loop_on(capture: str, fn: Loop, device: torch.device) -> Loop:
    """`fn` as `policy.capture` runs it on `device`."""
    how = capture_on(capture, device)
    if how == "graph":
        return GraphedLoop(fn, device)
    if how == "compile":
        return torch.compile(fn, dynamic=False)
    return fn


def leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure, in `map_tensors`' order."""
    found: list[torch.Tensor] = []
    map_tensors(tree, found.append)
    return found


def with_leaves(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """`tree` with its tensors replaced, in `leaves`' order."""
    it = iter(tensors)
    return map_tensors(tree, lambda _: next(it))


@dataclass
class Graph:
    """One captured signature: the graph, the buffers it reads its inputs from and those it writes its outputs to."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Any


class GraphedLoop:
    """`fn(mode, *inputs)` replayed from a CUDA graph per input signature (see the module docstring); the graphs share
    one memory pool, as they run one at a time on one stream."""

    def __init__(self, fn: Loop, device: torch.device) -> None:
        self.fn, self.device = fn, device
        self.graphs: dict[tuple, Graph | None] = {}  # None: the capture failed, the loop runs as it is
        self.pool: Any = None

    def __call__(self, mode: str, *inputs: Any) -> Any:
        flat = leaves(inputs)
        key = (mode, tuple((t.shape, t.dtype) for t in flat))
        if key not in self.graphs:
            self.graphs[key] = self.capture(mode, inputs, flat)
        entry = self.graphs[key]
        if entry is None:
            return self.fn(mode, *inputs)
        for buffer, t in zip(entry.inputs, flat):
            buffer.copy_(t)
        entry.graph.replay()
        return map_tensors(entry.outputs, torch.clone)  # the next replay overwrites the buffers

    def capture(self, mode: str, inputs: tuple, flat: list[torch.Tensor]) -> Graph | None:
        """Warm the loop up on a side stream (lazy initialisations stay out of the graph), then record it."""
        buffers = [t.clone() for t in flat]
        static = with_leaves(inputs, buffers)
        # autocast's cached weight casts live only until its context exits: a graph must cast the weights itself
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            with torch.cuda.device(self.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.fn(mode, *static)
                torch.cuda.current_stream().wait_stream(side)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA calls meanwhile (a copy, an allocation) do not spoil it
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    outputs = self.fn(mode, *static)
        except RuntimeError as e:  # an operation a graph cannot hold (a host sync, a host tensor)
            shapes = ", ".join(str(tuple(t.shape)) for t in flat[-3:])
            warnings.warn(
                f"policy.capture=graph: the {mode} denoising loop on inputs ..., {shapes} runs uncaptured: "
                f"{str(e).strip().splitlines()[0][:200]}",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        finally:
            torch.set_autocast_cache_enabled(cache)
        return Graph(graph, buffers, outputs)
