# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action plugin: plan a launch (ranks, environment per runtime, files, ports) on the controller."""

from __future__ import annotations

import datetime
import json
import os
import secrets
from pathlib import Path

from ansible.plugins.action import ActionBase
from ansible_collections.meshkit.cluster.plugins.module_utils.launch_plan import (
    LaunchError,
    build,
    nccl_from_env_file,
    stale_hosts,
    validate,
)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        result["changed"] = False
        try:
            settings = validate(dict(args.get("settings") or {}))
            changes = args.get("changes") or {}
            if changes.get("added") or changes.get("removed"):
                raise LaunchError(
                    "the cabling changed since setup.yml planned it (added: "
                    f"{', '.join(changes.get('added') or []) or 'none'}; removed: "
                    f"{', '.join(changes.get('removed') or []) or 'none'}); run setup.yml, then launch again"
                )
            if args.get("manifests") is not None:
                stale = stale_hosts(args["plan"], dict(args["manifests"]), args["state_dir"])
                if stale:
                    raise LaunchError("hostfiles are stale; nothing was started:\n  - " + "\n  - ".join(stale))
            nccl = dict(args.get("nccl") or {})
            for host, text in (args.get("torch_env") or {}).items():
                nccl.setdefault(host, nccl_from_env_file(text))
            job_id = args.get("job_id") or (
                datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
            )
            job = build(
                args["plan"],
                settings,
                job_id=job_id,
                state_dir=args["state_dir"],
                cluster=args["cluster"],
                ssh=dict(args.get("ssh") or {}),
                nccl=nccl,
                management_interface=dict(args.get("management_interface") or {}),
                master_port=int(args.get("master_port") or 29500),
                meshccl_port=int(args.get("meshccl_port") or 29600),
                bin_dirs=dict(args.get("bin_dirs") or {}),
            )
        except LaunchError as exc:
            result["failed"] = True
            result["msg"] = str(exc)
            return result
        data = job.as_dict() | {"timeout": settings.get("timeout") or 0, "grace": settings.get("grace", 3.0)}
        if args.get("dest"):
            # The job as planned (no token: that is made when the ranks start), for `meshkit launch`.
            dest = Path(args["dest"]) / job.job_id
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "job.json").write_text(json.dumps(data, indent=1) + "\n")
            data["log_dir"] = str(dest)
            os.chmod(dest, 0o700)
        result["job"] = data
        result["msg"] = (
            f"job {job.job_id}: {job.world_size} ranks of {job.runtime} on {len(job.hosts())} hosts "
            f"({', '.join(job.hosts())})"
        )
        return result
