"""A stand-in engine program: serves one engine kind's recorded routes (engine_replay.routes_for) on the
`--port` of the command line the profile built, after a short load time, until SIGTERM. It lets the launch,
readiness, stop and restart paths run for kinds that cannot run here (vLLM, SGLang).

    python tests/tui/replay_engine.py KIND [the engine's own arguments ... --port N ...]"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import uvicorn  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from tests.tui.engine_replay import routes_for  # noqa: E402


def main() -> None:
    kind, args = sys.argv[1], sys.argv[2:]
    port = int(args[args.index("--port") + 1])
    routes = routes_for(kind)
    print(f"replay {kind}: loading (args: {' '.join(args)})", flush=True)
    time.sleep(0.5)  # the app must wait for /health, not for the process to exist

    async def handle(request: Request) -> Response:
        status, media, body = routes.get(request.url.path, (404, "application/json", '{"detail":"Not Found"}'))
        return Response(body, status, media_type=media)

    app = Starlette(routes=[Route("/{path:path}", handle)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
