"""CUDA graphs: the cache that captures a step function once and replays it, its keys, its static inputs and
its backends (graphs, compile). Below the runner and the drafter."""
