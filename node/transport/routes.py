"""What the app's route groups share with it: the refusal of whatever needs the model too early, and the
app's traffic counters, which /health shows."""
from __future__ import annotations

import collections

import attrs
from quart import current_app
from quart_trio import QuartTrio

from roles.actions import Refused

STILL_LOADING = "this stage is still loading its weights"  # the one answer (a 503) to what needs a model too early
_TRAFFIC = "pp.traffic"  # its key in app.extensions


def still_loading() -> Refused:
    """The refusal of whatever needs the model while the dispatcher is `loading`."""
    return Refused(503, STILL_LOADING)


@attrs.define
class Traffic:
    """What an app has served, for tests and /health."""

    http_versions: collections.Counter = attrs.Factory(collections.Counter)  # requests per HTTP version
    body_bytes: collections.Counter = attrs.Factory(collections.Counter)  # request body bytes per path: on the wire

    def install(self, app: QuartTrio) -> None:
        app.extensions[_TRAFFIC] = self

    @staticmethod
    def of(app: QuartTrio | None = None) -> Traffic:
        """The app's counters (the current request's app by default)."""
        return (app or current_app).extensions[_TRAFFIC]
