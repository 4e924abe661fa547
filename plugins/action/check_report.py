# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: the report of a check (playbooks/check.yml) from the job's logs and every host's facts."""

from __future__ import annotations

import json
from pathlib import Path

from ansible.plugins.action import ActionBase
from ansible_collections.meshkit.cluster.plugins.plugin_utils.controller import MeshkitImports

MESHKIT = MeshkitImports()
with MESHKIT:
    from meshkit import check, check_drift, check_report


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        MESHKIT.require("check_report")
        result = super().run(tmp, task_vars or {})
        args = dict(self._task.args)
        plan = args["plan"]
        log_dir = Path(args["log_dir"])
        facts = {host: (answer or {}).get("facts") or {} for host, answer in (args.get("facts") or {}).items()}
        items = check_drift.drift(plan, facts)
        records = check.records_in(log_dir) if log_dir.is_dir() else []
        if not log_dir.is_dir():
            items.append({"flag": "not-ready", "where": "job", "cable": None, "detail": f"no job logs in {log_dir}"})
        config = args.get("config") or {}
        try:
            report = check_report.build(
                plan,
                records,
                items,
                facts,
                threshold=float(args.get("threshold") or 0.8),
                max_loss=float(args.get("max_loss") or 0.01),
                asymmetry=float(args.get("asymmetry") or 0.2),
                link_rate_bps=args.get("link_rate") or None,
                inventory_rates={h: (c or {}).get("meshkit_link_rate") for h, c in config.items()},
                quick=bool(args.get("quick")),
                cluster=str(args.get("cluster") or ""),
            )
        except ValueError as exc:
            return {**result, "failed": True, "msg": str(exc)}
        written = []
        if not self._play_context.check_mode:
            dest = Path(args["dest"])
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "check.json").write_text(json.dumps(report, indent=2) + "\n")
            written.append(str(dest / "check.json"))
            picture = args.get("picture") or str(dest / "cabling-check.svg")
            try:
                title = f"meshkit check {args.get('cluster') or ''}".strip()
                check_report.render(check_report.dot(plan, report, title), picture)
                written.append(picture)
            except (OSError, RuntimeError) as exc:
                result.setdefault("warnings", []).append(f"picture not drawn: {exc}")
            if args.get("prometheus"):
                check_report.write_prometheus(args["prometheus"], check_report.prometheus(report))
                written.append(args["prometheus"])
        result.update(
            changed=False,
            report=report,
            written=written,
            table=check_report.table(report).splitlines(),
            failed=not report["ok"],
            msg="nothing flagged" if report["ok"] else "flagged: " + "; ".join(report.get("problems") or []),
        )
        return result
