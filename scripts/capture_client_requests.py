"""Record the request bodies real OpenAI clients send, as fixtures the server tests replay.

A capturing server on loopback answers like an OpenAI-compatible server (JSON, or SSE with two tokens, usage
and [DONE]) and keeps every body it gets; each client (installed by the caller: the ``openai`` SDK here, the
others in their own virtual environments) is pointed at it. The bodies go to
``tests/engine/serving/recorded_client_requests.json`` (merged by client name) with the client's version.

    .venv/bin/python scripts/capture_client_requests.py openai
    .venv/bin/python scripts/capture_client_requests.py langchain --python ~/venvs/langchain/bin/python
    .venv/bin/python scripts/capture_client_requests.py guidellm --python ~/venvs/guidellm/bin/python
    .venv/bin/python scripts/capture_client_requests.py aiperf --python ~/venvs/aiperf/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import web

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "engine" / "serving" / "recorded_client_requests.json"
MODEL = "recorded"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night."

# Each client: the Python snippet or command that sends its requests to {url} (the capturing server's /v1), and
# the package whose version is recorded.
OPENAI_SDK = """
import openai
MODEL, PROMPT = "{model}", "{prompt}"
client = openai.OpenAI(base_url="{url}", api_key="none")
client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True))
client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
     max_tokens=4, stream=True, stream_options={"include_usage": True}))
"""
LANGCHAIN = """
from langchain_openai import ChatOpenAI
MODEL, PROMPT = "{model}", "{prompt}"
chat = ChatOpenAI(base_url="{url}", api_key="none", model=MODEL, max_tokens=4)
chat.invoke(PROMPT)
list(chat.stream(PROMPT))
"""
CLIENTS = {
    "openai": ("openai", ["-c", OPENAI_SDK]),
    "langchain": ("langchain-openai", ["-c", LANGCHAIN]),
    "guidellm": (
        "guidellm",
        [
            "-m",
            "guidellm",
            "run",
            "--backend",
            "kind=openai_http,target={base},model={model}",
            "--profile",
            "kind=synchronous",
            "--constraint",
            "kind=max_requests,count=2",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=4",
            "--tokenizer",
            "kind=hf_auto,model={processor}",
            "--output",
            "kind=json,path={out}/guidellm.json",
            "--disable-console-interactive",
        ],
    ),
    "aiperf": (
        "aiperf",
        [
            "-m",
            "aiperf",
            "profile",
            "--url",
            "{base}",
            "--model",
            "{model}",
            "--endpoint-type",
            "chat",
            "--streaming",
            "--request-count",
            "2",
            "--synthetic-input-tokens-mean",
            "32",
            "--output-tokens-mean",
            "4",
            "--tokenizer",
            "{processor}",
            "--artifact-dir",
            "{out}",
        ],
    ),
}


class Capture:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body))
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            return web.json_response(_response(chat))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in _chunks(chat):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0}]})


def _usage() -> dict:
    return {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}


def _response(chat: bool) -> dict:
    choice = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": "Once upon"}
    else:
        choice["text"] = "Once upon"
    kind = "chat.completion" if chat else "text_completion"
    return {"id": "x", "object": kind, "created": int(time.time()), "model": MODEL, "choices": [choice],
            "usage": _usage()}  # fmt: skip


def _chunks(chat: bool) -> list[dict]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    chunks = []
    for text, finish in (("Once", None), (" upon", "length")):
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice.update({"delta": {"content": text}} if chat else {"text": text})
        chunks.append({"id": "x", "object": kind, "created": int(time.time()), "model": MODEL, "choices": [choice]})
    chunks.append({"id": "x", "object": kind, "created": int(time.time()), "model": MODEL, "choices": [],
                   "usage": _usage()})  # fmt: skip
    return chunks


async def capture(python: str, args: list[str]) -> list[tuple[str, dict]]:
    recorder = Capture()
    app = web.Application()
    app.router.add_post("/v1/completions", recorder.handle)
    app.router.add_post("/v1/chat/completions", recorder.handle)
    app.router.add_get("/v1/models", recorder.models)
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))  # GuideLLM checks it first
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    with tempfile.TemporaryDirectory() as out:
        values = {"url": f"http://127.0.0.1:{port}/v1", "base": f"http://127.0.0.1:{port}", "out": out,
                  "model": MODEL, "prompt": PROMPT}  # fmt: skip
        if any("{processor}" in arg for arg in args):
            values["processor"] = _tokenizer_dir(out)
        command = [python, *(_fill(arg, values) for arg in args)]
        process = await asyncio.create_subprocess_exec(*command)
        code = await process.wait()
    await runner.cleanup()
    if code != 0:
        raise SystemExit(f"{' '.join(command)} exited with {code}")
    return recorder.requests


def _fill(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def _tokenizer_dir(out: str) -> str:
    """The bundled model's tokenizer saved as a folder (the benchmark clients count tokens with it)."""
    from engine.model.registry import resolve_model

    path = Path(out) / "tokenizer"
    resolve_model("smollm2-135m").load_tokenizer().hf_tokenizer.save_pretrained(path)
    return str(path)


def version_of(python: str, package: str) -> str:
    script = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run([python, "-c", script], capture_output=True, text=True, check=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("client", choices=sorted(CLIENTS))
    parser.add_argument("--python", default=sys.executable, help="the interpreter the client is installed in")
    args = parser.parse_args()
    package, client_args = CLIENTS[args.client]
    requests = asyncio.run(capture(args.python, client_args))
    version = version_of(args.python, package)
    recorded = [
        fixture for fixture in json.loads(FIXTURES.read_text()) if not fixture["client"].startswith(args.client)
    ]
    for index, (route, body) in enumerate(requests):
        recorded.append({"client": f"{args.client}-{index}", "note": f"{package} {version}, recorded by "
                         "scripts/capture_client_requests.py", "route": route, "body": body})  # fmt: skip
    FIXTURES.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"{len(requests)} requests of {package} {version} recorded in {FIXTURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
