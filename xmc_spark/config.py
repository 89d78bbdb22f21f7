"""Turn ``conf/`` files and ``--set key=value`` overrides into :class:`PipelineParams`."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Sequence, Union

import yaml

from . import secrets
from .params import ConfigError, PipelineParams

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_env(obj):
    """Replace ``${VAR}`` / ``${VAR:-default}`` in strings (for secrets kept out of files);
    values of secret-looking variables are registered for redaction."""
    if isinstance(obj, dict):
        return {k: _expand_env(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_expand_env(v) for v in obj]
    if isinstance(obj, str):
        def sub(m):
            val = os.environ.get(m.group(1), m.group(2))
            if val is None:
                raise ConfigError(f"environment variable {m.group(1)} is not set (used in config)")
            if secrets.looks_secret(m.group(1)):
                secrets.register(val)
            return val
        return _ENV.sub(sub, obj)
    return obj


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, section by section (mappings merged key by key)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return _expand_env(data)


def load_params(paths: Union[None, str, Sequence[str]] = None, overrides: Iterable[str] = ()) -> PipelineParams:
    """Read YAML/JSON configs (sections as in :class:`PipelineParams`), later files over earlier
    ones (e.g. ``conf/emr.yaml`` then an experiment's algorithm params), then apply overrides."""
    if isinstance(paths, str):
        paths = [paths]
    data: dict = {}
    for path in paths or ():
        data = _merge(data, _read(path))
    params = PipelineParams.from_dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        params = params.set_dotted(key.strip(), value)
    params.check_combination()
    for k, v in params.spark.conf.items():
        if secrets.looks_secret(k):
            secrets.register(str(v))
    return params


def dump_params(params: PipelineParams) -> str:
    """The resolved config as YAML, secrets masked."""
    return yaml.safe_dump(secrets.redact(params.to_dict()), sort_keys=False)
