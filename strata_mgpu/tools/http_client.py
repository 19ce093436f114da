"""What the tools that measure a running server over HTTP share: a client and streamed JSON chunks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


def connect(url: str, api_key: str | None, timeout_s: float) -> tuple[httpx.Client, str]:
    """A client for the server at `url` and the id of the (first) model it serves."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
    models = client.get("/v1/models")
    models.raise_for_status()
    return client, models.json()["data"][0]["id"]


def stream_chunks(client: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST `body` with `stream` on and yield each server-sent event's JSON, as it arrives."""
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
