"""`ppsmoke.py --vastai`: rent N GPU instances (docs/design.md, Boot order and Failures), converge, ask, destroy.
With --serve, an instance that is lost once the cluster serves is destroyed and replaced by a new one for
the same stage (runner/keeper.py), rented the same way and under the same teardown guarantee.

The runner is assumed to sit behind NAT: it opens every connection itself. It introduces the nodes to
each other by gossip push/pull and long-polls for the answer. Every instance created is destroyed on
every path — errors, timeouts, Ctrl-C, a bug in the runner — in cleanup shielded from cancellation,
and each live id is on disk (the ledger) from the moment it exists, for `--destroy-leftovers`.
"""
from __future__ import annotations

import functools
import secrets
import time
from pathlib import Path
from typing import Callable

import attrs
import trio

from node.config.network import SCHEME

from .orchestrator import Orchestrator, run_orchestrator
from worker.contract import Sampling

from .ledger import Ledger
from .common import RunFailed, RunResult, fail_on_signals, first_failure, show_weight_progress
from .keeper import keep_stages
from .session import Use, announce_entry, answer_once, serve
from .vastai_api import Instance, Offer, OfferUnavailable, VastClient, VastError, mapped_port, offer_query

NODE_PORT = 8000
CREATE_ATTEMPTS_PER_STAGE = 4
POLL_STATUS_S = 5.0  # vast.ai has no push notifications: instance status is polled


@attrs.frozen
class VastOptions:
    num_stages: int
    model: str
    prompt: str
    max_tokens: int
    sampling: Sampling
    timeout_s: float
    converge_timeout_s: float
    vast_api_key: str = attrs.field(repr=False)  # the runner's own, for vast.ai's API: never given to a node
    base_url: str
    image: str
    ledger_path: Path
    disk_gb: float = 20.0
    min_gpu_ram_gb: float = 8.0
    min_reliability: float = 0.98
    max_dph: float | None = None
    min_direct_ports: int = 2
    running_timeout_s: float = 600.0
    poll_status_s: float = POLL_STATUS_S
    node_settings: dict[str, str] = attrs.field(factory=dict)  # extra environment for every node
    serve: bool = False  # keep the cluster up for the OpenAI API until stopped, instead of one prompt
    token: str | None = attrs.field(default=None, repr=False)  # the cluster token, the nodes' own; None: random
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)  # the clients' keys; none: one random, printed


async def run_vastai(opts: VastOptions, progress: Callable[[str], None], *, transport=None,
                     on_text: Callable[[str], None] = lambda text: None, announce: Callable[[str], None] = print
                     ) -> RunResult:
    """As run_seed, on rented instances; `transport` replaces httpx's network transport (tests)."""
    given = bool(opts.api_keys)
    opts = attrs.evolve(opts, api_keys=opts.api_keys or (secrets.token_urlsafe(24),))  # the clients' key(s)
    ledger = Ledger(opts.ledger_path)
    created: list[int] = []
    async with VastClient(opts.vast_api_key, base_url=opts.base_url, transport=transport) as vast:
        try:
            use = Use(opts.prompt, opts.max_tokens, opts.sampling, opts.timeout_s, opts.model,
                      api_key=opts.api_keys[0], key_given=given, serve=opts.serve, on_text=on_text, announce=announce)
            return await _run_guarded(vast, opts, use, ledger, created, progress)
        except BaseException:
            with trio.CancelScope(shield=True):
                await _show_logs(vast, created, progress)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await destroy_all(vast, created, ledger, progress)


async def _run_guarded(vast, opts, use, ledger, created, progress) -> RunResult:
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(fail_on_signals, serving=opts.serve))
            result = await _run(nursery, vast, opts, use, ledger, created, progress)
            nursery.cancel_scope.cancel()
        return result
    except BaseExceptionGroup as group:
        raise first_failure(group, VastError) from None


async def _run(nursery, vast: VastClient, opts: VastOptions, use: Use, ledger: Ledger, created: list[int], progress):
    started = time.monotonic()
    token = opts.token or secrets.token_urlsafe(24)
    await _create_all(vast, opts, token, ledger, created, progress)
    urls = [await _wait_running(vast, opts, stage, contract, progress) for stage, contract in enumerate(created)]
    orch: Orchestrator = await nursery.start(functools.partial(run_orchestrator, token, reach=None))
    booting = trio.CancelScope()  # an instance lost while booting fails the run; serving, it is replaced
    nursery.start_soon(_scoped, booting, functools.partial(_watch_instances, vast, opts, list(created)))
    converged = await _converge(orch, opts, urls, started, progress)
    if opts.serve:
        booting.cancel()
        renter = Renter(vast, opts, token, ledger, created, orch, progress)
        holders = {stage: InstanceHolder(vast, contract, url, opts.poll_status_s)
                   for stage, (contract, url) in enumerate(zip(created, urls))}
        await serve(orch, use, keep=functools.partial(
            keep_stages, orch.swim, holders, renter.replace, ready_timeout_s=opts.converge_timeout_s,
            progress=progress, on_replaced=functools.partial(announce_entry, use), retire=renter.retire))
    return await answer_once(orch, use, converged=converged, started=started, num_stages=opts.num_stages,
                             run_dir=opts.ledger_path.parent)


async def _scoped(scope: trio.CancelScope, fn) -> None:
    with scope:
        await fn()


# -- renting -----------------------------------------------------------------------------------------

async def _create_all(vast, opts, token, ledger, created, progress) -> None:
    offers = await _choose_offers(vast, opts, exclude=set())
    total = sum(o.dph_total or 0.0 for o in offers)
    progress(f"renting {opts.num_stages} instances at ${total:.3f}/hour in total: "
             + ", ".join(f"{o.gpu_name} ${o.dph_total:.3f}/h (offer {o.id})" for o in offers))
    tried = {o.id for o in offers}
    for stage in range(opts.num_stages):
        offer = offers[stage]
        for _ in range(CREATE_ATTEMPTS_PER_STAGE):
            try:
                contract = await vast.create_instance(offer.id, image=opts.image, env=node_env(opts, stage, token),
                                                      disk_gb=opts.disk_gb, label=f"pp-stage-{stage}",
                                                      ports=(NODE_PORT,))
                break
            except OfferUnavailable:
                progress(f"offer {offer.id} was taken meanwhile; searching again")
                [offer] = await _choose_offers(vast, opts, exclude=tried, count=1)
                tried.add(offer.id)
        else:
            raise RunFailed(f"stage {stage}: {CREATE_ATTEMPTS_PER_STAGE} offers in a row were gone before renting")
        created.append(contract)
        ledger.add(contract)  # on disk before anything else can fail
        progress(f"stage {stage}: instance {contract} created")


async def _choose_offers(vast, opts, *, exclude: set[int], count: int | None = None) -> list[Offer]:
    count = count or opts.num_stages
    query = offer_query(min_gpu_ram_gb=opts.min_gpu_ram_gb, min_reliability=opts.min_reliability,
                        max_dph=opts.max_dph, min_direct_ports=opts.min_direct_ports, exclude_ids=exclude,
                        limit=64, disk_gb=opts.disk_gb)
    offers = pick_offers(await vast.search_offers(query), count)
    if len(offers) < count:
        raise RunFailed(f"only {len(offers)} suitable offers on distinct machines, need {count} "
                        "(loosen --min-gpu-ram, --min-reliability or --max-dph)")
    return offers


def pick_offers(offers: list[Offer], count: int) -> list[Offer]:
    """The cheapest offers, one per machine: two stages on one host would share its GPU and network."""
    chosen, machines = [], set()
    for offer in sorted(offers, key=lambda o: (o.dph_total is None, o.dph_total or 0.0, o.id)):
        if offer.machine_id is not None and offer.machine_id in machines:
            continue
        chosen.append(offer)
        machines.add(offer.machine_id)
        if len(chosen) == count:
            break
    return chosen


def node_env(opts: VastOptions, stage: int, token: str) -> dict[str, str]:
    """The instance's environment (vast.ai passes it to the container, not on a command line): its stage, the
    cluster token and the clients' keys, which every node needs for /metrics."""
    return {**opts.node_settings, "STAGE": str(stage), "NUM_STAGES": str(opts.num_stages), "MODEL": opts.model,
            "PP_CLUSTER_TOKEN": token, "PP_API_KEY": ",".join(opts.api_keys), "PP_PORT": str(NODE_PORT)}


async def _wait_running(vast, opts, stage: int, contract: int, progress) -> str:
    """Poll until the instance runs with its port mapped; returns the node's public URL."""
    with trio.move_on_after(opts.running_timeout_s):
        while True:
            inst = await vast.show_instance(contract)
            if inst is None:
                raise RunFailed(f"stage {stage}: instance {contract} disappeared")
            failure = instance_failure(inst)
            if failure:
                raise RunFailed(f"stage {stage}: instance {contract} {failure}")
            port = mapped_port(inst, NODE_PORT)
            if inst.actual_status == "running" and inst.public_ipaddr and port:
                url = f"{SCHEME}://{inst.public_ipaddr}:{port}"
                progress(f"stage {stage}: instance {contract} running at {url}")
                return url
            await trio.sleep(opts.poll_status_s)
    raise RunFailed(f"stage {stage}: instance {contract} not running after {opts.running_timeout_s:.0f} s "
                    f"(last status: {inst.actual_status}, {inst.status_msg!r})")


async def _watch_instances(vast, opts, created: list[int]) -> None:
    """Fail the run as soon as vast.ai reports an instance gone: a node that dies before it ever joined
    gossip would otherwise be noticed only at the convergence timeout."""
    while True:
        await trio.sleep(opts.poll_status_s)
        for stage, contract in enumerate(created):
            inst = await vast.show_instance(contract)
            failure = "disappeared" if inst is None else instance_failure(inst)
            if failure:
                raise RunFailed(f"stage {stage}: instance {contract} {failure}")


def instance_failure(inst: Instance) -> str | None:
    """Why an instance will never run, as the CLI and dstack judge it; None while it still may."""
    if inst.actual_status in ("exited", "offline"):
        return f"is {inst.actual_status} ({inst.status_msg or 'no message'})"
    if inst.status_msg and "error" in inst.status_msg.lower():
        return f"failed to start: {inst.status_msg}"
    return None


# -- replacing (--serve) ------------------------------------------------------------------------------

@attrs.frozen
class InstanceHolder:
    """A stage's rented instance, as runner/keeper.py sees it."""

    vast: VastClient
    contract: int
    url: str
    poll_s: float

    async def ended(self) -> str:
        while True:
            inst = await self.vast.show_instance(self.contract)
            failure = "disappeared" if inst is None else instance_failure(inst)
            if failure:
                return f"(instance {self.contract}) {failure}"
            await trio.sleep(self.poll_s)


@attrs.define
class Renter:
    """Rents a stage's replacement through the same path as the first instances — created, recorded in the
    ledger, waited for, introduced — and destroys the instances that are gone (they bill while they sit)."""

    vast: VastClient
    opts: VastOptions
    token: str = attrs.field(repr=False)
    ledger: Ledger
    created: list[int]
    orch: Orchestrator
    progress: Callable[[str], None]
    tried: set[int] = attrs.Factory(set)

    async def replace(self, stage: int, attempt: int) -> InstanceHolder:
        contract = None
        try:
            [offer] = await _choose_offers(self.vast, self.opts, exclude=self.tried, count=1)
            self.tried.add(offer.id)
            contract = await self.vast.create_instance(
                offer.id, image=self.opts.image, env=node_env(self.opts, stage, self.token),
                disk_gb=self.opts.disk_gb, label=f"pp-stage-{stage}", ports=(NODE_PORT,))
            self.created.append(contract)
            self.ledger.add(contract)  # on disk before anything else can fail
            self.progress(f"stage {stage}: replacement instance {contract} created ({offer.gpu_name} "
                          f"${offer.dph_total:.3f}/h)")
            url = await _wait_running(self.vast, self.opts, stage, contract, self.progress)
            with trio.fail_after(self.opts.converge_timeout_s):
                await self.orch.introduce(url)
            return InstanceHolder(self.vast, contract, url, self.opts.poll_status_s)
        except (VastError, RunFailed, trio.TooSlowError) as exc:
            if contract is not None:
                await self._destroy(contract)
            raise RunFailed(f"renting a replacement: {type(exc).__name__}: {exc}") from None

    async def retire(self, holder: InstanceHolder) -> None:
        await self._destroy(holder.contract)

    async def _destroy(self, contract: int) -> None:
        with trio.CancelScope(shield=True):
            try:
                await self.vast.destroy_instance(contract)
            except VastError as exc:  # stays in `created`: the run's teardown tries again
                self.progress(f"could not destroy instance {contract} yet: {exc}")
                return
        self.created.remove(contract)
        self.ledger.remove(contract)
        self.progress(f"instance {contract} destroyed")


# -- converging ---------------------------------------------------------------------------------------

async def _converge(orch: Orchestrator, opts, urls: list[str], started: float, progress) -> float:
    progress(f"introducing {len(urls)} nodes and waiting for them to load ...")
    with trio.move_on_after(opts.converge_timeout_s) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(show_weight_progress, orch.swim, progress)
            for url in urls:
                await orch.introduce(url)
            await orch.converge(opts.num_stages)
            nursery.cancel_scope.cancel()
    if scope.cancelled_caught:
        alive = sorted(m.meta.stage for m in orch.swim.alive() if m.meta.stage is not None)
        raise RunFailed(f"the cluster did not converge within {opts.converge_timeout_s:.0f} s "
                        f"(alive stages: {alive})")
    now = time.monotonic()
    progress(f"converged in {now - started:.1f} s; pp-entry is ready")
    return now


# -- teardown -----------------------------------------------------------------------------------------

async def destroy_all(vast: VastClient, instances: list[int], ledger: Ledger, progress) -> None:
    """Destroy every instance; those that could not be are left in the ledger and named."""
    failed = []
    for contract in instances:
        try:
            await vast.destroy_instance(contract)
            ledger.remove(contract)
        except VastError as exc:
            failed.append(contract)
            progress(f"could not destroy instance {contract}: {exc}")
    if instances:
        progress(f"destroyed {len(instances) - len(failed)} of {len(instances)} instances")
    if failed:
        raise RunFailed(f"instances {failed} may still be running (and billing): run "
                        "`ppsmoke.py --vastai --destroy-leftovers`")


async def _show_logs(vast: VastClient, instances: list[int], progress) -> None:
    for stage, contract in enumerate(instances):
        with trio.move_on_after(20):
            try:
                text = await vast.instance_logs(contract, tail=200)
            except VastError as exc:
                text = f"(no logs: {exc})"
            lines = text.splitlines()[-15:]
            progress(f"stage {stage} (instance {contract}) log tail:\n" + "\n".join("    " + ln for ln in lines))


async def destroy_leftovers(vast_api_key: str, base_url: str, ledger_path: Path, progress, *, transport=None) -> int:
    ledger = Ledger(ledger_path)
    leftover = ledger.ids()
    if not leftover:
        progress(f"no leftover instances recorded in {ledger_path}")
        return 0
    async with VastClient(vast_api_key, base_url=base_url, transport=transport) as vast:
        await destroy_all(vast, leftover, ledger, progress)
    return len(leftover)
