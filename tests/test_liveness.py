"""Liveness through gossip, at node level: a stage that computes for several protocol periods is
never suspected, and a stage that stops mid-generation ends the runner's wait in seconds."""
import trio

from cluster import FAST_SWIM, slow_stub, start_cluster
from node.membership.gossip import State
from runner.orchestrator import StageDied


async def test_a_stage_computing_for_several_protocol_periods_is_never_declared_dead(nursery, tmp_path, monkeypatch):
    # Each step blocks for 5 protocol periods, longer than the suspicion timeout: had the compute held up the
    # event loop, the stage could not answer probes or refute and would be declared dead (and step aside). A
    # passing suspicion is allowed: on a loaded 2-core machine a probe can miss by a hair (seen once in a full run).
    orch, _, _ = await start_cluster(nursery, 3, tmp_path)
    step_s = 5 * FAST_SWIM.protocol_period_s
    slow_stub(monkeypatch, step_s)
    seen = set()

    async def watch():
        while True:
            await orch.swim.wait_until(lambda s: any(m.state is not State.ALIVE and (m.id, m.state) not in seen
                                                      for m in s.members().values()))
            seen.update((m.id, m.state) for m in orch.swim.members().values() if m.state is not State.ALIVE)

    async with trio.open_nursery() as inner:
        inner.start_soon(watch)
        with trio.fail_after(60):
            response = await orch.submit("Say hello", max_tokens=3)
        inner.cancel_scope.cancel()
    assert response.error is None and len(response.token_ids) == 3  # 3 steps x 3 stages of blocking compute
    assert {state for _, state in seen} <= {State.SUSPECT}, seen
    nursery.cancel_scope.cancel()


async def test_a_stage_stopped_mid_generation_is_reported_dead_within_the_gossip_bound(nursery, tmp_path, monkeypatch):
    n = 3
    orch, _, scopes = await start_cluster(nursery, n, tmp_path)
    slow_stub(monkeypatch, 0.05)
    T = FAST_SWIM.protocol_period_s
    # round-robin reaches it within (n - 1) periods (the orchestrator is a member too: n stages + 1),
    # one period to probe, the suspicion timeout, and slack for a loaded machine
    bound = (n + 1) * T + T + FAST_SWIM.suspicion_mult * T + 3 * T

    async def stop_stage_1():
        await trio.sleep(1.0)
        scopes[1].cancel()

    nursery.start_soon(stop_stage_1)
    started = trio.current_time()
    # Either gossip declares it dead first, or stage 0 gives up sending to it and says so: both name it.
    with trio.fail_after(30):
        try:
            response = await orch.submit("Say hello", max_tokens=400)
        except StageDied as exc:
            assert exc.member.meta.stage == 1
        else:
            assert response.failed_stage == 0 and "pp-stage-1" in response.error
    assert trio.current_time() - started - 1.0 <= bound
    nursery.cancel_scope.cancel()
