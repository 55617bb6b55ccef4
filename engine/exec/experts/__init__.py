"""Routed experts of an MoE model: the GPU slot cache over host (or peer) memory, its setup, its hit and
routing statistics and traces, and the steps that fetch them. Below the runner."""
