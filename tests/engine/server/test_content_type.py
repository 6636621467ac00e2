"""A body sent without a JSON content type (``curl -d`` sends a form) gets an error that says
so, not only pydantic's "Input should be a valid dictionary"."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from pydantic import BaseModel

from engine.server.errors import install_error_handlers


class Body(BaseModel):
    prompt: str


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: Body) -> dict[str, str]:
        return {"prompt": body.prompt}

    return app


def _post(**kw: object) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", **kw)  # type: ignore[arg-type]

    return asyncio.run(go())


def test_a_form_body_is_told_to_send_json() -> None:
    r = _post(
        content=b'{"prompt": "hi"}', headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message
    assert "application/x-www-form-urlencoded" in message and "\n" not in message


def test_json_bodies_keep_their_own_messages() -> None:
    ok = _post(json={"prompt": "hi"})
    assert ok.status_code == 200 and ok.json() == {"prompt": "hi"}
    wrong = _post(json={"prompt": 3})
    assert wrong.status_code == 400
    assert wrong.json()["error"]["message"].startswith("prompt: ")
    assert "Content-Type" not in wrong.json()["error"]["message"]
    not_object = _post(json=[1, 2])
    assert "Content-Type" not in not_object.json()["error"]["message"]
