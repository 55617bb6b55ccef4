"""COMPILE's compiled kernels persist between runs: a second engine process on the same model shape takes its
compiled graphs from the cache folder instead of compiling them again (issue 17: compiling costs minutes of
start-up, at every start). Two real engine processes on CPU, whose graph cache compiles through Inductor's C++
backend; the cache folder is Strata's user cache (XDG_CACHE_HOME here), not Inductor's /tmp default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_RUN = """
import json
from pathlib import Path
from engine.api import SamplingParams
from engine.bench.engine_driver import BenchEngine
from tests.engine.engine_helpers import random_prompts, run_all, small_config, tokens_of
bench = BenchEngine(small_config(Path({model!r}), graphs=True, batch=1, switches={{"COMPILE": True}}), graph_cache_on_cpu=True)
engine = bench.engine
tokens = tokens_of(run_all(engine, random_prompts(1, seed=3, lengths=(24, 25)),
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
graphs = engine.state().to_json()["graphs"]
print(json.dumps({{"tokens": tokens, "dir": graphs.get("compile_cache_dir"), "hits": graphs.get("compile_cache_hits"),
                  "misses": graphs.get("compile_cache_misses"),
                  "compile": [s for s in engine.board.snapshot() if s["name"] == "COMPILE"][0]}}))
bench.close()
"""


@pytest.mark.slow
def test_a_second_engine_process_takes_its_compiled_graphs_from_the_cache(tmp_path: Path, ckpt) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _RUN.format(model=str(ckpt))], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compile"]["enabled"], first["compile"]  # compiled, not degraded
    assert first["dir"] == str(tmp_path / "cache" / "strata" / "torch-compile")
    assert any(Path(first["dir"]).rglob("*")), "the first run left nothing in the cache folder"
    assert first["misses"] > 0 and first["hits"] == 0
    assert second["hits"] >= first["misses"] and second["misses"] == 0, second
    assert second["tokens"] == first["tokens"]
