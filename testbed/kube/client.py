"""A small synchronous JSON client for the emulator (``requests``), for tests that check exact
API behaviour; the operator itself talks through kopf and the kubernetes client.

    api = KubeApi(server.url)
    api.create("/api/v1/namespaces/default/configmaps", {"metadata": {"name": "c"}})
    with pytest.raises(KubeApiError) as failed:
        api.patch(path, ops, patch_type="json")
    assert failed.value.status == 422
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import requests

__all__ = ["PATCH_TYPES", "KubeApi", "KubeApiError"]

Obj = dict[str, Any]

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "apply": "application/apply-patch+yaml",
}
REQUEST_TIMEOUT_S = 10.0


class KubeApiError(Exception):
    """An HTTP error answer; ``body`` is the ``Status`` object."""

    def __init__(self, status: int, body: Obj) -> None:
        super().__init__(f"{status} {body.get('reason', '')}: {body.get('message', body)}")
        self.status = status
        self.body = body
        self.reason = str(body.get("reason", ""))


class KubeApi:
    """JSON requests to ``base_url``; every call is bounded by ``REQUEST_TIMEOUT_S``."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()

    def close(self) -> None:
        self.session.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        all_headers = {"Content-Type": content_type, **(headers or {})}
        data = None if body is None else json.dumps(body).encode()
        response = self.session.request(
            method,
            self.base_url + path,
            data=data,
            params=params,
            headers=all_headers,
            timeout=REQUEST_TIMEOUT_S,
        )
        if not response.headers.get("Content-Type", "").startswith("application/json"):
            if response.status_code >= 400:
                raise KubeApiError(response.status_code, {"message": response.text})
            return response.text
        decoded = response.json()
        if response.status_code >= 400:
            raise KubeApiError(response.status_code, decoded)
        return decoded

    def get(self, path: str, **params: str) -> Any:
        return self.request("GET", path, params=params)

    def create(self, path: str, body: Obj, **params: str) -> Obj:
        result: Obj = self.request("POST", path, body=body, params=params)
        return result

    def replace(self, path: str, body: Obj) -> Obj:
        result: Obj = self.request("PUT", path, body=body)
        return result

    def patch(self, path: str, patch: Any, patch_type: str = "merge") -> Obj:
        result: Obj = self.request("PATCH", path, body=patch, content_type=PATCH_TYPES[patch_type])
        return result

    def delete(self, path: str, **options: Any) -> Obj:
        result: Obj = self.request("DELETE", path, body=options or None)
        return result

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
        except KubeApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def watch(self, path: str, *, timeout_s: int = 5, **params: str) -> Iterator[Obj]:
        """Events of a watch until the server closes it (``timeoutSeconds=timeout_s``)."""
        query = {"watch": "true", "timeoutSeconds": str(timeout_s), **params}
        with self.session.get(
            self.base_url + path,
            params=query,
            stream=True,
            timeout=(REQUEST_TIMEOUT_S, timeout_s + REQUEST_TIMEOUT_S),
        ) as response:
            if response.status_code >= 400:
                raise KubeApiError(response.status_code, response.json())
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)
