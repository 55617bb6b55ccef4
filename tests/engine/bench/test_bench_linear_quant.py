"""`strata-engine bench linear --quant`: the quantized layers it times are the loaders' layouts of the weight,
bad options are one line naming them, and on a GPU each format's row carries its time against cuBLAS bf16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.bench.linear_quant import QUANT_FORMATS, quantized_layer
from tests.engine.bench.test_bench import bench


@pytest.mark.parametrize("fmt, max_rel_err", [("fp8", 0.07), ("fp8-block", 0.07), ("int4", 0.2), ("int4-g32", 0.2),
                                              ("int8", 0.01), ("int8-g32", 0.01)])
def test_each_format_is_a_quantized_layer_of_the_weight(fmt, max_rel_err):
    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.02
    layer = quantized_layer(weight, fmt)
    assert layer.format == fmt.split("-")[0] and (layer.out_features, layer.in_features) == (256, 384)
    if fmt == "fp8-block":
        assert (layer.block_n, layer.block_k) == (128, 128)
    if fmt.startswith("int"):
        assert layer.group_size == (32 if fmt.endswith("-g32") else 128)
    err = (layer.dequantize() - weight).abs().max() / weight.abs().max()
    assert err <= max_rel_err, err


@pytest.mark.parametrize("argv, message", [
    (["--quant", "fp9"], "quant='fp9': expected a comma-separated list of fp8, fp8-block, int4, int4-g32, int8, "
                         "int8-g32"),
    (["--quant", "int4", "--quant-tune", "64x100x1x4x4"], "quant_tune='64x100x1x4x4'"),
    (["--quant-tune", "64x128x1x4x4"], "launch shapes need --quant"),
    (["--table-out", "t.json"], "table_out='t.json': the quantized kernels' launch shapes need --quant"),
])
def test_bad_quant_options_are_one_line_and_exit_2(argv, message):
    done = subprocess.run([sys.executable, "-m", "engine.bench", "linear", "--device", "cpu", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_bench_in_the_interpreter_times_every_path_and_writes_a_launch_table_the_engine_reads(tmp_path: Path):
    """On CPU (Triton's interpreter: no speeds, but every path, peer column and the table writer run), as the GPU
    script's step runs it."""
    import json

    from engine.model.quant import launch_table

    table = tmp_path / "table.json"
    table.write_text(json.dumps({"devices": {"NVIDIA H200": {"int4/n64/k64": {"tc_rows": 8}}}}))
    done = subprocess.run([sys.executable, "-m", "engine.bench", "linear", "--device", "cpu", "--size", "tiny",
                           "--rows", "1,16", "--iters", "1", "--quant", "int4,fp8-block",
                           "--quant-tune", "32x128x2x4x3,64x128x1x4x3xpairs", "--table-out", str(table),
                           "--json", str(tmp_path / "q.json")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert {(r["format"], r["rows"]) for r in rows} == {(f, n) for f in ("int4", "fp8-block") for n in (1, 16)}
    for row in rows:
        assert not [key for key in row if key.endswith("_error")], row
        columns = ("gemv", "g_32x128x2x4x3") if row["rows"] == 1 else ("tc", "t_32x128x2x4x3", "dense")
        # the pair-unpacking shape: on the tensor-core path of the int4 layers whose group spans its step (K 128,
        # the down projection's), never on the GEMV's 1-4 rows nor on FP8
        pairs = row["rows"] == 16 and row["format"] == "int4" and row["k"] == 128
        columns += ("t_64x128x1x4x3xpairs",) if pairs else ()
        assert pairs == any("xpairs" in key for key in row), row
        assert all(row[f"{c}_max_err"] <= 1e-5 for c in ("quant",) + columns), row
    written = launch_table.read(table)
    assert written["NVIDIA H200"] == {"int4/n64/k64": {"tc_rows": 8}}  # another device's entries kept
    assert set(written["cpu"]) == {r["class"] for r in rows} and all("gemv" in e for e in written["cpu"].values())


@pytest.mark.gpu
@pytest.mark.gpu_shared
def test_bench_linear_times_every_quantized_format_against_cublas(tmp_path: Path) -> None:
    doc = bench(tmp_path, ["linear", "--device", "cuda:0", "--size", "0.6b", "--rows", "1,16", "--iters", "8",
                           "--quant", ",".join(QUANT_FORMATS), "--quant-tune", "32x128x2x4x3"], device="cuda:0")
    rows = doc["rows"]
    assert {(r["format"], r["weight"], r["rows"]) for r in rows} == {
        (f, w, n) for f in QUANT_FORMATS for w in ("qkv", "o", "gate_up", "down") for n in (1, 16)}
    for row in rows:
        tuned = "g_32x128x2x4x3" if row["rows"] == 1 else "t_32x128x2x4x3"
        assert row["torch_ms"] > 0 and row["quant_ms"] > 0 and row[f"{tuned}_ms"] > 0, row
        assert row["quant_max_err"] <= 0.02 and row[f"{tuned}_max_err"] <= 0.02, row
        assert row["ideal"] > 1.5
        if row["format"] == "int4":  # PyTorch's own int4 kernel beside ours, on our codes
            assert row["tinygemm_ms"] > 0 and row["tinygemm_max_err"] <= 0.02, row
    assert doc["summary"]["layer_int4_speedup_rows1"] > 0


def test_a_launch_shape_that_failed_at_any_row_count_never_enters_the_table():
    """On an H100 `128x256x2x4x3` ran at 16 rows and ran out of shared memory at 128 (a larger row tile): summed
    over the one row count it ran, it looked the fastest, the table routed the tensor-core path to it, and every
    int4 prompt of 128 tokens then failed (`bench decode --weight-formats int4`: no first token). These are that
    H100's measured int4 rows of the 8B shape's qkv (ms)."""
    from engine.bench.linear_quant import launch_table_of

    failed = "OutOfResources: out of resource: shared memory, Required: 237568, Hardware limit: 232448."
    cls = {"class": "int4/n8192/k4096", "gemv_config": "128x128x8x4x2", "tc_config": "64x128x4x4x3"}
    rows = [
        {**cls, "rows": 1, "gemv_ms": 0.0138, "tinygemm_ms": 0.0101},
        {**cls, "rows": 4, "gemv_ms": 0.0224, "tc_ms": 0.0176, "tinygemm_ms": 0.0139},
        {**cls, "rows": 16, "tc_ms": 0.0194, "t_64x128x4x4x3_ms": 0.0193, "t_128x256x2x4x3_ms": 0.0187,
         "t_32x128x8x2x4_ms": 0.029, "dense_ms": 0.0412, "tinygemm_ms": 0.0357},
        {**cls, "rows": 128, "tc_ms": 0.1066, "t_64x128x4x4x3_ms": 0.1062, "t_128x256x2x4x3_error": failed,
         "t_32x128x8x2x4_ms": 0.2011, "dense_ms": 0.1296, "tinygemm_ms": 0.2226},
    ]

    entry = launch_table_of(rows, "NVIDIA H100 80GB HBM3")["int4/n8192/k4096"]

    assert entry["tc"] == "64x128x4x4x3" and entry["tc_rows"] == 128
    # PyTorch's int4 kernel for a decode step's rows, where it measured faster than both of ours
    assert entry["tinygemm_rows"] == 4
    # the GEMV takes 1-4 rows or none: 13.8 + 22.4 us over 1 and 4 rows against the tensor cores' 2 x 17.6
    assert entry["gemv_rows"] == 0
    faster_gemv = [{**r, "gemv_ms": r["gemv_ms"] * 0.9} if "gemv_ms" in r else r for r in rows]
    assert launch_table_of(faster_gemv, "NVIDIA H100 80GB HBM3")["int4/n8192/k4096"]["gemv_rows"] == 4
    # tinygemm for 1-3 rows only would split a decode step's 1-4 sequences between two paths: none
    slower_tiny = [{**r, "tinygemm_ms": 1.0} if r["rows"] == 4 else r for r in rows]
    assert "tinygemm_rows" not in launch_table_of(slower_tiny, "NVIDIA H100 80GB HBM3")["int4/n8192/k4096"]


def test_the_tensor_core_shape_is_the_one_whose_route_beside_the_dense_path_costs_least():
    """An H100's int4 rows of the 8B shape (ms; `bench linear --quant int4 --rows 16,64,128`): the pairs shape is
    the fastest summed over the three counts for every class, but for o the dense path (dequantize + cuBLAS) beats
    every tensor-core shape past 16 rows, and there the plain shape is faster at 16. The table gave the tensor cores
    128 rows from older dense timings, where the dense path now takes half the time at 64."""
    from engine.bench.linear_quant import launch_table_of

    def cls(name, table_ms, plain_ms, pairs_ms, dense_ms):
        return [{"class": name, "tc_config": "64x128x4x4x3", "rows": rows, "tc_ms": t, "t_64x128x4x4x3_ms": p,
                 "t_128x128x4x4x3xpairs_ms": q, "dense_ms": d}
                for rows, t, p, q, d in zip((16, 64, 128), table_ms, plain_ms, pairs_ms, dense_ms)]

    o = cls("int4/n4096/k4096", (0.0157, 0.0526, 0.0735), (0.0157, 0.0526, 0.0735), (0.0176, 0.0272, 0.0411),
            (0.0253, 0.0244, 0.0276))
    gate_up = cls("int4/n32768/k4096", (0.0634, 0.1925, 0.3525), (0.0617, 0.2802, 0.4253), (0.0488, 0.1401, 0.2209),
                  (0.1617, 0.1629, 0.1645))
    table = launch_table_of(o + gate_up, "NVIDIA H100 80GB HBM3")

    assert (table["int4/n4096/k4096"]["tc"], table["int4/n4096/k4096"]["tc_rows"]) == ("64x128x4x4x3", 16)
    assert (table["int4/n32768/k4096"]["tc"], table["int4/n32768/k4096"]["tc_rows"]) == ("128x128x4x4x3xpairs", 64)
    # without dense timings no threshold is drawn and the fastest shape over every count is the one
    bare = [{k: v for k, v in r.items() if k != "dense_ms"} for r in o]
    assert launch_table_of(bare, "x")["int4/n4096/k4096"] == {"tc": "128x128x4x4x3xpairs"}
