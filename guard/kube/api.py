"""The API objects the kube modules call: the official ``kubernetes`` client's, or a light twin.

Every kube module calls the apiserver through ``api.CoreV1Api()``, ``api.DiscoveryV1Api()``,
``api.CoordinationV1Api()``, ``api.CustomObjectsApi()`` and ``api.VersionApi()`` of an :class:`Api`
(:func:`open_api`), with the official client's method names and arguments, and catches :class:`ApiError`.

- :class:`OfficialApi` (``ghost-guard serve``, and every configuration the official loader built):
  the ``kubernetes`` client itself, each call's ``ApiException`` turned into :class:`ApiError`.
- :class:`LightApi` (the CLI's cluster commands with a plain kubeconfig or in-cluster credentials,
  :func:`guard.kube.config.load_cli_configuration`): the same calls, each one request on a urllib3 pool
  built with the same TLS settings (:func:`guard.kube.config.connection_settings`), without importing
  ``kubernetes`` (about 1.5 s of CPU: pydantic models of every API group). Paths, verbs and query
  parameters are the official client's (tests/component/test_light_api.py compares each method the code
  calls with the client's own request), so the RBAC the manifests grant covers both.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import orjson
import urllib3


class ApiError(Exception):
    """The apiserver answered with a non-2xx status (``status``, ``reason`` phrase, ``body``), or
    (``status`` 0) the TLS handshake failed: the official client's ``ApiException``, by either API."""

    def __init__(self, status: int | None, reason: str | None, body: str | bytes | None = None) -> None:
        super().__init__(f"({status}) Reason: {reason}")
        self.status = status
        self.reason = reason
        self.body = body


def error_reason(data: str | bytes | None, http_reason: str | None) -> tuple[str, dict]:
    """The apiserver's Status ``reason`` of an error reply (else the HTTP reason phrase), and the Status."""
    try:
        body = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return str(body.get("reason") or http_reason or ""), body


def status_reason(e: ApiError) -> tuple[str, dict]:
    return error_reason(e.body, e.reason)


def open_api(configuration: Any) -> Any:
    """The API for this configuration: light for :class:`guard.kube.config.LightConfiguration`, else official."""
    from guard.kube.config import LightConfiguration

    if isinstance(configuration, LightConfiguration):
        return LightApi(configuration)
    return OfficialApi(configuration)


# --- the official client -------------------------------------------------------------------------


class _Translated:
    """An official API object whose calls raise :class:`ApiError` instead of ``ApiException``."""

    def __init__(self, api: Any, exc: type[Exception]) -> None:
        self._api = api
        self._exc = exc

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._api, name)
        exc = self._exc

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except exc as e:
                raise ApiError(e.status, e.reason, e.body) from e  # type: ignore[attr-defined]

        return call


class OfficialApi:
    """The ``kubernetes`` client on ``configuration`` (imported here, on first use)."""

    def __init__(self, configuration: Any) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        self._client = client
        self._exc = ApiException
        self.configuration = configuration
        self.api_client = client.ApiClient(configuration)
        self.default_headers: dict[str, str] = self.api_client.default_headers
        # The client's own pool (TLS and proxy from the configuration).
        self.pool_manager: urllib3.PoolManager = self.api_client.rest_client.pool_manager

    @property
    def cookie(self) -> str | None:
        return self.api_client.cookie

    def _api(self, name: str) -> Any:
        return _Translated(getattr(self._client, name)(self.api_client), self._exc)

    def CoreV1Api(self) -> Any:  # noqa: N802 - the client's class names, which tests/integration/test_security.py reads
        return self._api("CoreV1Api")

    def DiscoveryV1Api(self) -> Any:  # noqa: N802
        return self._api("DiscoveryV1Api")

    def CoordinationV1Api(self) -> Any:  # noqa: N802
        return self._api("CoordinationV1Api")

    def CustomObjectsApi(self) -> Any:  # noqa: N802
        return self._api("CustomObjectsApi")

    def VersionApi(self) -> Any:  # noqa: N802
        return self._api("VersionApi")

    def close(self) -> None:
        self.api_client.close()


# --- the light twin ------------------------------------------------------------------------------

# Query parameters by the client's argument names (kubernetes.client.api_client.parameters_to_url_query).
_QUERY = {"field_selector": "fieldSelector", "label_selector": "labelSelector", "resource_version": "resourceVersion",
          "watch": "watch", "allow_watch_bookmarks": "allowWatchBookmarks", "timeout_seconds": "timeoutSeconds",
          "limit": "limit", "_continue": "continue"}
USER_AGENT = "ghost-guard (light kubernetes calls)"


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return quote(str(value))


class LightApi:
    """The calls the kube modules make, each one urllib3 request (no retries, no redirects)."""

    def __init__(self, configuration: Any) -> None:
        from guard.kube.config import connection_settings

        self.configuration = configuration
        self.default_headers = {"User-Agent": USER_AGENT}
        self.cookie: str | None = None
        settings = connection_settings(configuration) or {}
        self.pool_manager = urllib3.PoolManager(num_pools=4, maxsize=max(configuration.connection_pool_maxsize, 1),
                                                **settings)

    def CoreV1Api(self) -> _LightCore:  # noqa: N802 - the client's class names (tests/integration/test_security.py)
        return _LightCore(self)

    def DiscoveryV1Api(self) -> _LightDiscovery:  # noqa: N802
        return _LightDiscovery(self)

    def CoordinationV1Api(self) -> _LightCoordination:  # noqa: N802
        return _LightCoordination(self)

    def CustomObjectsApi(self) -> _LightCustomObjects:  # noqa: N802
        return _LightCustomObjects(self)

    def VersionApi(self) -> _LightVersion:  # noqa: N802
        return _LightVersion(self)

    def close(self) -> None:
        self.pool_manager.clear()

    def path(self, template: str, **params: str) -> str:
        safe = self.configuration.safe_chars_for_path_param
        return template.format(**{k: quote(str(v), safe=safe) for k, v in params.items()})

    def call(self, method: str, path: str, *, body: Any = None, _preload_content: bool = True,
             _request_timeout: Any = None, _content_type: str | None = None, _headers: dict | None = None,
             **query: Any) -> Any:
        """One request (``query``: the client's query arguments, ``field_selector=...``); the urllib3 response
        (read unless ``_preload_content`` is False). Raises ApiError on a non-2xx answer or a TLS failure
        (status 0), urllib3's errors otherwise, as the official client."""
        headers = {**self.default_headers, "Accept": "application/json"}
        for auth in self.configuration.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        if _headers:
            headers.update(_headers)
        data = None
        if _content_type:
            headers["Content-Type"] = _content_type
        if body is not None:  # JSON; without a content type, as the official client sends it
            data = orjson.dumps(body)
        pairs = [f"{_QUERY[k]}={_query_value(v)}" for k, v in query.items() if v is not None]
        url = self.configuration.host + path + ("?" + "&".join(pairs) if pairs else "")
        if isinstance(_request_timeout, tuple):
            timeout = urllib3.Timeout(connect=_request_timeout[0], read=_request_timeout[1])
        elif _request_timeout is not None:
            timeout = urllib3.Timeout(total=_request_timeout)
        else:
            timeout = urllib3.Timeout()
        try:
            resp = self.pool_manager.request(method, url, body=data, headers=headers, timeout=timeout, retries=False,
                                             redirect=False, preload_content=_preload_content)
        except urllib3.exceptions.SSLError as e:
            raise ApiError(0, f"{type(e).__name__}\n{e}") from e
        if not 200 <= resp.status <= 299:
            raise ApiError(resp.status, resp.reason, resp.data)
        return resp


class _Light:
    """One API group's calls on a LightApi."""

    def __init__(self, api: LightApi) -> None:
        self.api = api


class _LightCore(_Light):
    def list_namespaced_pod(self, namespace: str, **kw: Any) -> Any:
        return self._list(self.api.path("/api/v1/namespaces/{namespace}/pods", namespace=namespace), kw)

    def list_pod_for_all_namespaces(self, **kw: Any) -> Any:
        return self._list("/api/v1/pods", kw)

    def list_node(self, **kw: Any) -> Any:
        return self._list("/api/v1/nodes", kw)

    def read_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path("/api/v1/namespaces/{namespace}/pods/{name}", namespace=namespace,
                                                  name=name), **kw)

    def create_namespaced_pod(self, namespace: str, body: Any, **kw: Any) -> Any:
        return self.api.call("POST", self.api.path("/api/v1/namespaces/{namespace}/pods", namespace=namespace),
                             body=body, **kw)

    def delete_namespaced_pod(self, name: str, namespace: str, body: Any = None, **kw: Any) -> Any:
        return self.api.call("DELETE", self.api.path("/api/v1/namespaces/{namespace}/pods/{name}",
                                                     namespace=namespace, name=name), body=body, **kw)

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **kw: Any) -> Any:
        return self.api.call("PATCH", self.api.path("/api/v1/namespaces/{namespace}/pods/{name}",
                                                    namespace=namespace, name=name), body=body, **kw)

    def read_node(self, name: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path("/api/v1/nodes/{name}", name=name), **kw)

    def create_node(self, body: Any, **kw: Any) -> Any:
        return self.api.call("POST", "/api/v1/nodes", body=body, **kw)

    def delete_node(self, name: str, body: Any = None, **kw: Any) -> Any:
        return self.api.call("DELETE", self.api.path("/api/v1/nodes/{name}", name=name), body=body, **kw)

    def read_namespaced_endpoints(self, name: str, namespace: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path("/api/v1/namespaces/{namespace}/endpoints/{name}",
                                                  namespace=namespace, name=name), **kw)

    def create_namespaced_event(self, namespace: str, body: Any, **kw: Any) -> Any:
        return self.api.call("POST", self.api.path("/api/v1/namespaces/{namespace}/events", namespace=namespace),
                             body=body, **kw)

    def read_namespaced_event(self, name: str, namespace: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path("/api/v1/namespaces/{namespace}/events/{name}",
                                                  namespace=namespace, name=name), **kw)

    def patch_namespaced_event(self, name: str, namespace: str, body: Any, **kw: Any) -> Any:
        return self.api.call("PATCH", self.api.path("/api/v1/namespaces/{namespace}/events/{name}",
                                                    namespace=namespace, name=name), body=body, **kw)

    def _list(self, path: str, kw: dict[str, Any]) -> Any:
        return self.api.call("GET", path, **kw)


class _LightDiscovery(_Light):
    def list_namespaced_endpoint_slice(self, namespace: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                                                  namespace=namespace), **kw)


class _LightCoordination(_Light):
    def list_namespaced_lease(self, namespace: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                                                  namespace=namespace), **kw)


class _LightCustomObjects(_Light):
    _NS = "/apis/{group}/{version}/namespaces/{namespace}/{plural}"

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, body: Any,
                                        **kw: Any) -> Any:
        return self.api.call("POST", self.api.path(self._NS, group=group, version=version, namespace=namespace,
                                                   plural=plural), body=body, **kw)

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                     **kw: Any) -> Any:
        return self.api.call("GET", self.api.path(self._NS + "/{name}", group=group, version=version,
                                                  namespace=namespace, plural=plural, name=name), **kw)

    def patch_namespaced_custom_object_status(self, group: str, version: str, namespace: str, plural: str, name: str,
                                              body: Any, **kw: Any) -> Any:
        return self.api.call("PATCH", self.api.path(self._NS + "/{name}/status", group=group, version=version,
                                                    namespace=namespace, plural=plural, name=name), body=body, **kw)

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                        body: Any = None, **kw: Any) -> Any:
        return self.api.call("DELETE", self.api.path(self._NS + "/{name}", group=group, version=version,
                                                     namespace=namespace, plural=plural, name=name), body=body, **kw)

    _CLUSTER = "/apis/{group}/{version}/{plural}"

    def create_cluster_custom_object(self, group: str, version: str, plural: str, body: Any, **kw: Any) -> Any:
        return self.api.call("POST", self.api.path(self._CLUSTER, group=group, version=version, plural=plural),
                             body=body, **kw)

    def get_cluster_custom_object(self, group: str, version: str, plural: str, name: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path(self._CLUSTER + "/{name}", group=group, version=version,
                                                  plural=plural, name=name), **kw)

    def patch_cluster_custom_object_status(self, group: str, version: str, plural: str, name: str, body: Any,
                                           **kw: Any) -> Any:
        return self.api.call("PATCH", self.api.path(self._CLUSTER + "/{name}/status", group=group, version=version,
                                                    plural=plural, name=name), body=body, **kw)

    def delete_cluster_custom_object(self, group: str, version: str, plural: str, name: str, body: Any = None,
                                     **kw: Any) -> Any:
        return self.api.call("DELETE", self.api.path(self._CLUSTER + "/{name}", group=group, version=version,
                                                     plural=plural, name=name), body=body, **kw)

    def list_cluster_custom_object(self, group: str, version: str, plural: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path("/apis/{group}/{version}/{plural}", group=group, version=version,
                                                  plural=plural), **kw)

    def list_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, **kw: Any) -> Any:
        return self.api.call("GET", self.api.path(self._NS, group=group, version=version, namespace=namespace,
                                                  plural=plural), **kw)


class _LightVersion(_Light):
    def get_code(self, **kw: Any) -> Any:
        return self.api.call("GET", "/version/", **kw)


__all__ = ["ApiError", "LightApi", "OfficialApi", "error_reason", "open_api", "status_reason"]
