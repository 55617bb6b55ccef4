"""The HTTP server: OpenAI-compatible /v1, Strata telemetry and control routes, /metrics, /health.

protocol.py (schemas) <- serving.py (logic over an EngineClient) <- app.py (thin routes, `create_app`).
Import `engine.server.app.create_app`; this package root imports nothing heavy.
"""
