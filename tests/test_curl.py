"""The README's curl commands, and what curl's defaults meet, against the real server."""

from __future__ import annotations

import json
import subprocess
from typing import Any

CHAT = '{"messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["curl", "-sS", "--max-time", "60", *args], capture_output=True,
                          text=True, check=True)


def test_readme_chat_command(server: Any) -> None:
    out = curl(f"{server.url}/v1/chat/completions", "-H", "Content-Type: application/json",
               "-d", CHAT)
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] <= 16
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_streaming_with_curl_no_buffer(server: Any) -> None:
    payload = json.dumps({**json.loads(CHAT), "stream": True,
                          "stream_options": {"include_usage": True}})
    out = curl("-N", f"{server.url}/v1/chat/completions", "-H",
               "Content-Type: application/json", "-d", payload)
    events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 16
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)


def test_curl_default_form_type_is_415(server: Any) -> None:
    # curl -d without -H sends application/x-www-form-urlencoded: refused before a handler.
    out = curl("-w", "\n%{http_code}", f"{server.url}/v1/chat/completions", "-d", CHAT)
    body, status = out.stdout.rsplit("\n", 1)
    assert status == "415"
    assert json.loads(body)["code"]


def test_cancel_with_an_empty_json_post(server: Any) -> None:
    out = curl("-w", "\n%{http_code}", "-X", "POST", "-H", "Content-Type: application/json",
               f"{server.url}/api/cancel")
    body, status = out.stdout.rsplit("\n", 1)
    assert status == "200" and json.loads(body)["cancelled"] is False


def test_ui_page_and_headers(server: Any) -> None:
    out = curl("-D", "-", "-o", "/dev/null", f"{server.url}/")
    headers = out.stdout.lower()
    assert headers.startswith("http/1.1 200")
    assert "content-security-policy: default-src 'self'" in headers
    assert "x-frame-options: deny" in headers and "access-control-allow-origin" not in headers
