"""The Grafana dashboard (grafana/idlekeeper-heartbeat.json): importable on any Grafana
(its Prometheus data source an input), and every series its queries name is one a
real heartbeat server exports, with the labels the queries filter on.

The server is the command-line one, as its own process with two workers, a password
file and status ports (the ``start_server`` fixture, stopped by its PID), scraped over
HTTP with a device online. A fleet node's families (``--cluster``) are rendered from a
:class:`RedisCoordinator` that is never started: their names and labels do not depend
on Redis answering.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from servers.heartbeat.coordination.fleet.coordinator import RedisCoordinator
from servers.heartbeat.security.passwords import hash_password
from servers.prometheus import LiveCollector, render

from .test_heartbeat_clients import Server, raw_connect, start_server

__all__ = ["start_server"]  # the fixture

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "idlekeeper-heartbeat.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
VARIABLES = {"job", "instance", "worker"}
TARGET_LABELS = {"job", "instance"}
"""Labels Prometheus gives every series of a scrape target (the server does not export them)."""

SELECTOR = re.compile(r"\b((?:heartbeat|idlekeeper|process|python)_[a-zA-Z0-9_:]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
RATED = re.compile(r"\b(?:rate|irate|increase)\(\s*$")


def load() -> dict[str, Any]:
    with DASHBOARD.open() as f:
        dashboard: dict[str, Any] = json.load(f)
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included (rows themselves too)."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


@dataclass
class Exposed:
    """What /metrics exposes: each sample name's family type and label names."""

    types: dict[str, str] = field(default_factory=dict)
    labels: dict[str, set[str]] = field(default_factory=dict)
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.types[sample.name] = family.type
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                for label, value in sample.labels.items():
                    self.values.setdefault((sample.name, label), set()).add(value)


def problems(queries: list[str], exposed: Exposed) -> list[str]:
    """What is wrong with ``queries`` against ``exposed``: series that do not exist, label
    filters on labels they lack or values they never take, a worker filter missing, a
    counter not under rate(), a gauge under it, a histogram's buckets without le."""
    found: list[str] = []
    for expr in queries:
        for match in SELECTOR.finditer(expr):
            name, braces = match.group(1), match.group(2) or ""
            if name not in exposed.types:
                found.append(f"{name}: not exported ({expr})")
                continue
            matchers = {label: (op, value) for label, op, value in MATCHER.findall(braces)}
            have = exposed.labels[name]
            if not set(matchers) >= TARGET_LABELS:
                found.append(f"{name}: not filtered by $job and $instance ({expr})")
            if ("worker" in have) != ("worker" in matchers):
                found.append(f"{name}: worker filter {'missing' if 'worker' in have else 'on no such label'} ({expr})")
            for label, (op, value) in matchers.items():
                if label in TARGET_LABELS or "$" in value:
                    continue
                if label not in have:
                    found.append(f"{name}: no label {label} ({expr})")
                elif op == "=" and value not in exposed.values[(name, label)]:
                    found.append(f"{name}: {label} is never {value!r} ({expr})")
            cumulative = exposed.types[name] in ("counter", "histogram")
            rated = bool(RATED.search(expr[: match.start()]))
            if cumulative != rated:
                found.append(f"{name}: {'a counter without' if cumulative else 'a gauge under'} rate() ({expr})")
            if name.endswith("_bucket") and not (
                "histogram_quantile(" in expr and re.search(r"by \([^)]*\ble\b", expr)
            ):
                found.append(f"{name}: buckets outside histogram_quantile(... by (le)) ({expr})")
    return found


def test_the_dashboard_is_importable_with_any_prometheus() -> None:
    dashboard = load()
    assert dashboard["uid"] == "idlekeeper-heartbeat" and dashboard["title"]
    assert dashboard["schemaVersion"] >= 36 and dashboard["id"] is None
    [source] = dashboard["__inputs"]
    assert source == source | {"name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            assert "targets" not in panel and all(p["type"] != "row" for p in panel["panels"])
            assert panel["panels"] == [] or panel["collapsed"], "an open row's panels follow it"
            continue
        assert panel["title"] and panel.get("description"), panel["id"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == VARIABLES
    for variable in variables.values():
        assert variable["datasource"] == DATASOURCE and variable["query"]["query"].startswith("label_values(")
    used = {v for e in exprs(dashboard) for v in re.findall(r"\$(\w+)", e)}
    assert used - {"__rate_interval"} <= set(variables), used
    for expr in exprs(dashboard):
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), expr
        # Series named otherwise than the server's are Prometheus's own (up, per target).
        other = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr)) - {m[1] for m in SELECTOR.finditer(expr)}
        assert other <= {"up"}, expr


def test_every_series_the_dashboard_queries_is_exported(start_server: object, tmp_path: Path) -> None:
    passwords = tmp_path / "passwords"
    passwords.write_text(f"dev:{hash_password(b'right', iterations=1000)}\n")
    server: Server = start_server("--auth-file", str(passwords), workers=2, status=True)  # type: ignore[operator]
    device = raw_connect(server.port, "grafana-dev", 30, username="dev", password=b"right")
    assert server.status_port is not None
    exposed = Exposed()
    online = 0.0
    for port in (server.status_port, server.status_port + 1):  # worker i serves status on port + i
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        exposed.add(text)
        online += sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("heartbeat_devices_online{")
        )
    device.close()
    assert online == 1, "the scrapes are of the server the device is connected to"
    # A fleet node's own families (each worker is one with --cluster), as its /metrics renders them.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(RedisCoordinator("redis://127.0.0.1:1", "grafana/w0/1").figures))
    exposed.add(render(registry).decode())

    queries = exprs(load())
    assert problems(queries, exposed) == []
    named = {m.group(1) for e in queries for m in SELECTOR.finditer(e)}
    for family in ("heartbeat_devices_online", "heartbeat_offline_total", "idlekeeper_reaper_lag_seconds_bucket"):
        assert family in named
    assert any(n.startswith("heartbeat_fleet_") for n in named) and any(n.startswith("process_") for n in named)

    # The checks catch what they are for.
    sel = 'job=~"$job", instance=~"$instance"'
    wrong = [
        f'sum(heartbeat_device_online{{{sel}, worker=~"$worker"}})',  # no such series
        f"sum(heartbeat_devices_online{{{sel}}})",  # the worker filter forgotten
        f'process_resident_memory_bytes{{{sel}, worker=~"$worker"}}',  # a label it lacks
        f'rate(heartbeat_offline_total{{{sel}, worker=~"$worker", reason="keepalive"}}[5m])',  # no such reason
        f'heartbeat_connections_total{{{sel}, worker=~"$worker"}}',  # a counter not rated
        f"rate(heartbeat_fleet_queued{{{sel}}}[5m])",  # a gauge rated
        f'histogram_quantile(0.9, rate(idlekeeper_reaper_lag_seconds_bucket{{{sel}, worker=~"$worker"}}[5m]))',
        f'rate(idlekeeper_reaper_lag_seconds{{{sel}, worker=~"$worker"}}[5m])',  # the family, not a series
        'heartbeat_fleet_connected{job=~"$job"}',  # no instance filter
    ]
    assert [len(problems([q], exposed)) for q in wrong] == [1] * len(wrong)
