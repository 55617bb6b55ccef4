"""Compile a Triton kernel for an H200 (sm_90) on CPU with the Triton wheel's own compiler and ptxas, and read its
resource use: Triton's interpreter (the CPU tests' runner) accepts code that the GPU compiler refuses, and a kernel
that spills its registers to local memory loses the speed it exists for."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def _cubin_for_sm90(kernel, signature: dict[str, str], constants: dict, warps: int, stages: int, tmp_path: Path,
                    unaligned: tuple[str, ...]):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # a constexpr with a default (USE_GDC, engine.model.pdl) is left out of a launch that does not set it
    constants = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constants}
    signature = {**signature, **{name: "constexpr" for name in constants}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind != "constexpr" and name not in unaligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return compiled, cubin


def _cuobjdump(*args: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=60, check=True).stdout


def compile_for_sm90(kernel, signature: dict[str, str], constants: dict, warps: int, stages: int,
                     tmp_path: Path, unaligned: tuple[str, ...] = ("M",)) -> tuple[int, int, int, int]:
    """(registers, stack bytes, local bytes, shared bytes) of `kernel` compiled at these launch options; pointers,
    sizes and strides specialized as divisible by 16 (as a launch on real shapes does), but those in `unaligned`."""
    compiled, cubin = _cubin_for_sm90(kernel, signature, constants, warps, stages, tmp_path, unaligned)
    usage = _cuobjdump("--dump-resource-usage", str(cubin))
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    assert found, usage
    return int(found.group(1)), int(found.group(2)), int(found.group(4)), compiled.metadata.shared


def global_access_sm90(kernel, signature: dict[str, str], constants: dict, warps: int, stages: int,
                       tmp_path: Path, unaligned: tuple[str, ...] = ("M",), kind: str = "STG") -> dict[str, int]:
    """The global store (`kind` STG) or load (LDG) instructions of `kernel`'s sm_90 SASS by opcode (`STG.E.128`:
    16 bytes a thread, `LDG.E`: 4 ...)."""
    _, cubin = _cubin_for_sm90(kernel, signature, constants, warps, stages, tmp_path, unaligned)
    found: dict[str, int] = {}
    for opcode in re.findall(rf"\b{kind}\.[A-Z0-9_.]+", _cuobjdump("-sass", str(cubin))):
        found[opcode] = found.get(opcode, 0) + 1
    return found


def loop_opcodes_sm90(kernel, signature: dict[str, str], constants: dict, warps: int, stages: int,
                      tmp_path: Path, unaligned: tuple[str, ...] = ("M",)) -> list[str]:
    """The opcodes of `kernel`'s longest loop (the instructions between a backward branch and its target) in its
    sm_90 SASS: a streaming kernel's main loop, whose instructions a code bound it where it is issue-bound."""
    _, cubin = _cubin_for_sm90(kernel, signature, constants, warps, stages, tmp_path, unaligned)
    code = [(int(addr, 16), text) for addr, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);",
                                                                _cuobjdump("-sass", str(cubin)))]
    loops = [(int(target.group(1), 16), addr) for addr, text in code
             if (target := re.search(r"\bBRA\s+`?\(?0x([0-9a-f]+)", text)) and int(target.group(1), 16) < addr]
    assert loops, "no loop in the kernel's SASS"
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for addr, text in code if start <= addr <= end]
