"""Turn ``conf/`` files and ``--set key=value`` overrides into :class:`PipelineParams`."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Optional

import yaml

from .params import ConfigError, PipelineParams

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_env(obj):
    """Replace ``${VAR}`` / ``${VAR:-default}`` in strings (for secrets kept out of files)."""
    if isinstance(obj, dict):
        return {k: _expand_env(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_expand_env(v) for v in obj]
    if isinstance(obj, str):
        def sub(m):
            val = os.environ.get(m.group(1), m.group(2))
            if val is None:
                raise ConfigError(f"environment variable {m.group(1)} is not set (used in config)")
            return val
        return _ENV.sub(sub, obj)
    return obj


def load_params(path: Optional[str] = None, overrides: Iterable[str] = ()) -> PipelineParams:
    """Read a YAML/JSON config (sections as in :class:`PipelineParams`) and apply overrides."""
    data = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        data = _expand_env(data)
    params = PipelineParams.from_dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        params = params.set_dotted(key.strip(), value)
    return params


def dump_params(params: PipelineParams) -> str:
    return yaml.safe_dump(params.to_dict(), sort_keys=False)
