"""Benchmarks of the engine and its peers (`strata-engine bench`), plus the torch-free HTTP load client.

Import-light on purpose: `engine.loadgen.scenarios` (torch-free, used by the TUI) imports `engine.loadgen.load_client`,
so nothing here may import torch at package level. The torch benchmarks import it inside their modules.
"""
