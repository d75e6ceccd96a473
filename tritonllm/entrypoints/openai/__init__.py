"""The OpenAI-compatible server: `create_app(engine)` for a FastAPI app, `run_server(engine, ...)` to serve it."""
