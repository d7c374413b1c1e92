"""The vast.ai stand-in's offers: a fixed catalogue of fake machines, and vast's search-query operators and
ordering evaluated over it (pure). The stand-in's instance list uses the same matching and ordering."""
from __future__ import annotations

from collections.abc import Mapping

LOOPBACK = "127.0.0.1"  # every fake machine is this one
QUERY_META = frozenset({"order", "type", "limit", "allocated_storage", "disable_bundling", "extra_ids"})
DEFAULT_ORDER = (("score", "desc"),)
DEFAULT_LIMIT = 64


class QueryError(ValueError):
    """A search or list filter the stand-in cannot evaluate; answered as 400 invalid_args."""


# id, gpu_name, gpu_ram (MB), num_gpus, dph_total, reliability, direct_port_count, geolocation, verified
_OFFER_TABLE = (
    (21001001, "RTX 4090", 24564, 1, 0.35, 0.995, 4, "Norway, NO", True),
    (21001002, "RTX 4090", 24564, 1, 0.42, 0.999, 8, "Texas, US", True),
    (21001003, "RTX 3090", 24576, 1, 0.20, 0.990, 2, "Quebec, CA", True),
    (21001004, "RTX 3090", 24576, 1, 0.18, 0.950, 0, "Poland, PL", True),
    (21001005, "RTX 3060", 12288, 1, 0.08, 0.985, 2, "Ohio, US", True),
    (21001006, "A100 SXM4", 81920, 1, 1.10, 0.999, 16, "Oregon, US", True),
    (21001007, "A100 PCIE", 40960, 1, 0.75, 0.970, 4, "Sweden, SE", True),
    (21001008, "H100 SXM", 81559, 1, 2.40, 0.998, 10, "Finland, FI", True),
    (21001009, "RTX 4090", 24564, 2, 0.80, 0.992, 6, "Germany, DE", True),
    (21001010, "RTX A6000", 49140, 1, 0.45, 0.960, 3, "Japan, JP", True),
    (21001011, "RTX 3080", 10240, 1, 0.10, 0.900, 1, "Brazil, BR", False),
    (21001012, "L40S", 46068, 1, 0.85, 0.993, 5, "France, FR", True),
)


def catalogue() -> list[dict]:
    """Fresh copies of the fake offers, with the fields the CLI shows and filters on."""
    return [_offer(i, *row) for i, row in enumerate(_OFFER_TABLE)]


def _offer(i, ask_id, gpu, gpu_ram, n, dph, rel, ports, geo, verified) -> dict:
    dlperf = round(gpu_ram / 1000 * n * 1.5, 1)
    return {"id": ask_id, "ask_contract_id": ask_id, "bundle_id": ask_id, "machine_id": 40100 + i,
            "host_id": 900 + i, "num_gpus": n, "gpu_name": gpu, "gpu_ram": gpu_ram, "gpu_total_ram": gpu_ram * n,
            "cpu_ram": 64000 * n, "cpu_cores_effective": 8.0 * n, "cpu_ghz": 3.5, "disk_space": 200.0,
            "dph_total": dph, "dph_base": round(dph * 0.9, 4), "min_bid": round(dph * 0.5, 4),
            "reliability": rel, "reliability2": rel, "inet_up": 500.0 + 10 * i, "inet_down": 900.0 + 10 * i,
            "direct_port_count": ports, "public_ipaddr": LOOPBACK, "geolocation": geo, "cuda_max_good": 12.4,
            "driver_version": "550.54.14", "compute_cap": 890, "pcie_bw": 24.0, "dlperf": dlperf,
            "dlperf_per_dphtotal": round(dlperf / dph, 2), "score": round(100 * rel / (dph + 0.1), 3),
            "duration": 30 * 86400.0, "verification": "verified" if verified else "unverified",
            "verified": verified, "external": False, "rentable": True, "rented": False, "static_ip": True}


_OPERATORS = {
    "eq": lambda a, b: a == b, "neq": lambda a, b: a != b, "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b, "lt": lambda a, b: a < b, "lte": lambda a, b: a <= b,
    "in": lambda a, b: a in b, "notin": lambda a, b: a not in b,
}


def _coerce(operand: object, like: object) -> object:
    """The CLI sends numbers and booleans as text ({"num_gpus": {"eq": "1"}}); compare as the field's type."""
    if not isinstance(operand, str) or isinstance(like, str) or like is None:
        return operand
    if isinstance(like, bool):
        if operand.lower() not in ("true", "false"):
            raise QueryError(f"{operand!r} is not true or false")
        return operand.lower() == "true"
    try:
        return float(operand)
    except ValueError:
        raise QueryError(f"{operand!r} is not a number") from None


def matches(row: Mapping, query: Mapping) -> bool:
    """Whether `row` passes every `{field: {operator: operand}}` condition of `query`."""
    for field, conditions in query.items():
        if field in QUERY_META:
            continue
        if not isinstance(conditions, dict):
            raise QueryError(f"{field}: expected operators such as {{\"gte\": 1}}, got {conditions!r}")
        if field not in row:
            raise QueryError(f"unknown field {field!r}")
        for op, operand in conditions.items():
            if op not in _OPERATORS:
                raise QueryError(f"{field}: unknown operator {op!r} (use {', '.join(_OPERATORS)})")
            if op in ("in", "notin"):
                if not isinstance(operand, list):
                    raise QueryError(f"{field}: {op} takes a list")
                operand = [_coerce(x, row[field]) for x in operand]
            else:
                operand = _coerce(operand, row[field])
            try:
                if not _OPERATORS[op](row[field], operand):
                    return False
            except TypeError:
                raise QueryError(f"{field}: cannot compare {row[field]!r} {op} {operand!r}") from None
    return True


def ordered(rows: list[dict], order) -> list[dict]:
    """`rows` sorted by `order` ([[field, "asc"|"desc"], ...]), the first key most significant."""
    rows = list(rows)
    for entry in reversed(list(order)):
        field, direction = entry if isinstance(entry, (list, tuple)) and len(entry) == 2 else (None, None)
        if direction not in ("asc", "desc") or any(field not in row for row in rows):
            raise QueryError(f"cannot order by {entry!r}")
        rows.sort(key=lambda row: row[field], reverse=direction == "desc")
    return rows


def search_offers(offers: list[dict], query: Mapping) -> list[dict]:
    if not isinstance(query, Mapping):
        raise QueryError(f"the query must be a JSON object, got {query!r}")
    limit = query.get("limit") or DEFAULT_LIMIT
    if not isinstance(limit, int) or limit < 1:
        raise QueryError(f"limit must be a positive whole number, got {limit!r}")
    return ordered([o for o in offers if matches(o, query)], query.get("order") or DEFAULT_ORDER)[:limit]
