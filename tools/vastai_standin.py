"""A local stand-in for the vast.ai REST API as its official CLI uses it (shared/notes/vastai-and-swim.md
Part A): offers from a fixed catalogue, instances whose "container" is a real ppnode.py process behind TCP
port forwarders, logs, and injectable faults. State lives in memory and every process lives in the
stand-in's nursery, so nothing it started outlives it.

    python -m tools.vastai_standin --port 7800 [--vanish-first-creates K] [--rate-limit-every N]
        [--rate-limit-burst B] [--stuck-loading I ...] [--die-after I:SECONDS ...] [--no-spawn]

Once listening it prints `VASTAI_STANDIN_URL=<base url>`; point `vastai --url` (or VAST_URL) at it.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import secrets
import signal
import sys
import time
from collections.abc import Mapping

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from tools.standin_instances import (REPO, Instance, container_env, mark_running_without_process, run_container,
                                     split_env)
from tools.standin_offers import LOOPBACK, QueryError, catalogue, matches, ordered, search_offers

__all__ = ["StandinConfig", "run_standin", "catalogue", "matches", "ordered", "search_offers", "split_env",
           "container_env", "parse_args", "main", "make_app", "Standin", "Instance", "ApiError", "QueryError"]

log = logging.getLogger("pp.vastai_standin")
FIRST_CONTRACT = 7835610
PUBLIC_PATHS = frozenset({"/api/v0/gpu_names/unique/"})  # the CLI fetches it at import, without a key


@attrs.frozen(kw_only=True)
class StandinConfig:
    host: str = LOOPBACK
    port: int = 0                       # 0 = any free port
    step_s: float = 0.2                 # each step of created -> loading -> running takes this long
    spawn: bool = True                  # False: "running" at once, no process (API-shape tests)
    node_command: tuple[str, ...] = (sys.executable, str(REPO / "ppnode.py"))  # the "image's" command
    grace_s: float = 3.0                # SIGTERM, then SIGKILL after this long
    logs_lag: bool = True               # each result_url answers 404 once first, as the real one lags
    vanish_first_creates: int = 0       # the first K creates find their offer taken (no_such_ask)
    rate_limit_every: int = 0           # every Nth API request gets 429; 0 = off
    rate_limit_burst: int = 0           # the first B API requests get 429
    stuck_loading: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)  # 1-based
    die_after_s: dict[int, float] = attrs.field(factory=dict, converter=dict)  # ordinal -> s after running


class ApiError(Exception):
    def __init__(self, status: int, error: str, msg: str):
        super().__init__(msg)
        self.status, self.error, self.msg = status, error, msg


# ---- the account ----

@attrs.define
class _LogRequest:
    instance: Instance
    tail: int
    filter: str | None
    lagged: bool = False


class Standin:
    """The in-memory account: offers, instances and faults. Instances run in `nursery`."""

    def __init__(self, config: StandinConfig, nursery: trio.Nursery):
        self.config, self.nursery = config, nursery
        self.offers = {offer["id"]: offer for offer in catalogue()}
        self.instances: dict[int, Instance] = {}
        self.log_requests: dict[str, _LogRequest] = {}
        self.api_requests = self.create_attempts = self.created = 0
        self.base_url = ""

    def rate_limited(self) -> bool:
        self.api_requests += 1
        n, c = self.api_requests, self.config
        return n <= c.rate_limit_burst or (c.rate_limit_every > 0 and n % c.rate_limit_every == 0)

    def create(self, offer_id: int, body: object) -> Instance:
        if not isinstance(body, dict) or not isinstance(body.get("image"), str) or not body["image"]:
            raise ApiError(400, "invalid_args", "image is required")
        if not isinstance(body.get("env") or {}, dict):
            raise ApiError(400, "invalid_args", 'env must be an object such as {"K": "V", "-p 8000:8000": "1"}')
        self.create_attempts += 1
        offer = self.offers.get(offer_id)
        if offer is not None and self.create_attempts <= self.config.vanish_first_creates:
            offer.update(rented=True, rentable=False)  # someone else rented it between search and create
        if offer is None or offer["rented"]:
            raise ApiError(404, "no_such_ask", f"Instance type by id {offer_id} is not available.")
        offer.update(rented=True, rentable=False)
        self.created += 1
        inst = Instance(FIRST_CONTRACT + self.created, self.created, offer, body, time.time())
        self.instances[inst.id] = inst
        self.nursery.start_soon(self._lifecycle, inst)
        log.info("instance %d created from offer %d (#%d)", inst.id, offer_id, inst.ordinal)
        return inst

    async def destroy(self, instance_id: int) -> None:
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} does not exist.")
        inst.scope.cancel()
        with trio.move_on_after(self.config.grace_s + 2):
            await inst.done.wait()
        log.info("instance %d destroyed", instance_id)

    async def _lifecycle(self, inst: Instance) -> None:
        try:
            with inst.scope:
                await trio.sleep(self.config.step_s)
                inst.actual_status, inst.status_msg = "loading", f"Pulling image {inst.body['image']}"
                if inst.ordinal in self.config.stuck_loading:
                    await trio.sleep_forever()
                await trio.sleep(self.config.step_s)
                if self.config.spawn:
                    await run_container(inst, self.config.node_command, grace_s=self.config.grace_s,
                                        die_after_s=self.config.die_after_s.get(inst.ordinal))
                else:
                    mark_running_without_process(inst)
        finally:
            inst.done.set()

    def request_logs(self, instance_id: int, body: dict) -> str:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise ApiError(404, "no_such_instance", f"Instance {instance_id} does not exist.")
        raw_tail, raw_filter = body.get("tail") or 1000, body.get("filter")
        try:
            tail = int(raw_tail)
        except (ValueError, TypeError):
            raise ApiError(400, "invalid_args", f"tail={raw_tail!r} is not a whole number") from None
        token = secrets.token_hex(8)
        self.log_requests[token] = _LogRequest(inst, tail, None if raw_filter is None else str(raw_filter))
        return f"{self.base_url}/standin-logs/{token}.log"

    def log_text(self, token: str) -> str | None:
        """The log tail behind a result_url, or None while it is "not ready yet" (404)."""
        req = self.log_requests.get(token)
        if req is None or (self.config.logs_lag and not req.lagged):
            if req is not None:
                req.lagged = True
            return None
        lines = bytes(req.instance.log).decode(errors="replace").splitlines()
        lines = [line for line in lines if not req.filter or req.filter in line]
        return "".join(line + "\n" for line in lines[max(len(lines) - req.tail, 0):])

    def list_page(self, args: Mapping[str, str]) -> dict:
        filters = _json_arg(args, "select_filters", {})
        order = _json_arg(args, "order_by", [{"col": "id", "dir": "asc"}])
        cols = _json_arg(args, "select_cols", None)
        try:
            limit, start = int(args.get("limit", 25)), int(args.get("after_token") or 0)
            rows = [inst.to_json() for inst in self.instances.values()]
            rows = ordered([r for r in rows if matches(r, filters)], [[o["col"], o.get("dir", "asc")] for o in order])
        except (ValueError, TypeError, KeyError) as exc:
            raise ApiError(400, "invalid_args", f"bad list parameters: {exc}") from None
        page = rows[start:start + limit]
        if cols and cols != ["*"]:
            page = [{c: row.get(c) for c in cols} for row in page]
        return {"success": True, "instances": page, "total_instances": len(rows),
                "next_token": str(start + limit) if start + limit < len(rows) else None,
                "label_counts": dict(collections.Counter(row.get("label") or "" for row in rows))}


def _json_arg(args: Mapping[str, str], name: str, default):
    try:
        return json.loads(args[name]) if args.get(name) else default
    except ValueError:
        raise ApiError(400, "invalid_args", f"{name} is not JSON: {args[name]!r}") from None


# ---- HTTP ----

def _error(status: int, error: str, msg: str):
    return jsonify({"success": False, "error": error, "msg": msg}), status


async def _json_body() -> dict:
    data = await request.get_data()
    try:
        body = json.loads(data) if data.strip() else {}
    except ValueError:
        raise ApiError(400, "invalid_args", "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_args", "the request body must be a JSON object")
    return body


def _has_key() -> bool:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    return (scheme == "Bearer" and bool(key.strip())) or bool(request.args.get("api_key", "").strip())


def make_app(standin: Standin) -> QuartTrio:
    app = QuartTrio("vastai_standin")

    @app.before_request
    async def gate():
        if not request.path.startswith("/api/") or request.path in PUBLIC_PATHS:
            return None
        if standin.rate_limited():  # the real text; no Retry-After, no JSON
            return Response("API requests too frequent", 429, content_type="text/plain")
        return None if _has_key() else _error(404, "auth_error", "Invalid user key")

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError):
        return _error(exc.status, exc.error, exc.msg)

    def offers(query) -> Response:
        try:
            return jsonify({"offers": search_offers(list(standin.offers.values()), query)})
        except QueryError as exc:
            raise ApiError(400, "invalid_args", str(exc)) from None

    @app.post("/api/v0/bundles/")
    async def bundles_post():
        return offers(await _json_body())

    @app.get("/api/v0/bundles/")
    async def bundles_get():
        return offers(_json_arg(request.args, "q", {}))

    @app.put("/api/v0/search/asks/")
    async def search_asks():
        return offers((await _json_body()).get("q", {}))

    @app.put("/api/v0/asks/<int:offer_id>/")
    async def create(offer_id: int):
        inst = standin.create(offer_id, await _json_body())
        return jsonify({"success": True, "new_contract": inst.id, "ask_id": offer_id})

    @app.get("/api/v0/instances/<int:instance_id>/")
    async def show(instance_id: int):
        inst = standin.instances.get(instance_id)
        return jsonify({"instances": inst.to_json() if inst else None})

    @app.delete("/api/v0/instances/<int:instance_id>/")
    async def destroy(instance_id: int):
        await standin.destroy(instance_id)
        return jsonify({"success": True, "msg": f"destroying instance {instance_id}."})

    @app.get("/api/v1/instances/")
    async def list_v1():
        return jsonify(standin.list_page(request.args))

    @app.get("/api/v0/instances/filters/")
    async def filters():
        keys = ("actual_status", "verification", "gpu_name")
        return jsonify({"filters": [{k: i.to_json()[k] for k in keys} for i in standin.instances.values()]})

    @app.put("/api/v0/instances/request_logs/<int:instance_id>/")
    async def request_logs(instance_id: int):
        url = standin.request_logs(instance_id, await _json_body())
        return jsonify({"success": True, "result_url": url, "msg": "Logs request queued."})

    @app.get("/standin-logs/<token>.log")
    async def result(token: str):  # like the real bucket URL: no key needed
        text = standin.log_text(token)
        return Response("not ready" if text is None else text, 404 if text is None else 200,
                        content_type="text/plain")

    @app.get("/api/v0/users/current")
    @app.get("/api/v0/users/current/")
    async def current_user():
        return jsonify({"id": 1, "username": "standin", "email": "standin@localhost", "credit": 100.0,
                        "balance": 0.0, "host_agreement_accepted": False})

    @app.get("/api/v0/gpu_names/unique/")
    async def gpu_names():
        return jsonify({"gpu_names": sorted({o["gpu_name"] for o in standin.offers.values()})})

    @app.get("/standin/state")
    async def state():  # not vast.ai's: what tests need to see behind the API
        return jsonify({"api_requests": standin.api_requests, "instances": {
            str(i.id): {"ordinal": i.ordinal, "pid": i.pid, "node_port": i.node_port,
                        "actual_status": i.actual_status} for i in standin.instances.values()}})

    return app


async def run_standin(config: StandinConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the base URL once listening. Cancelling stops every instance."""
    async with trio.open_nursery() as nursery:
        standin = Standin(config, nursery)
        http = HypercornConfig()
        http.bind = [f"{config.host}:{config.port}"]
        http.accesslog, http.errorlog, http.graceful_timeout = None, log, 0.5
        binds = await nursery.start(functools.partial(serve, make_app(standin), http))
        standin.base_url = f"http://{config.host}:{binds[0].rsplit(':', 1)[1]}"
        task_status.started(standin.base_url)


# ---- command line ----

def _die_spec(text: str) -> tuple[int, float]:
    ordinal, _, seconds = text.partition(":")
    try:
        return int(ordinal), float(seconds)
    except ValueError:  # also when the ':' is missing: float('')
        raise argparse.ArgumentTypeError(f"{text!r}: give I:SECONDS, e.g. 2:5.0") from None


def parse_args(argv: list[str]) -> StandinConfig:
    p = argparse.ArgumentParser(prog="python -m tools.vastai_standin", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, default=7800, help="0 = any free port (default 7800)")
    p.add_argument("--step-s", type=float, default=0.2, help="seconds per status step (default 0.2)")
    p.add_argument("--no-spawn", action="store_true", help="mark instances running without a process")
    p.add_argument("--no-logs-lag", action="store_true", help="serve each result_url at once")
    p.add_argument("--vanish-first-creates", type=int, default=0, metavar="K")
    p.add_argument("--rate-limit-every", type=int, default=0, metavar="N", help="every Nth API request: 429")
    p.add_argument("--rate-limit-burst", type=int, default=0, metavar="B", help="the first B API requests: 429")
    p.add_argument("--stuck-loading", type=int, action="append", default=[], metavar="I",
                   help="the I-th instance created (1-based) never leaves loading; repeatable")
    p.add_argument("--die-after", type=_die_spec, action="append", default=[], metavar="I:SECONDS",
                   help="kill the I-th instance's process SECONDS after it starts running; repeatable")
    a = p.parse_args(argv)
    return StandinConfig(host=a.host, port=a.port, step_s=a.step_s, spawn=not a.no_spawn,
                         logs_lag=not a.no_logs_lag, vanish_first_creates=a.vanish_first_creates,
                         rate_limit_every=a.rate_limit_every, rate_limit_burst=a.rate_limit_burst,
                         stuck_loading=a.stuck_loading, die_after_s=dict(a.die_after))


async def _serve_until_signalled(config: StandinConfig) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            url = await nursery.start(functools.partial(run_standin, config))
            print(f"VASTAI_STANDIN_URL={url}", flush=True)
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    trio.run(_serve_until_signalled, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
