"""deploy/grafana/splitserve.json reads only series splitserve exports: every PromQL
expression in the dashboard (panels and variables) parses, and each series it names, and
each label it matches or groups on, is in what a real gateway, prefill worker and decode
worker serve on /metrics after one disaggregated request."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.launcher import ClusterSpec, LocalCluster
from tests.factories import tiny_model_dir
from tests.integration.serving_util import call_http
from tests.unit.deploy.promql import Parsed, PromQLError, parse, parse_variable_query

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "splitserve.json")
# Labels Prometheus attaches when it scrapes (the pod monitor keeps namespace and pod).
TARGET_LABELS = {"namespace", "pod", "instance", "job"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                             "_created"),
            "gauge": ("",), "info": ("_info",), "unknown": ("",), "summary": ("_sum", "_count")}
ALWAYS_REMOTE = ("routing:\n  scorers: [{name: queue, weight: 1.0}]\n  picker: max_score\n"
                 "  decider: {name: threshold, threshold: 0}\n")


def dashboard() -> dict[str, Any]:
    with open(DASHBOARD) as f:
        return json.load(f)


def expressions(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) of every panel target."""
    for panel in dash["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for t in inner.get("targets", []):
                yield inner["title"], t["expr"]


def variable_queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            yield v["name"], v["query"]["query"] if isinstance(v["query"], dict) else v["query"]


def test_the_parser_rejects_what_prometheus_rejects() -> None:
    got = parse('histogram_quantile(0.9, sum by (le, part) (rate(a:b_bucket{x=~"$v"}'
                '[$__rate_interval]))) / ignoring (part) group_left sum(c:d offset 5m)')
    assert got.metrics == {"a:b_bucket", "c:d"} and got.grouping == {"le", "part"}
    assert got.matchers["a:b_bucket"] == {"x"}
    for bad in ("sum(rate(a[5m])", "rate(a[5m]))", "a{x=}", "a{x=\"1\"", "nosuchfn(a)",
                "a +", "sum by le (a)", "a[5]"):
        with pytest.raises(PromQLError):
            parse(bad)


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dash = dashboard()
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "model"} <= variables
    ds = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + \
            p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    for where, expr in [*expressions(dash), *variable_queries(dash)]:
        used = set(re.findall(r"\$\{?(\w+)", expr)) - {"__rate_interval"}
        assert used <= variables, (where, used - variables)


def _exports(ports: list[int]) -> tuple[set[str], dict[str, set[str]]]:
    """Every series name the pods serve (a family's samples by its type, seen or not) and,
    per series name, the labels its samples carry."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            names.update(fam.name + s for s in SUFFIXES[fam.type])
            for s in fam.samples:
                names.add(s.name)
                labels.setdefault(s.name, set()).update(s.labels)
    return names, labels


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], dict[str, set[str]]]:
    tmp = tmp_path_factory.mktemp("grafana")
    profile = tmp / "routing.yaml"
    profile.write_text(ALWAYS_REMOTE)
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_prefill=1, num_decode=1,
                       num_colocated=0, transport="tcp",
                       worker_args=("--num-blocks", "64", "--max-num-seqs", "4",
                                    "--max-num-batched-tokens", "64"),
                       gateway_args=("--routing", str(profile)), ready_timeout_s=150,
                       log_dir=str(tmp / "logs"))
    with LocalCluster(spec) as cluster:
        model = os.path.basename(os.path.normpath(spec.model_dir))
        status, body, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
            "model": model, "prompt": [5 + i for i in range(40)], "max_tokens": 4,
            "ignore_eos": True})
        assert status == 200, body
        ports = [cluster.http_port] + [int(c.extra["metrics_port"]) for c in cluster.children
                                       if c.name.startswith(("prefill", "decode"))]
        assert len(ports) == 3
        return _exports(ports)


@pytest.mark.timeout(300)
def test_every_series_and_label_the_dashboard_reads_is_exported(exported) -> None:
    names, labels = exported
    dash = dashboard()
    parsed: list[tuple[str, str, Parsed]] = [
        (where, expr, parse(expr)) for where, expr in expressions(dash)]
    parsed += [(where, q, parse_variable_query(q)) for where, q in variable_queries(dash)]
    assert len(parsed) >= 20
    for where, expr, p in parsed:
        assert p.metrics, (where, expr)
        assert p.metrics <= names, (where, sorted(p.metrics - names))
        seen = set(TARGET_LABELS) | {"le"}
        for metric in p.metrics:
            seen |= labels.get(metric, set())
        for metric, matched in p.matchers.items():
            if metric in labels:  # a family with samples: its labels are known
                assert matched <= labels[metric] | TARGET_LABELS, (where, metric, matched)
        if p.metrics <= set(labels):  # else a family none of whose series is seen yet
            assert p.grouping <= seen, (where, sorted(p.grouping - seen))
