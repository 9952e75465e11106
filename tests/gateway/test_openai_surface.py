"""The rest of the OpenAI surface, as OpenAI's own client sees it: routes that do not exist,
``models.retrieve``. A real gateway process in front of a real worker (the tiny random model)
and a real redis-server.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.gateway.conftest import Fleet
from tests.support.gateway import GatewayFactory, GatewayProcess

MODEL = "tiny"


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    factory = GatewayFactory(tmp_path_factory.mktemp("gateway"), fleet.redis_url, fleet.prefix)
    try:
        yield factory.start()
    finally:
        factory.stop_all()
        print(factory.report())


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0) as client:
        yield client


def http_error(url: str, method: str = "GET", body: bytes | None = None) -> urllib.error.HTTPError:
    request = urllib.request.Request(url, data=body, method=method)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    return caught.value


def openai_error(error: urllib.error.HTTPError) -> dict[str, Any]:
    assert error.headers["content-type"] == "application/json"
    body = json.loads(error.read())
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    fields: dict[str, Any] = body["error"]
    return fields


# -- routes that are not there ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/nothing", "/v2/chat/completions", "/favicon.ico", "/v1"])
def test_an_unknown_route_is_a_404_in_openais_shape(gateway: GatewayProcess, path: str) -> None:
    error = http_error(gateway.url + path)
    assert error.code == 404
    fields = openai_error(error)
    assert fields["type"] == "invalid_request_error"
    assert fields["code"] == "not_found"
    assert path in fields["message"]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("PUT", "/health", "GET"),
    ],
)
def test_a_method_a_route_does_not_take_is_a_405_in_openais_shape(
    gateway: GatewayProcess, method: str, path: str, allowed: str
) -> None:
    error = http_error(gateway.url + path, method=method, body=b"{}" if method != "GET" else None)
    assert error.code == 405
    assert allowed in error.headers["allow"]
    fields = openai_error(error)
    assert fields["type"] == "invalid_request_error"
    assert fields["code"] == "method_not_allowed"
    assert method in fields["message"] and allowed in fields["message"]


def test_the_sdk_reads_a_missing_route_as_not_found(gateway: GatewayProcess) -> None:
    wrong = openai.OpenAI(base_url=gateway.url + "/v9", api_key="none", max_retries=0)
    with wrong, pytest.raises(openai.NotFoundError) as caught:
        wrong.models.list()
    assert caught.value.code == "not_found"


# -- models.retrieve --------------------------------------------------------------------------


def test_a_served_model_is_retrieved(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "mlx-redis-worker")
    assert model.model_dump() == client.models.list().data[0].model_dump()


@pytest.mark.parametrize("name", ["no-such-model", "org/no-such-model"])
def test_an_unknown_model_is_retrieved_as_a_404_model_not_found(
    client: openai.OpenAI, name: str
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve(name)
    body = caught.value.response.json()
    assert body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "model"
    assert name in body["error"]["message"]
