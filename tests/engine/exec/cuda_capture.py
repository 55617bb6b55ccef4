"""Capture a step in a CUDA graph the way the graph cache does: warmed up (and compiled) on a side stream first,
then captured; the tests change its inputs in place and replay it."""

from __future__ import annotations

from typing import Callable

import torch


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(the graph, its output tensor) of `step`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
