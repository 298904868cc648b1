"""API errors: the ``Status`` objects the emulator answers with, and their constructors."""

from __future__ import annotations

from typing import Any

from testbed.kube.resources import ResourceType

__all__ = ["ApiError", "bad_request", "conflict", "details", "invalid", "not_found"]

Obj = dict[str, Any]


class ApiError(Exception):
    """An error the API answers with a ``Status`` object."""

    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def details(rt: ResourceType, name: str | None) -> dict[str, Any]:
    details: dict[str, Any] = {"kind": rt.plural}
    if name:
        details["name"] = name
    if rt.group:
        details["group"] = rt.group
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.group_resource} "{name}" not found', details(rt, name))


def conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {why}',
        details(rt, name),
    )


def invalid(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(422, "Invalid", f'{rt.kind} "{name}" is invalid: {why}', details(rt, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)
