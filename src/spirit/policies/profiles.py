"""Saving and loading a policy's learned state (`--profile-file`), as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from spirit.policies.base import Policy


class ProfileError(ValueError):
    pass


def save_profile(policy: Policy, path: Path) -> None:
    payload = {"method": policy.name, "model": policy.model.name, "layers": policy.model.num_layers,
               "state": policy.state_dict()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)  # never leave a half-written profile


def load_profile(policy: Policy, path: Path) -> None:
    try:
        payload = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from None
    if payload.get("method") != policy.name or payload.get("layers") != policy.model.num_layers:
        raise ProfileError(
            f"profile {path} is for method {payload.get('method')!r} on a {payload.get('layers')}-layer "
            f"model, not {policy.name!r} on {policy.model.num_layers} layers"
        )
    policy.load_state_dict(payload["state"])
