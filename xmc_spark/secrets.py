"""Secrets from the environment: substituted into the config, never logged.

A config value ``${VAR}`` is read from the environment (``config._expand_env``). When VAR's
name looks like a secret (TOKEN, SECRET, PASSWORD, PASSWD, CREDENTIAL, KEY) its value is
registered here, as is the value of any ``spark.conf`` key that looks like one (e.g.
``spark.hadoop.fs.s3a.secret.key``). Registered values are replaced by ``***`` in MLflow
params, the logged config, ``xmc-spark params`` output and every log record that goes
through :class:`RedactingFilter` (installed on the root handlers by the CLI).
"""
from __future__ import annotations

import logging
import re
from typing import Any

SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|[._])KEY($|[._]))", re.IGNORECASE)
MASK = "***"
_values: set = set()


def looks_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def register(value: Any) -> None:
    if isinstance(value, str) and len(value) >= 4:
        _values.add(value)


def redact(obj: Any) -> Any:
    """``obj`` (str, dict, list) with every registered secret replaced by ``***``."""
    if isinstance(obj, dict):
        return {k: redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        for v in sorted(_values, key=len, reverse=True):
            obj = obj.replace(v, MASK)
    return obj


class RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _values:
            record.msg = redact(record.getMessage())
            record.args = ()
        return True


def install_log_filter() -> None:
    for h in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in h.filters):
            h.addFilter(RedactingFilter())
