"""The tools an operator runs, for meshkit watch's lab test: Debian's real Prometheus and
node_exporter on the controller's loopback, Prometheus's HTTP API, and headless Chromium
(Debian's, driven by Playwright) rendering meshkit status's page."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "prometheus" / "meshkit.rules.yml"


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Poll ``probe`` until it returns something true (returned); AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _serve(argv: Callable[[int], list[str]], ready: Callable[[int], bool], log: Path) -> tuple[subprocess.Popen, int]:
    """Start a daemon on a free loopback port, again on another if the port was taken meanwhile."""
    for _ in range(5):
        port = _free_port()
        handle = log.open("ab")
        proc = subprocess.Popen(argv(port), stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        handle.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if ready(port):
                return proc, port
            time.sleep(0.2)
        proc.kill()
        proc.wait()
        if "address already in use" not in log.read_text(errors="replace"):
            break
    raise AssertionError(f"{argv(0)[0]} did not start: {log.read_text(errors='replace')[-3000:]}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except (OSError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def prometheus(where: Path, textfile_dir: Path, for_: str) -> Iterator[str]:
    """node_exporter (its textfile collector alone, reading ``textfile_dir``) and Prometheus (scraping it every
    second, evaluating the shipped rules every second with ``for:`` made ``for_``) on loopback; Prometheus's URL."""
    exporter = shutil.which("prometheus-node-exporter") or "/usr/bin/prometheus-node-exporter"
    where.mkdir(parents=True, exist_ok=True)
    rules = where / "meshkit.rules.yml"
    rules.write_text(RULES.read_text().replace("for: 5m", f"for: {for_}"))
    procs: list[subprocess.Popen] = []
    try:
        ne, ne_port = _serve(
            lambda port: [
                exporter,
                f"--web.listen-address=127.0.0.1:{port}",
                "--collector.disable-defaults",
                "--collector.textfile",
                f"--collector.textfile.directory={textfile_dir}",
            ],
            lambda port: _answers(f"http://127.0.0.1:{port}/metrics"),
            where / "node-exporter.log",
        )
        procs.append(ne)
        config = where / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(rules)],
                    "scrape_configs": [{"job_name": "node", "static_configs": [{"targets": [f"127.0.0.1:{ne_port}"]}]}],
                }
            )
        )
        prom, prom_port = _serve(
            lambda port: [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={where / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            lambda port: _answers(f"http://127.0.0.1:{port}/-/ready"),
            where / "prometheus.log",
        )
        procs.append(prom)
        yield f"http://127.0.0.1:{prom_port}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    return get(f"{url}/api/v1/query?query={urllib.request.quote(expr)}")["data"]["result"]


def meshkit_alerts(url: str) -> list[dict[str, Any]]:
    """Every alert Prometheus holds (pending or firing) from meshkit's rules."""
    return [a for a in get(f"{url}/api/v1/alerts")["data"]["alerts"] if a["labels"]["alertname"].startswith("Meshkit")]


def evaluated_after(url: str, moment: float) -> bool:
    """Every rule group of Prometheus's has been evaluated since ``moment`` (Unix time)."""
    groups = get(f"{url}/api/v1/rules")["data"]["groups"]
    return bool(groups) and all(rfc3339(g["lastEvaluation"]) > moment for g in groups)


def rfc3339(text: str) -> float:
    """Prometheus's times (nanoseconds, Z or an offset) as Unix time."""
    from datetime import datetime

    found = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", text)
    assert found is not None, text
    zone = "+00:00" if found.group(3) == "Z" else found.group(3)
    return datetime.fromisoformat(found.group(1) + zone).timestamp() + float("0" + (found.group(2) or ""))


def render(page: Path, screenshot: Path) -> dict[str, Any]:
    """``page`` opened from disk in headless Chromium: what a person sees of it (computed styles, from the
    rendered DOM), and a screenshot."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.goto(page.resolve().as_uri())
            seen = tab.evaluate(
                """() => ({
                  rows: [...document.querySelectorAll('tr.cable')].map(r => ({
                    cable: r.dataset.cable,
                    colour: getComputedStyle(r.querySelector('td.name')).color,
                    cells: [...r.querySelectorAll('td')].map(c => c.innerText),
                    points: r.querySelectorAll('svg.spark circle').length,
                    red_points: [...r.querySelectorAll('svg.spark circle')]
                      .filter(c => getComputedStyle(c).fill === 'rgb(214, 39, 40)').length,
                    runbook: [...r.querySelectorAll('td.flags a')].map(a => a.href),
                  })),
                  edges: [...document.querySelectorAll('#picture g.edge')].map(g => ({
                    id: g.id,
                    stroke: getComputedStyle(g.querySelector('path')).stroke,
                  })),
                  summary: document.querySelector('.summary').innerText,
                  text: document.body.innerText,
                })"""
            )
            tab.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return seen
