"""Load generation for any OpenAI-compatible server, over HTTP only (nothing here imports ``engine``).

``kvstorm bench serve`` is the open-loop asyncio client; ``loadgen/locustfile.py`` is the Locust front. Both share
the SSE parser (``sse``) and the per-request stream checks (``tracker``), which import neither asyncio nor gevent.
"""
