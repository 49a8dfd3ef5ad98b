"""The one HTTP edge that ``polychip serve`` and ``polychip router`` both stand on: the ASGI gate
(request ids, cross-origin refusal, API key, content type, body size and time, access log), the
connection timeouts uvicorn lacks, the OpenAI error body and exception handlers, the API-key
dependency, the uvicorn server with its ready line and signals, bind and URL helpers, the Live
view's recent time series (live.py), and the launcher of ``polychip serve``. It imports nothing
of the engine, the server or the router."""
