"""The shipped Prometheus and Grafana files against the real binaries (``make prometheus``):
``promtool check`` and ``promtool test rules`` on deploy/prometheus/, every metric name the
rules and the dashboard use exported by the controller, and a real Prometheus scraping a real
``ckptctl serve`` (one reference engine) through two cycles: its HTTP API finds the cycles'
metrics, the rules evaluate without error, and every PromQL expression of every panel of
deploy/grafana/ckpt-controller.json (Grafana's variables given concrete values) returns data.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections import Counter

from ckpt_controller.agent import AgentClient
from ckpt_controller.controller.metrics import Metrics
from support import ROOT
from support.config import engines_toml
from support.hooks import write_hook
from support.prometheus_server import Prometheus, http_get, prometheus_tool
from support.timing import scaled, wait_until

ROOT_DEPLOY = ROOT / "deploy"
RULES_DIR = ROOT_DEPLOY / "prometheus"
DASHBOARD = ROOT_DEPLOY / "grafana" / "ckpt-controller.json"
#: Grafana's built-in variables, as the test gives them (a window holding several 1 s scrapes)
BUILTINS = {"$__rate_interval": "1m", "$__interval": "5s", "$__range": "5m"}


def run(*args, cwd=RULES_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          timeout=scaled(120), cwd=cwd)


def rule_exprs() -> list[str]:
    """The ``expr`` of every rule (the rules file is read as text: no YAML library here)."""
    text = (RULES_DIR / "ckpt-controller.rules.yml").read_text()
    out = []
    for m in re.finditer(r"^( +)expr: (>-\n)?(.*?)(?=^\1\S)", text, re.S | re.M):
        out.append(m.group(3).strip())
    return out


def targets() -> list[tuple[str, dict]]:
    """(panel title, target) of every query target of every panel (rows' panels too)."""
    dash = json.loads(DASHBOARD.read_text())
    panels = list(dash["panels"])
    for p in dash["panels"]:
        panels += p.get("panels", [])
    return [(p["title"], t) for p in panels for t in p.get("targets", [])]


def panel_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query target of every panel."""
    return [(title, t["expr"]) for title, t in targets()]


def exported_names() -> set[str]:
    """Every sample name the controller's registry can show (a histogram's three series)."""
    m = Metrics(capture_deadline_s=1.0)
    names = set()
    for line in m.render().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            names |= ({f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                      if kind == "histogram" else {name})
    return names


def test_rules_and_dashboard_use_only_exported_metrics():
    exprs = rule_exprs()
    assert len(exprs) == 6
    targets = panel_targets()
    assert len(targets) >= 10
    used = {n for e in [*exprs, *(e for _, e in targets)] for n in re.findall(r"\bckpt_\w+", e)}
    assert used <= exported_names(), used - exported_names()
    # the ones the issue names are there
    assert {"ckpt_engine_state", "ckpt_engine_up", "ckpt_engine_capture_deadline_seconds",
            "ckpt_operations_total", "ckpt_drain_escalations_total",
            "ckpt_phase_duration_seconds_bucket", "ckpt_freed_bytes_total"} <= used


def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    promtool = prometheus_tool("promtool")
    out = run(promtool, "check", "rules", "ckpt-controller.rules.yml")
    assert out.returncode == 0 and "SUCCESS: 6 rules found" in out.stdout, out.stdout + out.stderr
    out = run(promtool, "test", "rules", "ckpt-controller.rules.test.yml")
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    out = run(promtool, "check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    # the unit tests do catch a broken rule: the FAILED alert on any state fails them
    text = (RULES_DIR / "ckpt-controller.rules.yml").read_text()
    (tmp_path / "ckpt-controller.rules.yml").write_text(
        text.replace('ckpt_engine_state{state="failed"} == 1',
                     'ckpt_engine_state{state="failed"} >= 0'))
    (tmp_path / "ckpt-controller.rules.test.yml").write_text(
        (RULES_DIR / "ckpt-controller.rules.test.yml").read_text())
    out = run(promtool, "test", "rules", "ckpt-controller.rules.test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "CkptEngineFailed" in out.stdout + out.stderr


def engines_config(*engines) -> str:
    return "metrics_port = 0\n" + engines_toml(*engines)


def substitute(expr: str, instance: str, engine: str) -> str:
    for var, value in BUILTINS.items():
        expr = expr.replace(var, value)
    # as Grafana gives a regex variable: escaped for a regex, in a PromQL string (\\ for \)
    for var, raw in (("$instance", instance), ("$engine", engine)):
        expr = expr.replace(var, re.escape(raw).replace("\\", "\\\\"))
    assert "$" not in expr, expr
    return expr


def value(prom: Prometheus, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def test_real_prometheus_scrapes_a_controller_and_runs_every_panel(
        spawn_reference, spawn_controller, ipc_dir):
    prometheus_tool("prometheus")  # or skip, saying so, before anything starts
    eng = spawn_reference("pm")
    write_hook(ipc_dir / "hooks", "post-resume", "50-fail", "exit 3")  # logged only: counted
    ctl = spawn_controller(engines_config(eng))
    port = ctl.info["metrics_port"]
    instance = f"127.0.0.1:{port}"
    prom = Prometheus(ipc_dir / "prom", {"ckpt-controller": [instance]})
    try:
        up = wait_until(lambda: [r for r in prom.query('ckpt_engine_up{engine="pm"}')
                                 if r["value"][1] == "1"], 30, "Prometheus seeing the engine up")
        assert up[0]["metric"]["instance"] == instance
        assert up[0]["metric"]["job"] == "ckpt-controller"
        assert value(prom, f'up{{job="ckpt-controller",instance="{instance}"}}') == 1
        for n in (1, 2):  # the second moves every counter the first made: rates see it
            out = ctl.ckptctl("cycle", "pm", "--json")
            assert out.returncode == 0, out.stdout + out.stderr
            wait_until(lambda n=n: value(
                prom, 'ckpt_operations_total{kind="cycle",outcome="succeeded"}') == n, 20,
                f"Prometheus seeing cycle {n}")
            wait_until(lambda: value(prom, 'ckpt_engine_state{engine="pm",state="running"}')
                       == 1, 20, "the engine running again")
        assert value(prom, 'ckpt_phase_duration_seconds_count{engine="pm",phase="capture"}') == 2
        assert value(prom, 'ckpt_hook_failures_total{engine="pm",point="post-resume"}') == 2
        assert value(prom, 'ckpt_engine_capture_deadline_seconds{engine="pm"}') == 600
        stamp = value(prom, 'ckpt_last_successful_cycle_timestamp_seconds{engine="pm"}')
        assert 0 <= value(prom, "vector(time())") - stamp < 120

        # every panel's queries, as Grafana would send them for this controller and engine
        for title, expr in panel_targets():
            query = substitute(expr, instance, "pm")
            result = wait_until(lambda q=query: prom.query(q), 10, f"data for {title!r}")
            values = [float(r["value"][1]) for r in result]
            assert any(math.isfinite(v) for v in values), (title, query, result)
        # the dashboard's variables: label_values(metric{...}, label) finds this controller
        dash = json.loads(DASHBOARD.read_text())
        for var in dash["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
            assert m, var
            selector = substitute(m.group(1), instance, "pm")
            found = {s.get(m.group(2)) for s in prom.api("series", **{"match[]": selector})}
            assert found & {instance, "pm"}, (var["name"], found)

        # the rules: loaded, evaluated against this data without error, none firing
        groups = wait_until(lambda: [g for g in prom.api("rules")["groups"]
                                     if all(r.get("lastEvaluation", "").startswith("2")
                                            for r in g["rules"])], 10, "rules evaluated")
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == 6
        assert all(r["health"] == "ok" for r in rules), rules
        assert not [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
        # /healthz and HEAD on the same port Prometheus scrapes
        assert http_get(f"http://{instance}/healthz") == (200, b"ok\n")
    finally:
        prom.stop()


def test_each_in_range_panel_counts_the_first_failure_of_each_kind(
        spawn_engine, spawn_controller, ipc_dir):
    """A controller's first hook failure, drain escalation, failed and rolled-back operation
    show on the dashboard's "in range" panels (they read 0 while the alerts fired: a counter
    series born at 1 has no increase()). Failures scripted against a real Prometheus, then
    each such panel's query over a range that began after Prometheus saw the counters at 0
    (increase() counts them) and over one that began before the controller (its series are
    new in it): each the true count, taken from the operations' own results."""
    prometheus_tool("prometheus")
    eng = spawn_engine("pf")
    ctl = spawn_controller(engines_config(eng))
    flag = ctl.dir / "fail-at"
    for point, code in (("pre-prepare", 7), ("post-release", 1)):
        write_hook(ctl, point, "10-fail", f'[ "$(cat {flag} 2>/dev/null)" = {point} ] && '
                                          f"exit {code}; exit 0")
    instance = f"127.0.0.1:{ctl.info['metrics_port']}"
    prom = Prometheus(ipc_dir / "prom", {"ckpt-controller": [instance]})
    try:
        for series in ('ckpt_hook_failures_total{engine="pf",point="pre-prepare"}',
                       'ckpt_drain_escalations_total{engine="pf",to="abort"}',
                       'ckpt_operations_total{kind="cycle",outcome="rolled_back"}'):
            wait_until(lambda s=series: value(prom, s) == 0, 30, f"Prometheus seeing {series} 0")
        time.sleep(3)  # a range that begins 1 s before the first failure holds a scrape of 0
        began = time.time()
        ops: Counter = Counter()

        def run(*args: str) -> dict:
            doc = json.loads(ctl.ckptctl(*args, "--json").stdout)
            ops[(doc["operation"], doc["status"])] += 1
            return doc

        assert run("cycle", "pf")["status"] == "succeeded"
        flag.write_text("post-release")  # released, then rolled back to RUNNING
        assert run("cycle", "pf")["status"] == "rolled_back"
        flag.write_text("pre-prepare")  # vetoed: a failure, the engine never left RUNNING
        assert run("cycle", "pf")["status"] == "failed"
        flag.unlink()
        for rid in ("r0", "r1"):  # 600 steps of 10 ms each: in flight when the drain begins
            eng.submit(rid, steps=600)
        with AgentClient(eng.control) as agent:
            wait_until(lambda: agent.status().in_flight == 2, 20, "2 requests in flight")
        drained = run("prepare", "pf", "--drain", "wait", "--drain-timeout", "0.05",
                      "--on-deadline", "abort", "--level", "0")
        assert drained["engines"][0]["drain"]["escalated_to"] == "abort", drained
        assert run("restore", "pf")["status"] == "succeeded"
        truth = {"hook failures": 2, "drain escalations": 1, "reconciles": 0}
        wait_until(lambda: value(prom, "sum(ckpt_operations_total)") == sum(ops.values())
                   and value(prom, "sum(ckpt_drain_escalations_total)") == 1, 20,
                   "Prometheus seeing the last operation")

        panels = {(title, t.get("legendFormat", "")): t["expr"] for title, t in targets()}
        for why, window in (("increase", f"{math.ceil(time.time() - began) + 1}s"),
                            ("new series", "5m")):
            for legend, want in truth.items():
                expr = panels[("Hook failures, drain escalations, reconciles in range", legend)]
                got = value(prom, substitute(expr.replace("$__range", window), instance, "pf"))
                assert got == want, (why, window, legend, got, want)
            expr = panels[("Operations in range", "{{kind}} {{outcome}}")]
            result = prom.query(substitute(expr.replace("$__range", window), instance, "pf"))
            counted = {(r["metric"]["kind"], r["metric"]["outcome"]): float(r["value"][1])
                       for r in result}
            assert {k: v for k, v in counted.items() if v} == dict(ops), (why, window, counted)
    finally:
        prom.stop()

