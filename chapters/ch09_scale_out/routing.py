"""Which replica gets a request: Serve's default (``pow2``) or a router that counts tokens (``least-tokens``).

``pow2``: of two replicas drawn, the one with fewer requests in flight. ``least-tokens`` (:class:`LeastOutstandingTokensRouter`):
the replica owing the fewest tokens, each request counting its ``X-Token-Budget`` (written by
:mod:`~chapters.ch09_scale_out.edge`) from routed to complete, by a ledger per proxy (each counts what it sent itself)."""

from __future__ import annotations

import json
import pickle
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

TOKEN_BUDGET_HEADER = b"x-token-budget"
ROUTERS = ("pow2", "least-tokens")  # --router: Serve's default, or the ledger below


def token_budget(body: bytes) -> int | None:
    """The most tokens a request's body may cost a replica (``/v1/inference`` or OpenAI): prompt plus the tokens it may generate,
    a text prompt counting its UTF-8 bytes (an upper bound for word pieces). None when unusable: routed as the cheapest."""
    # EXERCISE ch09.3 BEGIN "the token budget: a request's prompt plus what it may generate, from its body"
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    prompt: Any = request.get("input_ids", request.get("prompt"))
    if prompt is None and isinstance(request.get("messages"), list):
        prompt = "".join(str(m.get("content", "")) for m in request["messages"] if isinstance(m, dict))
    if isinstance(prompt, list):
        prompt_tokens = len(prompt)
    elif isinstance(prompt, str):
        prompt_tokens = len(prompt.encode())
    else:
        return None
    new_tokens = request.get("max_new_tokens", request.get("max_tokens"))
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 0:
        return None
    return prompt_tokens + new_tokens


def budget_of(pending_request: PendingRequest | None) -> int:
    """The ``X-Token-Budget`` the edge wrote into a request routed through the HTTP proxy (0 if none)."""
    if pending_request is None or not pending_request.args:
        return 0
    request = pending_request.args[0]
    try:
        if isinstance(request, bytes):
            request = pickle.loads(request)
        headers = request.asgi_scope["headers"]
    except Exception:  # not an HTTP request from the proxy (a handle call): no budget to read
        return 0
    for name, value in headers:
        if bytes(name).lower() == TOKEN_BUDGET_HEADER:
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0


class TokenLedger:
    """Tokens owed per replica: a request's budget from when it is routed until it completes."""
    def __init__(self) -> None:
        self.owed: dict[Any, int] = {}
        self.requests: dict[str, tuple[Any, int]] = {}  # request id -> (replica id, budget)

    def routed(self, request_id: str, replica_id: Any, budget: int) -> None:
        """``request_id`` went to ``replica_id``, which now owes its ``budget`` more tokens."""
        # EXERCISE ch09.1 BEGIN "the router's ledger: tokens owed per replica, the replica owing the fewest first"
        self.requests[request_id] = (replica_id, budget)
        self.owed[replica_id] = self.owed.get(replica_id, 0) + budget

    def completed(self, request_id: str) -> None:
        """``request_id`` is over (answered or failed): its replica no longer owes its budget. Unknown ids are ignored."""
        # EXERCISE ch09.1 BEGIN "the router's ledger: tokens owed per replica, the replica owing the fewest first"
        replica_id, budget = self.requests.pop(request_id, (None, 0))
        if replica_id is not None:
            self.owed[replica_id] -= budget

    def forget(self, replica_id: Any) -> None:
        """A replica that died owes nothing; its requests are the edge's to replay or fail."""
        self.owed.pop(replica_id, None)
        self.requests = {k: v for k, v in self.requests.items() if v[0] != replica_id}

    def rank(self, replica_ids: list[Any]) -> list[Any]:
        """Replica ids, the one owing the fewest tokens first (ties keep the given order)."""
        # EXERCISE ch09.1 BEGIN "the router's ledger: tokens owed per replica, the replica owing the fewest first"
        return sorted(replica_ids, key=lambda r: self.owed.get(r, 0))


class LeastOutstandingTokensRouter(FIFOMixin, RequestRouter):
    """Serve request router: the replica that owes the fewest tokens first, by the proxy's own ledger."""
    def initialize_state(self, **kwargs) -> None:
        self.ledger = TokenLedger()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        # one replica per rank: Serve asks the first whether it has room (max_ongoing_requests), then the next
        return [[by_id[replica_id]] for replica_id in self.ledger.rank(list(by_id))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.ledger.routed(pending_request.metadata.internal_request_id, replica_id, budget_of(pending_request))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.ledger.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.ledger.forget(replica_id)


def request_router_config(router: str) -> dict[str, Any]:
    """Serve's ``request_router_config`` for ``--router`` (empty: Serve's default, ``pow2``)."""
    if router == "pow2":
        return {}
    if router == "least-tokens":
        return {"request_router_class": f"{__name__}:LeastOutstandingTokensRouter"}
    raise ValueError(f"unknown router {router!r}; one of {', '.join(ROUTERS)}")
