"""What engine/server/uvicorn_server.py takes from uvicorn, held: it reads nothing private of uvicorn's Server or
h11 protocol (a private attribute changes without notice between releases), and the public method it overrides
to keep a graceful stop's exit code 0 (`capture_signals`) is still the one `serve` enters. When uvicorn changes
either, these fail with what changed, before a stop by SIGTERM starts to exit -15."""

from __future__ import annotations

import ast
import inspect
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server import uvicorn_server

ROOT = Path(__file__).resolve().parents[3]


def _private_names_of(cls: type) -> set[str]:
    """Underscore names (not dunder) a uvicorn class and its bases define or assign on `self`."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and node.attr.startswith("_") and not node.attr.startswith("__")}
    return names


def test_no_private_attribute_of_uvicorn_is_read_or_shadowed() -> None:
    source = Path(uvicorn_server.__file__).read_text()
    tree = ast.parse(source)
    ours = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and node.attr.startswith("_") and not node.attr.startswith("__")}
    for cls in (uvicorn.Server, H11Protocol):
        theirs = _private_names_of(cls)
        shared = sorted(ours & theirs)
        assert not shared, (f"engine/server/uvicorn_server.py uses {shared}, private to uvicorn's {cls.__name__} "
                            f"(uvicorn {uvicorn.__version__}): use a public API instead")


def test_serve_still_enters_the_public_capture_signals_it_overrides() -> None:
    # DrainingServer keeps a graceful stop's exit code 0 by overriding `capture_signals`; a uvicorn whose `serve`
    # no longer enters it would re-raise SIGTERM after the drain (exit -15) and ignore the override.
    serve = inspect.getsource(uvicorn.Server.serve)
    assert "self.capture_signals()" in serve, (
        f"uvicorn {uvicorn.__version__}'s Server.serve no longer enters capture_signals():\n{serve}\n"
        "DrainingServer.capture_signals (engine/server/uvicorn_server.py) must follow what it does now")


SERVE_AND_STOP = """
import asyncio, os, signal, sys
from engine.server.uvicorn_server import DrainingServer, server_config

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return

calls = []
before = signal.getsignal(signal.SIGTERM)

async def main():
    server = DrainingServer(server_config(app, "warning"), on_signal=lambda: calls.append("drain"))
    server.config.port = 0
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    await task

asyncio.run(main())
assert calls == ["drain"], calls
assert signal.getsignal(signal.SIGTERM) is before, "the SIGTERM handler from before serve was not restored"
print("stopped cleanly")
"""


def test_a_sigterm_drains_once_restores_the_old_handler_and_exits_0() -> None:
    proc = subprocess.run([sys.executable, "-c", SERVE_AND_STOP], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "stopped cleanly" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode != -signal.SIGTERM
