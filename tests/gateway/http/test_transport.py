"""Reading a request's body: what is refused before any JSON is parsed."""

from __future__ import annotations

import gzip

import httpx
import pytest

from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(120)


def test_a_compressed_body_is_a_415_that_says_so(colocated: Stack) -> None:
    """A gzip body was read as JSON text: 'the request body is not valid UTF-8 (byte 1)', which
    sent the client looking for a bad character."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize"):
        r = httpx.post(
            f"{colocated.base_url}{path}",
            content=gzip.compress(body),
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
        assert r.status_code == 415, (path, r.text[:300])
        error = r.json()["error"]
        assert error["code"] == "content_encoding" and error["type"] == "invalid_request_error"
        assert "Content-Encoding 'gzip' is not supported" in error["message"]
    assert not colocated.workers[0].records.requests
    r = httpx.post(
        f"{colocated.base_url}/v1/completions",
        content=body,
        headers={"content-type": "application/json", "content-encoding": "identity"},
    )
    assert r.status_code == 200, r.text[:300]
