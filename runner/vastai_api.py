"""A small vast.ai REST client (httpx, async) that speaks the API the way the official CLI does
(vast-cli's vastai/api/*.py): Bearer auth, `/api/v0` paths, the CLI's JSON bodies.

It retries only what is safe to retry, turns every failure into a VastError that names the call
and never the API key, and tells "that offer is gone, pick another" (OfferUnavailable) apart from
failures that another offer would not fix."""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Literal

import attrs
import httpx
import trio

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
BACKOFF_FACTOR = 2.0  # the CLI uses 1.5 over 3 tries; vast's per-endpoint intervals want longer
LOG_POLL_INTERVAL_S = 0.5
LOG_POLL_ATTEMPTS = 20  # ~10 s, as the CLI (30 x 0.3 s) and the SDK (~9 s)


class VastError(Exception):
    """A vast.ai call failed. `status` is the HTTP status (None when no response came back),
    `error` vast's error code when it sent one (e.g. "invalid_args")."""

    def __init__(self, status: int | None, error: str | None, message: str):
        super().__init__(message)
        self.status, self.error, self.message = status, error, message


class OfferUnavailable(VastError):
    """The offer was taken (or withdrawn) between search and create: search again without it."""


# ---------------------------------------------------------------------------------- data

def _opt(d: Mapping[str, Any], key: str, kind: type) -> Any:
    value = d.get(key)
    return None if value is None else kind(value)


def _stripped(value: Any) -> str | None:
    # vast pads public_ipaddr with whitespace (dstack strips it too)
    return None if value is None else str(value).strip()


@attrs.frozen
class Offer:
    id: int
    machine_id: int | None
    host_id: int | None
    gpu_name: str | None
    num_gpus: int | None
    gpu_ram_mb: float | None
    dph_total: float | None
    reliability: float | None
    direct_port_count: int | None
    inet_down: float | None
    inet_up: float | None
    public_ipaddr: str | None
    geolocation: str | None
    cuda_max_good: float | None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Offer:
        """Lenient: unknown keys are ignored and missing ones are None; only `id` is required."""
        if d.get("id") is None:
            raise ValueError("an offer without an 'id'")
        reliability = d.get("reliability", d.get("reliability2"))
        return cls(
            id=int(d["id"]), machine_id=_opt(d, "machine_id", int), host_id=_opt(d, "host_id", int),
            gpu_name=_opt(d, "gpu_name", str), num_gpus=_opt(d, "num_gpus", int),
            gpu_ram_mb=_opt(d, "gpu_ram", float), dph_total=_opt(d, "dph_total", float),
            reliability=None if reliability is None else float(reliability),
            direct_port_count=_opt(d, "direct_port_count", int),
            inet_down=_opt(d, "inet_down", float), inet_up=_opt(d, "inet_up", float),
            public_ipaddr=_stripped(d.get("public_ipaddr")), geolocation=_opt(d, "geolocation", str),
            cuda_max_good=_opt(d, "cuda_max_good", float))


def _env_dict(raw: Any) -> dict[str, str]:
    # the API sends extra_env as a list of [key, value] pairs; the CLI turns it into a dict
    if raw is None:
        return {}
    pairs = raw.items() if isinstance(raw, Mapping) else raw
    return {str(k): str(v) for k, v in pairs}


@attrs.frozen
class Instance:
    id: int
    actual_status: str | None
    intended_status: str | None
    cur_state: str | None
    status_msg: str | None
    public_ipaddr: str | None
    ports: dict = attrs.field(factory=dict)
    label: str | None = None
    extra_env: dict = attrs.field(factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Instance:
        if d.get("id") is None:
            raise ValueError("an instance without an 'id'")
        return cls(
            id=int(d["id"]), actual_status=d.get("actual_status"),
            intended_status=d.get("intended_status"), cur_state=d.get("cur_state"),
            status_msg=d.get("status_msg"), public_ipaddr=_stripped(d.get("public_ipaddr")),
            ports=dict(d.get("ports") or {}),  # empty (or null) until the container runs
            label=d.get("label"), extra_env=_env_dict(d.get("extra_env")))


def mapped_port(instance: Instance, internal_port: int, proto: str = "tcp") -> int | None:
    """The public port docker mapped `internal_port` to, or None while there is no mapping yet.
    vast's `ports` is docker-style: {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "41001"}]}."""
    for binding in instance.ports.get(f"{internal_port}/{proto}") or ():
        host_port = binding.get("HostPort")
        if host_port not in (None, ""):
            try:
                return int(host_port)
            except ValueError:
                raise ValueError(f"instance {instance.id}: port {internal_port}/{proto} maps to "
                                 f"{host_port!r}, not a port number") from None
    return None


# ---------------------------------------------------------------------------------- pure decisions

def offer_query(*, min_gpu_ram_gb: float, min_reliability: float, max_dph: float | None,
                min_direct_ports: int, exclude_ids: Collection[int], limit: int,
                disk_gb: float = 5.0) -> dict:
    """The search body in raw API units. gpu_ram is MB per GPU, and "GB" means 1000 MB as in the
    CLI (offers_mult), so a card reporting 24564 MB passes a 24 GB minimum. `disk_gb` is the
    storage the price `dph_total` is quoted for (the CLI's allocated_storage, default 5)."""
    query: dict[str, Any] = {
        "verified": {"eq": True}, "external": {"eq": False},
        "rentable": {"eq": True}, "rented": {"eq": False},
        "num_gpus": {"eq": 1},
        "gpu_ram": {"gte": round(min_gpu_ram_gb * 1000)},
        "reliability": {"gte": min_reliability},
        "direct_port_count": {"gte": min_direct_ports},
    }
    if max_dph is not None:
        query["dph_total"] = {"lte": max_dph}
    if exclude_ids:  # an empty notin list is left out rather than trusted to mean "nothing"
        query["id"] = {"notin": sorted(int(i) for i in exclude_ids)}
    query.update({"order": [["dph_total", "asc"]], "type": "on-demand", "limit": int(limit),
                  "allocated_storage": float(disk_gb)})
    return query


def parse_error_body(text: str) -> tuple[str | None, str]:
    """(error code, message) from vast's `{"success":false,"error":..,"msg":..}`; some endpoints
    send only msg or message, and 429 is plain text."""
    try:
        body = json.loads(text)
    except ValueError:
        return None, text.strip()[:500]
    if not isinstance(body, dict):
        return None, text.strip()[:500]
    error = body.get("error")
    message = body.get("msg") or body.get("message") or body.get("error") or text.strip()[:500]
    return (None if error is None else str(error)), str(message)


FailureKind = Literal["offer_gone", "auth", "fatal"]
_OFFER_GONE_MARKS = ("no_such_ask", "not available")


def classify_failure(status: int, error: str | None, text: str) -> FailureKind:
    """What a non-retryable failed response means.
    - "auth": vast answers a bad key with 404 + auth_error (not 401); 401 is taken the same way.
    - "offer_gone": no_such_ask / "... is not available": someone else rented the offer between
      our search and our create, so another offer may well work. Only below 500: a 503 page that
      says "service not available" is the service, not the offer.
    - "fatal": everything else, including insufficient_credit: an empty account fails every
      offer alike, so searching again would only burn time and rate limit before the same error."""
    lowered = f"{error or ''} {text}".lower()
    if status == 401 or error == "auth_error":
        return "auth"
    if status < 500 and any(mark in lowered for mark in _OFFER_GONE_MARKS):
        return "offer_gone"
    return "fatal"


def should_retry_status(status: int, *, replayable: bool) -> bool:
    """429 is a rejection before any work, so always safe to resend. A 502/503/504 from a gateway
    may come after the API acted, so it is retried only for calls that are safe to repeat."""
    return status == 429 or (replayable and status in RETRYABLE_STATUSES)


def should_retry_exception(exc: httpx.TransportError, *, replayable: bool) -> bool:
    """A failure to connect never reached the API; a timeout or dropped connection after sending
    might have (a create that timed out may have rented an instance), so only replayable calls
    retry those."""
    never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
    if never_sent:
        return True
    return replayable and isinstance(exc, (httpx.TimeoutException, httpx.NetworkError,
                                           httpx.RemoteProtocolError))


def create_body(*, image: str, env: Mapping[str, str], ports: Collection[int], disk_gb: float,
                label: str, onstart: str | None, args: list[str] | None, runtype: str) -> dict:
    """The body `vastai create instance` sends (vast.py create__instance). env is a JSON object in
    which `-p 8000:8000` becomes the key "-p 8000:8000" with value "1" (vast.py parse_env)."""
    full_env = {str(k): str(v) for k, v in env.items()}
    full_env.update({f"-p {p}:{p}": "1" for p in ports})
    body: dict[str, Any] = {
        "client_id": "me", "image": image, "env": full_env,
        "price": None,  # non-null would make it an interruptible bid
        "disk": disk_gb, "label": label, "extra": None, "onstart": onstart, "image_login": None,
        "python_utf8": False, "lang_utf8": False, "use_jupyter_lab": False, "jupyter_dir": None,
        "force": False,
        "cancel_unavail": True,  # fail instead of creating a stopped instance that bills for disk
        "template_hash_id": None, "user": None, "runtype": runtype,
    }
    if args is not None:
        body["args"] = list(args)
    return body


# ---------------------------------------------------------------------------------- client

class VastClient:
    """`async with VastClient(key, base_url=...) as vast:`. `base_url` is the CLI's --url/VAST_URL;
    the key travels only in the Authorization header."""

    def __init__(self, api_key: str, *, base_url: str = "https://console.vast.ai",
                 transport: httpx.AsyncBaseTransport | None = None, max_retries: int = 5,
                 first_backoff_s: float = 0.15,
                 sleep: Callable[[float], Awaitable[None]] = trio.sleep, timeout_s: float = 60.0):
        if not api_key:
            raise VastError(None, "auth_error", "no vast.ai API key given")
        self._auth = {"Authorization": f"Bearer {api_key}"}
        self._key = api_key
        self._max_retries, self._first_backoff_s, self._sleep = max_retries, first_backoff_s, sleep
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), transport=transport,
                                       timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 15.0)))

    def __repr__(self) -> str:
        return f"VastClient(base_url={str(self._http.base_url)!r})"

    async def __aenter__(self) -> VastClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._http.aclose()

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "<api key>")  # in case a server echoes it back

    def _failure(self, call: str, response: httpx.Response, note: str = "") -> VastError:
        error, message = parse_error_body(response.text)
        kind = classify_failure(response.status_code, error, response.text)
        if kind == "auth":
            message = "vast.ai refused the API key (check --api-key / VAST_API_KEY)"
        text = self._redact(f"{call}: HTTP {response.status_code}"
                            f"{f' {error}' if error else ''}: {message}{note}")
        cls = OfferUnavailable if kind == "offer_gone" else VastError
        return cls(response.status_code, error or ("auth_error" if kind == "auth" else None), text)

    async def _send(self, method: str, path: str, *, json_body: Any = None,
                    params: Mapping[str, str] | None = None, replayable: bool = True,
                    ok_statuses: Collection[int] = ()) -> httpx.Response:
        """One API call with retries; returns a 2xx (or ok_statuses) response, else raises."""
        call, delay = f"{method} {path}", self._first_backoff_s
        for attempt in range(self._max_retries + 1):
            last = attempt == self._max_retries
            try:
                response = await self._http.request(method, path, json=json_body, params=params,
                                                    headers=self._auth)
            except httpx.TransportError as exc:
                if last or not should_retry_exception(exc, replayable=replayable):
                    raise VastError(None, type(exc).__name__, self._redact(
                        f"{call}: {type(exc).__name__}: {exc}"
                        f"{f' (after {attempt} retries)' if attempt else ''}")) from exc
            else:
                status = response.status_code
                if response.is_success or status in ok_statuses:
                    return response
                if last or not should_retry_status(status, replayable=replayable):
                    note = f" (after {attempt} retries)" if attempt else ""
                    if status in RETRYABLE_STATUSES and not replayable:
                        note += " (not retried: the request may have taken effect)"
                    raise self._failure(call, response, note)
            await self._sleep(delay)
            delay *= BACKOFF_FACTOR
        raise AssertionError("unreachable")  # the last attempt always returns or raises

    def _json(self, call: str, response: httpx.Response) -> dict:
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise VastError(response.status_code, "bad_response",
                            self._redact(f"{call}: expected a JSON object, got {response.text[:200]!r}"))
        return body

    async def search_offers(self, query: dict) -> list[Offer]:
        path = "/api/v0/bundles/"
        body = self._json(f"POST {path}", await self._send("POST", path, json_body=query))
        try:
            return [Offer.from_json(o) for o in body.get("offers") or []]
        except (ValueError, TypeError, AttributeError) as e:
            raise VastError(200, "bad_response", f"POST {path}: malformed offer: {e}") from e

    async def create_instance(self, offer_id: int, *, image: str, env: Mapping[str, str],
                              disk_gb: float, label: str, onstart: str | None = None,
                              args: list[str] | None = None, runtype: str = "args",
                              ports: Collection[int] = ()) -> int:
        """Rent `offer_id`; returns the new instance (contract) id. Raises OfferUnavailable when
        the offer is gone. Not replayed on ambiguous failures: a second PUT could rent twice."""
        path = f"/api/v0/asks/{int(offer_id)}/"
        body = create_body(image=image, env=env, ports=ports, disk_gb=disk_gb, label=label,
                           onstart=onstart, args=args, runtype=runtype)
        response = await self._send("PUT", path, json_body=body, replayable=False)
        reply = self._json(f"PUT {path}", response)
        if reply.get("success") is False:
            raise self._failure(f"PUT {path}", response)
        if reply.get("new_contract") is None:
            raise VastError(response.status_code, "bad_response",
                            f"PUT {path}: no new_contract in the reply; an instance labelled "
                            f"{label!r} may exist")
        return int(reply["new_contract"])

    async def show_instance(self, instance_id: int) -> Instance | None:
        """The instance, or None once vast no longer knows it ({"instances": null})."""
        path = f"/api/v0/instances/{int(instance_id)}/"
        row = self._json(f"GET {path}", await self._send("GET", path, params={"owner": "me"}))
        if row.get("instances") is None:
            return None
        return self._instance(f"GET {path}", row["instances"])

    def _instance(self, call: str, row: Any) -> Instance:
        try:
            return Instance.from_json(row)
        except (ValueError, TypeError, AttributeError) as e:
            raise VastError(200, "bad_response", f"{call}: malformed instance: {e}") from e

    async def destroy_instance(self, instance_id: int) -> None:
        """Destroy; an instance that is already gone is fine. The 404 counts as "gone" only when it
        is a JSON answer from the API and not auth_error: a wrong base URL's 404 page must not
        pass for a destroyed instance that in fact keeps billing."""
        path = f"/api/v0/instances/{int(instance_id)}/"
        response = await self._send("DELETE", path, json_body={}, ok_statuses={404})
        if response.status_code == 404:
            try:
                body = response.json()
            except ValueError:
                body = None
            if not isinstance(body, dict) or body.get("error") == "auth_error":
                raise self._failure(f"DELETE {path}", response)

    async def instance_logs(self, instance_id: int, tail: int = 1000) -> str:
        """The container's last `tail` log lines. vast writes them to a result_url (no auth,
        possibly another host), which answers 200 once ready; polled for ~10 s."""
        path = f"/api/v0/instances/request_logs/{int(instance_id)}/"
        reply = self._json(f"PUT {path}", await self._send("PUT", path,
                                                          json_body={"tail": str(tail)}))
        url = reply.get("result_url")
        if not url:
            raise VastError(200, "bad_response", f"PUT {path}: no result_url in the reply")
        return await self._poll_result(instance_id, str(url))

    async def _poll_result(self, instance_id: int, url: str) -> str:
        last = "no answer"
        for attempt in range(LOG_POLL_ATTEMPTS):
            if attempt:
                await self._sleep(LOG_POLL_INTERVAL_S)
            try:
                response = await self._http.get(url)  # absolute URL, and no Authorization header
            except httpx.TransportError as exc:
                if not should_retry_exception(exc, replayable=True):
                    raise VastError(None, type(exc).__name__,
                                    f"logs of instance {instance_id}: {type(exc).__name__}") from exc
                last = type(exc).__name__
                continue
            if response.status_code == 200:
                return response.text
            last = f"HTTP {response.status_code}"
        # the result URL may be signed, so it stays out of the message
        raise VastError(None, "logs_timeout", f"logs of instance {instance_id} were not ready after "
                        f"{LOG_POLL_ATTEMPTS * LOG_POLL_INTERVAL_S:.0f} s (last: {last})")
