"""Who may call what: a member's certificate, a client API key, and the surface each one opens.

The cluster token (PP_CLUSTER_TOKEN) is the secret the nodes of one cluster and their runner share. It is never
sent: the cluster's certificate authority is derived from it (node/transport/tls.py), and a member proves itself
by the certificate it shows when its TLS connection opens. Membership opens what nodes say to each other:
gossip (/swim/*), link streams and the per-message posts (activations, next tokens, ends), requests, cancels and
responses, hop figures, membership. The token sent as a bearer opens none of it (it would have crossed the
network, and a holder of it has no need to send it).

A client API key (PP_API_KEY, PP_API_KEY_FILE; vLLM's and llama-server's --api-key) opens the client surface
only: the OpenAI API on the entry (with vLLM's /tokenize and /detokenize), the chat page's view of the
pipeline, and /metrics on every node. With a
client key nobody can steer the cluster: declare a stage dead, announce a member, or have a node dial an
address of their choosing (ping-req). The cluster token is not a client key unless the operator says so
(PP_TOKEN_IS_API_KEY=1), and a client key equal to the token is refused at boot. A member's certificate is not a
client key either: the header decides the client surface, the connection the cluster's.

/health and the chat page (`/`) hold no secret and stay open. Every path not named here is the cluster's:
a route added later is closed to clients until someone decides otherwise. A path no route serves at all is
a 404 to a holder of either credential (it tells them nothing a route would) and a 401 to anyone else, so
that an OpenAI client asking for an endpoint this server lacks hears so, as vLLM's and OpenAI's say.

Decisions are pure (`refusal`); the app only asks them. A header is compared with every credential, each
comparison hmac.compare_digest's, so the time taken does not tell which key matched, or how much of one.
"""
from __future__ import annotations

import enum
import hmac

import attrs

OPEN_PATHS = frozenset({"/health", "/"})
CLIENT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/pipeline", "/metrics",
                          "/tokenize", "/detokenize", "/tokenizer_info"})
CLIENT_PREFIXES = ("/v1/models/",)  # every path under these is the client surface too: /v1/models/{id}


class Credential(enum.Enum):
    NONE = "none"  # no header, or one that is no credential of this node's
    CLUSTER = "cluster token"  # the token itself, sent as a bearer: a client key where the operator says so
    CLIENT = "client API key"


@attrs.frozen
class Refusal:
    status: int  # 401: no credential of the kind wanted; 403: a credential of the other kind
    message: str  # says which credential the path wants; never holds one


@attrs.frozen
class Keys:
    """The credentials one node accepts, as the `Authorization` header values that carry them."""

    token: bytes = attrs.field(repr=False)
    api_keys: tuple[bytes, ...] = attrs.field(repr=False)
    token_is_api_key: bool = False

    @classmethod
    def of(cls, token: str, api_keys: tuple[str, ...] = (), *, token_is_api_key: bool = False) -> Keys:
        return cls(bearer(token), tuple(bearer(k) for k in api_keys), token_is_api_key)

    def credential(self, authorization: str) -> Credential:
        given = authorization.encode()
        cluster = hmac.compare_digest(given, self.token)
        client = False
        for key in self.api_keys:  # no early exit: every key is compared
            client |= hmac.compare_digest(given, key)
        return Credential.CLUSTER if cluster else Credential.CLIENT if client else Credential.NONE

    def is_client(self, authorization: bytes) -> bool:
        """Whether a raw Authorization header carries a client API key (or, where it opens the client surface,
        the cluster token): read from a stream's HEADERS frame, before any request is made of it."""
        client = self.token_is_api_key and hmac.compare_digest(authorization, self.token)
        for key in self.api_keys:  # no early exit: every key is compared
            client |= hmac.compare_digest(authorization, key)
        return client


def bearer(secret: str) -> bytes:
    return f"Bearer {secret}".encode()


CLUSTER_ONLY = "this endpoint is for the cluster's own nodes"
WANT_MEMBER = (f"{CLUSTER_ONLY}: connect over TLS with a member's certificate (pp derives it from PP_CLUSTER_TOKEN; "
               f"the token itself is never sent)")
TOKEN_SENT = (f"{CLUSTER_ONLY}, which prove themselves with the cluster's certificate over TLS: the cluster token "
              f"is never sent, and sent it opens nothing of the cluster's")
WANT_KEY = "missing or wrong API key (Authorization: Bearer <a client API key: PP_API_KEY>)"
KEY_IS_NOT_TOKEN = (f"a client API key opens only the OpenAI API, /tokenize, /detokenize, /tokenizer_info, /v1/pipeline and "
                    f"/metrics; {CLUSTER_ONLY}, which prove themselves with the cluster's certificate")
TOKEN_IS_NOT_KEY = ("the cluster token is not a client API key here: use a client API key (PP_API_KEY), or start "
                    "the nodes with PP_TOKEN_IS_API_KEY=1")
MEMBER_IS_NOT_KEY = "a member's certificate is not a client API key: send one (Authorization: Bearer <PP_API_KEY>)"


def is_client_path(path: str) -> bool:
    return path in CLIENT_PATHS or path.startswith(CLIENT_PREFIXES)


def refusal(path: str, credential: Credential, *, member: bool = False, token_is_api_key: bool = False,
            routed: bool = True) -> Refusal | None:
    """Why a request for `path` carrying `credential` in its header, on a connection that showed a member's
    certificate or not (`member`), is refused, or None if it may go on. `routed`: some route serves `path`
    (with this method or another); a path none serves is a 404 to any credential."""
    if path in OPEN_PATHS:
        return None
    if not routed:
        return None if member or credential is not Credential.NONE else Refusal(401, WANT_KEY)
    if is_client_path(path):
        if credential is Credential.CLIENT or (credential is Credential.CLUSTER and token_is_api_key):
            return None
        if credential is Credential.CLUSTER:
            return Refusal(403, TOKEN_IS_NOT_KEY)
        return Refusal(403, MEMBER_IS_NOT_KEY) if member else Refusal(401, WANT_KEY)
    if member:
        return None
    if credential is Credential.CLUSTER:
        return Refusal(403, TOKEN_SENT)
    return Refusal(403, KEY_IS_NOT_TOKEN) if credential is Credential.CLIENT else Refusal(401, WANT_MEMBER)
